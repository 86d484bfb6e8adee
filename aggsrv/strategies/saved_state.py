"""What a strategy saves to resume bit-exactly, and how it resumes from it.

A saved state holds each version tensor once (the model and the start weights of the jobs that
began from it), the jobs, the clients, the RNG, the ledger and the components' own states (float
buffers, update filters, the privacy accountant), and the subclass's ``_extra_state``. A load
copies each saved storage once (:class:`SharedCopies`), so tensors that shared memory live
share it again.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping
from typing import Any

import torch

from aggsrv.strategies.job import Job
from aggsrv.strategies.state_copy import SharedCopies, clone_tensors
from aggsrv.values import Recipe

__all__ = ["load_state", "save_state"]

logger = logging.getLogger(__name__)


def save_state(s: Any) -> dict[str, Any]:
    """A point-in-time copy (tensors cloned) of everything strategy ``s`` needs to resume (``s``
    is typed loosely: this module sits below :mod:`aggsrv.strategies.base`, which calls it)."""
    book = s.jobs
    bases: dict[int, torch.Tensor] = {}
    jobs = []
    for job in book.open.values():
        bases.setdefault(job.base_version, job.weights)
        jobs.append(
            {
                "job_id": job.job_id,
                "client_id": job.client_id,
                "base_version": job.base_version,
                "deadline": job.deadline,
                "issued_at": job.issued_at,
                "recipe": job.recipe.to_dict(),
                "tensors": {k: v for k, v in job.tensors.items() if k != "weights"},
            }
        )
    state = {
        "strategy": s.name,
        "layout_hash": s.layout.hash,
        "config": s.config.to_dict(),
        "version": s.version,
        "model": s._model,
        "bases": bases,
        "clients": dict(s._clients),
        "jobs": jobs,
        "job_of": dict(book.of_client),
        "completed_job": dict(book.completed),
        "next_job_id": book.next_id,
        "now": s._now,
        "rng": s._rng.get_state(),
        "ledger": s.ledger.state_dict(),
        "float_buffers": s.float_buffers.state_dict(),
        "extra": s._extra_state(),
    }
    if s.update_filters is not None:
        state["update_filter"] = s.update_filters.state_dict()
    if s.privacy is not None:
        state["privacy"] = s.privacy.state()
    return clone_tensors(state)


def _config_changed(saved: Mapping[str, Any], config: Any) -> bool:
    """Whether the running config differs from the saved one; a key the saved config lacks
    (added by a later release) counts only when it is not at its default."""
    current = config.to_dict()
    defaults = type(config)().to_dict()
    added = [k for k in current if k not in saved and current[k] == defaults.get(k)]
    return dict(saved) != {k: v for k, v in current.items() if k not in added}


def load_state(s: Any, state: Mapping[str, Any]) -> None:
    """Resume ``s`` from :func:`save_state` output (same strategy and layout). A state refused
    part-way (ValueError) may leave ``s`` half-loaded: the caller loads what it had back."""
    if state["strategy"] != s.name:
        raise ValueError(f"state is for strategy {state['strategy']!r}, not {s.name!r}")
    if state["layout_hash"] != s.layout.hash:
        raise ValueError("state was saved for a different model layout (layout hash differs)")
    if _config_changed(state["config"], s.config):
        logger.warning("%s: resuming with a config that differs from the saved one", s.name)

    # One copy per saved storage, shared by every restore function of this load (the
    # subclasses' and the float buffers' too): what shared memory live shares it again.
    s._copy_saved = SharedCopies(s.device)
    s.version = int(state["version"])
    s._model = s._restore(state["model"])
    s._absmax = None
    s._versions.clear()
    # One tensor per version, shared by every job that started from it (and the model).
    bases = {int(v): s._restore(t) for v, t in state["bases"].items()}
    if s.version in bases:
        bases[s.version] = s._model
    s._clients = {str(c): float(t) for c, t in state["clients"].items()}
    book = s.jobs
    book.open = {}
    for j in state["jobs"]:
        tensors = {"weights": bases[int(j["base_version"])]}
        tensors.update({k: s._restore(v) for k, v in j["tensors"].items()})
        recipe = Recipe.from_dict(j["recipe"])
        job = Job(
            job_id=int(j["job_id"]),
            client_id=str(j["client_id"]),
            base_version=int(j["base_version"]),
            deadline=j["deadline"],
            recipe=recipe if recipe != s._recipe else s._recipe,
            tensors=types.MappingProxyType(tensors),
            issued_at=float(j.get("issued_at", 0.0)),  # states saved before leases: 0
        )
        book.open[job.job_id] = job
    book.of_client = {str(c): int(j) for c, j in state["job_of"].items()}
    book.completed = {str(c): int(j) for c, j in state["completed_job"].items()}
    book.next_id = int(state["next_job_id"])
    s._now = float(state.get("now", 0.0))
    s._rng.set_state(state["rng"].clone())
    s.ledger.load_state_dict(state["ledger"])
    s.float_buffers.load_state_dict(state["float_buffers"], s._copy_saved)
    s._load_extra_state(state["extra"])
    if s.update_filters is not None:
        s.update_filters.load_state_dict(state.get("update_filter"))
    if s.privacy is not None:
        saved = state.get("privacy")
        if saved is None:
            raise ValueError(
                "the saved state has no privacy accountant (it was saved without the dp_ "
                "keys): resuming it with differential privacy would start epsilon at 0"
            )
        s.privacy.load(saved)
    del s._copy_saved
    # The loaded jobs (a subclass may have given them tensors of its own) hold theirs.
    book.lease_all()
