"""A unit of client work, the book of the jobs a strategy handed out and has not closed, and who
gets one in a synchronous round.

A client has at most one outstanding job. Each open job holds a lease on the version tensors it
carries (:mod:`aggsrv.strategies.buffers`), so their buffers are not reused while a client may
still derive its delta from them; the lease is given up when the job is retired. A job whose
``job_lease_seconds`` ran out is retired by the strategy's timer, and an update that arrives for
it before the timer ran is refused alike.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from aggsrv.strategies.buffers import Lease, VersionBuffers
from aggsrv.strategies.errors import InvalidUpdate, JobSuperseded
from aggsrv.values import PendingReason, Recipe, Update

__all__ = ["Job", "JobBook", "RoundStrategy", "round_job"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Job:
    """One unit of client work: start from ``tensors["weights"]`` (version ``base_version``).

    ``deadline`` is in seconds on the strategy's clock (None: no deadline). ``tensors`` maps names
    to flat [D] snapshots (always "weights"; Fed-OGD adds "basis") that are never mutated.
    """

    job_id: int
    client_id: str
    base_version: int
    deadline: float | None
    recipe: Recipe
    tensors: Mapping[str, torch.Tensor]
    issued_at: float = 0.0  # on the strategy's clock; the job's lease runs from here

    @property
    def weights(self) -> torch.Tensor:
        """The weights the client starts from."""
        return self.tensors["weights"]


class RoundStrategy(Protocol):
    """What :func:`round_job` uses of a strategy in synchronous rounds."""

    _round_open: bool
    _participants: dict[str, bool]  # the clients sampled into the round -> reported yet
    _deadline: float | None  # the round's

    def _maybe_open_round(self, now: float) -> None: ...

    def _no_job(self, reason: PendingReason) -> None: ...

    def _issue_job(
        self, client_id: str, deadline: float | None, now: float | None = None
    ) -> Job: ...


def round_job(strategy: RoundStrategy, client_id: str, now: float) -> Job | None:
    """A client's job from a strategy in synchronous rounds (FedAvg's sync mode, FedDGIC's
    grouping phase): the round opens if it is due; a client sampled into the open round that
    has not reported gets a job with the round's deadline, any other none, saying why."""
    strategy._maybe_open_round(now)
    if not strategy._round_open:
        return strategy._no_job(PendingReason.NO_ROUND_OPEN)
    reported = strategy._participants.get(client_id)
    if reported is None:
        return strategy._no_job(PendingReason.NOT_SELECTED)
    if reported:
        return strategy._no_job(PendingReason.ALREADY_REPORTED)
    return strategy._issue_job(client_id, deadline=strategy._deadline, now=now)


