"""aggsrv.client: what a federated client runs: local training for a job, and the Client."""

from aggsrv.values import PendingReason

from .client import Client, ClientJob, Pending, PushResult
from .train import TrainResult, train

__all__ = [
    "Client", "ClientJob", "Pending", "PendingReason", "PushResult", "TrainResult", "train",
]  # fmt: skip
