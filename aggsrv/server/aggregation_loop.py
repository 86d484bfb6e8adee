"""The aggregation loop of a federation: every strategy call runs on a single worker thread, one
at a time, so a strategy needs no locks and heavy kernels never block the event loop that serves
gRPC.

The event loop reads strategy state only through the aggregation thread (:meth:`read`) or what
a call left behind (aggsrv.server.publication's ``Settled``), never beside a call half made. A
call that fails in a way that may have half-changed the strategy stops the federation
(aggsrv.server.fail_stop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from aggsrv.server.fail_stop import AggregationFailed, DurabilityError, FailStop
from aggsrv.server.replication import Replication
from aggsrv.server.shards import ShardLost
from aggsrv.strategies import ShardsDisagree, StrategyError

T = TypeVar("T")


class AggregationLoop:
    """The one aggregation thread of a federation and the rule its calls follow."""

    def __init__(self, fail_stop: FailStop, settle: Callable[[], None]) -> None:
        """``settle`` runs on the aggregation thread after each call that went through (what
        the event loop will publish)."""
        self._fail_stop = fail_stop
        self._settle = settle
        # A sharded federation's (set when it is sharded): the shards agree on each call.
        self.replication: Replication | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggregation")

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        refusals: tuple[type[Exception], ...] = (),
        after_failure: bool = False,
    ) -> T:
        """Run `fn(*args)` on the aggregation thread, after every call queued before it.

        Fail-stop: `fn` refuses with a StrategyError (which changes nothing) or one of
        ``refusals``. Any other exception may have left the strategy half-changed and the call
        unlogged: the federation stops taking writes (:meth:`FailStop.fail`), and this call and
        every later one raise AggregationFailed (``after_failure`` runs `fn` anyway: leaving
        the shard group)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._run_call, fn, args, refusals, after_failure
        )

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)`, a read of strategy state, on the aggregation thread between two
        calls, so it never sees one half made. Runs after a failure too (what it reads may then
        be half-changed: a caller that answers from it checks the failure)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _run_call(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        refusals: tuple[type[Exception], ...],
        after_failure: bool,
    ) -> T:
        """(aggregation thread) :meth:`call`'s rule; a sharded rank 0 then compares what the
        call it announced did with the other shards."""
        fail_stop = self._fail_stop
        if fail_stop.failure is not None and not after_failure:
            raise AggregationFailed(fail_stop.failure)
        replication = self.replication
        try:
            result = fn(*args)
        except StrategyError:
            if replication is not None:
                replication.agree_on_announced(refused=True)
            raise
        except BaseException as exc:
            # The call it announced, if any, ends here: the next call starts with none.
            announced = replication.take_announced() if replication is not None else None
            if isinstance(exc, (DurabilityError, *refusals)) or not isinstance(exc, Exception):
                raise  # a refusal; or the log failed, and fail() said why
            if isinstance(exc, ShardLost):  # in a sum over the shards, inside the call
                fail_stop.dirty = True
                fail_stop.fail(str(exc), lost_shard=True)
                raise DurabilityError(fail_stop.failure) from exc
            if isinstance(exc, ShardsDisagree):
                raise fail_stop.stop_on_divergence(exc, announced) from exc
            where = getattr(fn, "__qualname__", repr(fn))
            raise fail_stop.stop_on_unexpected(exc, where) from exc
        if replication is not None:
            replication.agree_on_announced(refused=False)
        self._settle()
        return result

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)`` on the aggregation thread from a thread that is not the event
        loop (a shard following rank 0, the metrics endpoint)."""
        return self._executor.submit(fn, *args)

    def on_aggregation_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the aggregation thread and wait for it, from a thread that is not
        serving (an offline replay: torch's kernels cost the same there as live)."""
        return self._executor.submit(fn, *args).result()

    def shutdown(self) -> None:
        """Stop the thread once the calls queued are done."""
        self._executor.shutdown()