class JobBook:
    """The jobs a strategy issued and has not closed, by id and by client, with their leases.

    Job ids only grow, and both dicts are kept in id order (the state lists them so)."""

    def __init__(self, versions: VersionBuffers, lease_seconds: float | None, owner: str) -> None:
        """``versions``: the pool the jobs' tensors come from; ``lease_seconds``: how long a job
        stays open (None: until it is superseded or its update arrives); ``owner``: the
        strategy's name, for the log."""
        self._versions = versions
        self.lease_seconds = lease_seconds
        self.owner = owner
        self.open: dict[int, Job] = {}  # outstanding jobs by id
        self.of_client: dict[str, int] = {}  # client id -> its outstanding job id
        # client id -> id of the last job whose update was accepted (for Heartbeat's COMPLETED)
        self.completed: dict[str, int] = {}
        self.next_id = 1
        self._leases: dict[int, Lease] = {}  # each open job's lease on its tensors

    @property
    def issued(self) -> int:
        """How many jobs were issued (job ids are 1 to this number)."""
        return self.next_id - 1

    def outstanding(self, client_id: str) -> Job | None:
        """The client's outstanding job, if any."""
        job_id = self.of_client.get(client_id)
        return None if job_id is None else self.open[job_id]

    def issue(
        self,
        client_id: str,
        base_version: int,
        deadline: float | None,
        recipe: Recipe,
        tensors: dict[str, torch.Tensor],
        now: float,
    ) -> Job:
        """A new job for ``client_id``, which supersedes its outstanding one."""
        old = self.outstanding(client_id)
        if old is not None:
            self.retire(old)  # superseded: the client asked again, so it dropped the job
        job = Job(
            job_id=self.next_id,
            client_id=client_id,
            base_version=base_version,
            deadline=deadline,
            recipe=recipe,
            tensors=types.MappingProxyType(tensors),
            issued_at=now,
        )
        self.next_id += 1
        self.open[job.job_id] = job
        self.of_client[client_id] = job.job_id
        self._leases[job.job_id] = self._versions.lease(*job.tensors.values())
        return job

    def retire(self, job: Job) -> None:
        """Forget an outstanding job; its start weights go with the last job referring to them."""
        del self.open[job.job_id]
        if self.of_client.get(job.client_id) == job.job_id:
            del self.of_client[job.client_id]
        lease = self._leases.pop(job.job_id, None)
        if lease is not None:
            lease.release()

    def reopen(self, job: Job) -> None:
        """Undo :meth:`retire` of the client's current job (an update refused while being
        applied), in id order."""
        self.open[job.job_id] = job
        self.of_client[job.client_id] = job.job_id
        self._leases[job.job_id] = self._versions.lease(*job.tensors.values())
        self.open = dict(sorted(self.open.items()))
        self.of_client = dict(sorted(self.of_client.items(), key=lambda item: item[1]))

    def complete(self, job: Job) -> None:
        """The job's update was answered (taken or filtered): Heartbeat reports it COMPLETED."""
        self.completed[job.client_id] = job.job_id

    def expired(self, job: Job, now: float) -> bool:
        """Whether the job's lease has ended by ``now``."""
        lease = self.lease_seconds
        return lease is not None and now >= job.issued_at + lease

    def next_expiry(self) -> float | None:
        """When the first open job's lease ends."""
        lease = self.lease_seconds
        if lease is None or not self.open:
            return None
        return min(job.issued_at for job in self.open.values()) + lease

    def expire(self, now: float) -> None:
        """Retire every job whose lease has ended by ``now`` (and free what only it held)."""
        for job in [j for j in self.open.values() if self.expired(j, now)]:
            self.retire(job)
            logger.info(
                "%s: job %d of %s retired: its lease of %g s ended", self.owner, job.job_id,
                job.client_id, self.lease_seconds,
            )  # fmt: skip

    def require_leased(self, job: Job, now: float) -> None:
        """Refuse an update whose job's lease ended (the timer may not have retired it yet)."""
        if self.expired(job, now):
            raise JobSuperseded(
                f"job {job.job_id} was issued at {job.issued_at:.3f} and its lease "
                f"(job_lease_seconds={self.lease_seconds:g}) ended before the update "
                "arrived; discard this update and ask for a new job"
            )

    def for_update(self, update: Update) -> Job:
        """The open job ``update`` answers, or the refusal that says why there is none."""
        job = self.open.get(update.job_id)
        if job is None:
            if 1 <= update.job_id < self.next_id:
                raise JobSuperseded(
                    f"job {update.job_id} is no longer open (completed, replaced by a newer job "
                    "for this client, or its round closed); discard this update and ask for a "
                    "new job"
                )
            raise InvalidUpdate(f"job {update.job_id} was never issued by this server")
        if job.client_id != update.client_id:
            raise InvalidUpdate(
                f"job {job.job_id} belongs to client {job.client_id!r}, not {update.client_id!r}"
            )
        if update.base_version != job.base_version:
            raise InvalidUpdate(
                f"update says it started from version {update.base_version}, but job "
                f"{job.job_id} started from version {job.base_version}"
            )
        return job

    def job_state(self, client_id: str, job_id: int) -> str:
        """What became of ``job_id`` for ``client_id``: "current", "completed" (its update was
        accepted; the last such job per client is remembered), "superseded" (issued by this
        server, no longer open) or "unknown" (never issued, or another client's open job)."""
        job = self.open.get(job_id)
        if job is not None:
            return "current" if job.client_id == client_id else "unknown"
        if self.completed.get(client_id) == job_id:
            return "completed"
        if 1 <= job_id < self.next_id:
            return "superseded"
        return "unknown"

    def open_job(self, client_id: str, job_id: int) -> Job | None:
        """Job ``job_id`` if it is ``client_id``'s and still open."""
        job = self.open.get(job_id)
        return job if job is not None and job.client_id == client_id else None

    def lease_all(self) -> None:
        """Hold each open job's tensors again, after a load replaced the jobs (a strategy may
        have given them tensors of its own)."""
        for lease in self._leases.values():
            lease.release()
        self._leases = {j: self._versions.lease(*job.tensors.values())
                        for j, job in self.open.items()}  # fmt: skip
