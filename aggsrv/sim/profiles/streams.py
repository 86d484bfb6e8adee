"""Seeding: every draw of a profile comes from its own generator, keyed by
(seed, client, round, stream), so the draws do not depend on the order they are asked in."""

from __future__ import annotations

import numpy as np

# One stream per kind of draw; never 0 (see job_rng).
STREAM_TIER = 1
STREAM_SPEED = 2
STREAM_RPI_ASSIGN = 3
STREAM_RPI_JOB = 4
STREAM_DROP_CHOICE = 5
STREAM_DROP_LEAVE = 6
STREAM_DROP_RETURN = 7
STREAM_PARTIAL_PICK = 8
STREAM_PARTIAL_PERSISTENT = 9
STREAM_PARTIAL_WORK = 10
STREAM_TRACE = 11  # durations of simulated clients beyond a replayed trace
STREAM_DELAY = 100  # + the delay's position among the profile's delays: each has its own stream


def job_rng(seed: int, client: int, round_: int, stream: int) -> np.random.Generator:
    """The generator of one draw: keyed by all four words, so every draw has its own stream.

    The key always has four words because numpy's SeedSequence ignores trailing zero words
    (``[1, 2, 3]`` and ``[1, 2, 3, 0]`` give the same stream), so keys of different lengths
    could collide. Client-level draws use round 0, round-level draws client 0.
    """
    return np.random.default_rng([seed, client, round_, stream])
