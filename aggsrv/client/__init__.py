"""aggsrv.client: what a federated client runs: local training for a job, and the Client."""

from aggsrv.values import PendingReason

from .client import Client, ClientJob, Pending, PushResult
from .compression import Compression
from .train import TrainResult, train

__all__ = [
    "Client", "ClientJob", "Compression", "Pending", "PendingReason", "PushResult",
    "TrainResult", "train",
]  # fmt: skip
