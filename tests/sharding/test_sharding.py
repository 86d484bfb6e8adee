"""Shards of the flat layout (aggsrv/sharding.py): cut points, local offset tables, and sums
over real torch.distributed (gloo) processes that give the whole model's per-segment values from
each shard's slice."""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from bitwise_diff import describe_difference
from strategy_cases import strategy_cases

from aggsrv import kernels
from aggsrv.sharding import ALIGN, LocalReducer, ShardMap, TorchReducer, imbalance


def _offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int64)


def test_even_cuts_are_aligned_balanced_and_cover_the_vector() -> None:
    for D in (0, 1, 63, 64, 1000, 4_194_304 + 17):
        for N in (1, 2, 3, 7):
            m = ShardMap.even(D, N)
            assert m.shards == N and m.numel == D and m.bounds[0] == 0 and m.bounds[-1] == D
            assert all(b % ALIGN == 0 or b == D for b in m.bounds[1:-1]), m.bounds
            assert sum(m.local_numel(r) for r in range(N)) == D
            # Within one alignment step of D / N on either side of each cut.
            for r in range(1, N):
                assert abs(m.bounds[r] - D * r / N) <= ALIGN / 2 or m.bounds[r] == D
    assert imbalance(ShardMap.even(4_194_304 + 17, 3)) < 1.0001
    assert ShardMap.even(100, 4, align=1).bounds == (0, 25, 50, 75, 100)


def test_bad_maps_are_refused() -> None:
    for bounds in ((), (0,), (1, 5), (0, 5, 3), (0, -1), (0, 2.5)):
        with pytest.raises(ValueError):
            ShardMap(bounds)
    with pytest.raises(ValueError, match="shards"):
        ShardMap.even(10, 0)
    m = ShardMap((0, 4, 10))
    with pytest.raises(ValueError, match="rank"):
        m.slice(2)
    with pytest.raises(ValueError, match="offset"):
        m.local_offsets([0, 3, 9], 0)  # does not end at D
    with pytest.raises(ValueError, match="last dimension"):
        m.split(torch.zeros(9))


def test_local_offsets_clip_every_segment_to_the_slice() -> None:
    # Segments [0,5) [5,5) [5,12) [12,30); shards [0,8) [8,8) [8,30): the cut at 8 falls inside
    # the third segment, and the middle shard is empty.
    m = ShardMap((0, 8, 8, 30))
    offs = _offsets([5, 0, 7, 18])
    assert m.local_offsets(offs, 0).tolist() == [0, 5, 5, 8, 8]
    assert m.local_offsets(offs, 1).tolist() == [0, 0, 0, 0, 0]
    assert m.local_offsets(offs, 2).tolist() == [0, 0, 0, 4, 22]
    # Segment lengths over the shards add up to the whole model's.
    lengths = sum(torch.diff(m.local_offsets(offs, r)) for r in range(m.shards))
    assert lengths.tolist() == [5, 0, 7, 18]
    assert [m.owner(i) for i in (0, 7, 8, 29)] == [0, 0, 2, 2]
    with pytest.raises(IndexError):
        m.owner(30)


def test_split_and_join_round_trip_rows() -> None:
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    X = torch.randn(3, 301, generator=gen)
    m = ShardMap.even(301, 3, align=16)
    parts = m.split(X)
    assert [p.shape[-1] for p in parts] == [m.local_numel(r) for r in range(3)]
    assert all(p.data_ptr() == X[:, lo:].data_ptr() for p, lo in zip(parts, m.bounds, strict=False))
    assert torch.equal(m.join(parts), X)
    assert ShardMap.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="part 1"):
        m.join([parts[0], parts[0], parts[2]])


def test_local_reducer_is_the_identity() -> None:
    t = torch.randn(4)
    assert LocalReducer().sum_(t) is t


# ------------------------------------------------------------------ real processes (gloo)


def _group_main(rank: int, world: int, init: str, tasks: mp.Queue, results: mp.Queue) -> None:
    """One rank of a GlooGroup: joins the group, then runs each task it is sent (a function of
    this module called as ``fn(rank, world, init_error, *args, results)``) until it gets None.
    A failed join is handed to every task, which reports it instead of the parent hanging."""
    torch.set_num_threads(1)
    init_error = None
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    except Exception:
        init_error = traceback.format_exc()
    while (task := tasks.get()) is not None:
        fn, args = task
        fn(rank, world, init_error, *args, results)
    if init_error is None:
        dist.destroy_process_group()


class GlooGroup:
    """``world`` spawned processes in one gloo group, shared by this module's tests of that
    world size: starting them (a fresh interpreter each, importing torch, and the rendezvous)
    cost more than most tasks they run. A task gets a fresh TorchReducer and fresh strategies,
    so a test sees nothing of the one before. After a task that failed or timed out the ranks
    may be out of step in a collective, so the next task gets new processes."""

    def __init__(self, world: int, tmp: Path) -> None:
        self.world = world
        self.tmp = tmp
        self.procs: list = []
        self.starts = 0
        self.broken = True

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.starts += 1
        init = f"file://{self.tmp / f'rendezvous-{self.starts}'}"
        self.procs = [
            ctx.Process(target=_group_main, args=(r, self.world, init, q, self.results))
            for r, q in enumerate(self.tasks)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, replies: int, timeout: float) -> list[tuple]:
        """``fn(rank, world, init_error, *args, results)`` on every rank; the ``replies``
        tuples they put on ``results`` (the last item of each: a traceback, or None), up to
        the first traceback."""
        if self.broken:
            self.close()
            self._start()
        self.broken = True
        for q in self.tasks:
            q.put((fn, args))
        got: list[tuple] = []
        while len(got) < replies and not (got and got[-1][-1]):
            got.append(self.results.get(timeout=timeout))
        self.broken = bool(got[-1][-1])
        return got

    def close(self) -> None:
        for q in self.tasks if self.procs else ():
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.procs = []


@pytest.fixture(scope="module", params=[2, 3], ids=str)
def gloo(request, tmp_path_factory) -> GlooGroup:
    group = GlooGroup(request.param, tmp_path_factory.mktemp(f"gloo{request.param}"))
    yield group
    group.close()


def _rank_main(rank: int, world: int, init_error, seed: int, queue: mp.Queue) -> None:
    """One shard: its slice of the same random rows, partial sums, reduced over the group."""
    try:
        if init_error:
            raise RuntimeError(init_error)
        reducer = TorchReducer()
        gen = torch.Generator().manual_seed(seed)
        sizes = [int(n) for n in torch.randint(0, 90, (9,), generator=gen)] + [1, 333]
        offs = _offsets(sizes)
        D = int(offs[-1])
        X = torch.randn(4, D, generator=gen)
        Y = torch.randn(4, D, generator=gen)
        m = ShardMap.even(D, world, align=8)  # small D: cuts inside segments
        lo, hi = m.slice(rank)
        local = m.local_offsets(offs, rank)
        dots = reducer.sum_(kernels.layer_dots(X[:, lo:hi], Y[:, lo:hi], local))
        gram = reducer.sum_(kernels.gram_matrix(X[:, lo:hi], other=Y[:, lo:hi]).double())
        own = torch.full((3,), float(rank + 1), dtype=torch.float32)
        total = reducer.sum_(own.clone())
        # numpy arrays travel by value; a tensor would travel as a file descriptor that the
        # parent can only fetch while this process is still alive.
        values = (dots.numpy(), gram.numpy(), total.numpy())
        queue.put((rank, *values, reducer.world_size, reducer.rank, None))
    except Exception:  # the parent reports it instead of hanging on the queue
        queue.put((rank, None, None, None, None, None, traceback.format_exc()))


def test_partial_sums_over_gloo_processes_give_the_whole_models(gloo: GlooGroup) -> None:
    world = gloo.world
    seed = random.randrange(1 << 30)
    results = gloo.run(_rank_main, seed, replies=world, timeout=120)
    errors = [r[-1] for r in results if r[-1]]
    assert not errors, errors[0]
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(n) for n in torch.randint(0, 90, (9,), generator=gen)] + [1, 333]
    offs = _offsets(sizes)
    D = int(offs[-1])
    X = torch.randn(4, D, generator=gen).double()
    Y = torch.randn(4, D, generator=gen).double()
    want_dots = kernels.layer_dots(X, Y, offs, backend="reference")
    want_gram = X @ Y.T
    results = [
        (r[0], *(None if a is None else torch.from_numpy(a) for a in r[1:4]), *r[4:])
        for r in results
    ]
    for rank, dots, gram, total, size, got_rank, _ in sorted(results, key=lambda r: r[0]):
        assert size == world and got_rank == rank
        # Every shard holds the same whole-model values (the sum's order is the same on all).
        assert torch.equal(dots, results[0][1]) and torch.equal(gram, results[0][2])
        scale = X.norm(dim=1, keepdim=True) * Y.norm(dim=1, keepdim=True)
        assert ((dots.double() - want_dots).abs() <= 1e-5 * scale).all(), (seed, rank)
        assert ((gram - want_gram).abs() <= 1e-5 * (X.norm(dim=1)[:, None] * Y.norm(dim=1))).all()
        assert total.tolist() == [world * (world + 1) / 2] * 3


# ------------------------------------------------------------------ strategies on shards

CLIENTS = 4
STRATEGY_CASES = strategy_cases(CLIENTS)


def _drive(strategies, rows: torch.Tensor, seed: int, steps: int = 24) -> list[tuple]:
    """The same call sequence on every strategy (one per shard, or the whole model's): each
    client asks for a job, updates arrive in a seeded order, timers fire when due. ``rows`` is
    a [steps, CLIENTS, D] pool of noise; each strategy gets its slice. Returns every call's
    outcome per strategy (job ids, versions, statuses), which must agree across shards."""
    from aggsrv.strategies import StrategyError, Update, UpdateKind

    rng = random.Random(seed)
    trace: list[list[tuple]] = [[] for _ in strategies]
    now = 0.0
    clients = [f"c{i}" for i in range(CLIENTS)]
    for strategy, _ in strategies:
        for c in clients:
            strategy.on_register(c, now)
    for step in range(steps):
        now += 0.1
        order = clients[:]
        rng.shuffle(order)
        for c in order:
            for i, (strategy, local) in enumerate(strategies):
                deadline = strategy.next_deadline()
                if deadline is not None and now >= deadline:
                    strategy.on_timer(now)
                    trace[i].append(("timer", strategy.version))
                job = strategy.job_for(c, now)
                if job is None:
                    trace[i].append(("wait", c))
                    continue
                k = clients.index(c)
                tensor = (job.weights + local(rows[step, k]) * 0.1).contiguous()
                update = Update(c, job.job_id, job.base_version, f"{c}-{step}", 10 + k,
                                job.recipe.work_target, UpdateKind.WEIGHTS, tensor)  # fmt: skip
                try:
                    outcome = strategy.on_update(update, now)
                    trace[i].append((c, job.job_id, outcome.status.name, outcome.version))
                except StrategyError as exc:
                    trace[i].append((c, job.job_id, type(exc).__name__))
    return trace


# Strategies whose server-side arithmetic is elementwise over [D]: no whole-model quantity,
# so each shard's slice evolves exactly as that slice of one server's model, with no
# communication (Fed-OGD's bases are group means; TWAFL is FedHist without EGS, HAA or
# rescaling). The other four (ORTHOFL's per-layer coefficients, FedHist's cosines and norms,
# FedDGIC's and FedFG's grouping cosines) take other decisions on a slice until they use the
# kernels' reduce= hook (docs/sharding.md); this test fails for them today.
ELEMENTWISE = [
    "fedavg", "fedasync", "fedbuff", "fedprox", "fedogd", "mifa", "feden", "ca2fl", "twafl",
]  # fmt: skip


@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("shards", [2, 3])
def test_elementwise_strategies_on_shards_equal_one_server(name: str, shards: int) -> None:
    from aggsrv.layout import ModelLayout
    from aggsrv.sharding import ShardLayout
    from aggsrv.strategies import make_strategy

    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    whole = ModelLayout.from_named_shapes(
        [("a.weight", (7, 13)), ("a.bias", (7,)), ("b.weight", (3, 7)), ("b.bias", (3,))]
    )
    D = whole.numel  # 91 + 7 + 21 + 3 = 122: cuts on multiples of 8 fall inside tensors
    initial = torch.randn(D, generator=gen)
    rows = torch.randn(24, CLIENTS, D, generator=gen)
    config = STRATEGY_CASES[name]
    single = make_strategy(name, layout=whole, initial=initial, config=config, device="cpu")
    shard_map = ShardMap.even(D, shards, align=8)
    parts = []
    for r in range(shards):
        layout = ShardLayout(whole, shard_map, r)
        strategy = make_strategy(name, layout=layout, initial=layout.local(initial).clone(),
                                 config=config, device="cpu")  # fmt: skip
        parts.append((strategy, layout.local))
    traces = _drive([(single, lambda t: t), *parts], rows, seed)
    assert single.version >= 2, (name, traces[0][-5:])
    assert all(t == traces[0] for t in traces[1:]), f"{name}: the shards took other decisions"
    joined = shard_map.join([s.global_model() for s, _ in parts])
    assert torch.equal(joined, single.global_model()), f"{name} on {shards} shards ({seed=})"


def test_strategy_coverage() -> None:
    from aggsrv.strategies import STRATEGIES

    assert set(STRATEGY_CASES) == set(STRATEGIES)


# ------------------------------------------------------------------ strategies on gloo shards

REDUCING = ["orthofl", "fedhist", "feddgic", "fedfg"]
# Differential privacy's clipping on shards: every shard clips with the whole model's norm (its
# squared slice norms summed over the shards), so the clipped models join to one server's. No
# noise here: each shard draws its own slice's noise from a stream of its own.
DP = {"dp_clip_norm": 0.8, "dp_noise_multiplier": 0.0}
GLOO_CASES = {
    **STRATEGY_CASES,
    **{f"{name}+dp": {**STRATEGY_CASES[name], **DP}
       for name in ("fedavg", "fedasync", "fedbuff", "ca2fl")},
    # Per-layer clipping: a tensor cut by a shard boundary is measured whole (summed norms).
    "fedbuff+dp-layers": {**STRATEGY_CASES["fedbuff"], **DP, "dp_clip_layers": "size"},
}  # fmt: skip


def _strategy_name(case: str) -> str:
    return case.split("+")[0]


def _whole_layout():
    from aggsrv.layout import ModelLayout

    return ModelLayout.from_named_shapes(
        [("a.weight", (7, 13)), ("a.bias", (7,)), ("b.weight", (3, 7)), ("b.bias", (3,))]
    )


def _inputs(seed: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(D, generator=gen), torch.randn(24, CLIENTS, D, generator=gen)


def _strategies_main(rank, world, init_error, seed, names, queue) -> None:
    """One shard process: every strategy in ``names`` on this shard's slice, with a
    TorchReducer over the gloo group, driven by the same calls as one server."""
    try:
        from aggsrv.sharding import ShardLayout
        from aggsrv.strategies import make_strategy

        if init_error:
            raise RuntimeError(init_error)
        whole = _whole_layout()
        initial, rows = _inputs(seed, whole.numel)
        layout = ShardLayout(whole, ShardMap.even(whole.numel, world, align=8), rank)
        for name in names:
            strategy = make_strategy(
                _strategy_name(name), layout=layout, initial=layout.local(initial).clone(),
                config=GLOO_CASES[name], device="cpu", reducer=TorchReducer(),
            )  # fmt: skip
            trace = _drive([(strategy, layout.local)], rows, seed)[0]
            queue.put((rank, name, trace, strategy.global_model().numpy().copy(), None))
    except Exception:
        queue.put((rank, None, None, None, traceback.format_exc()))


def test_every_strategy_on_gloo_shards_equals_one_server(gloo: GlooGroup) -> None:
    from aggsrv.strategies import make_strategy

    world = gloo.world
    seed = random.randrange(1 << 30)
    names = list(GLOO_CASES)
    got: dict[str, dict[int, tuple]] = {}
    for rank, name, trace, model, error in gloo.run(
        _strategies_main, seed, names, replies=world * len(names), timeout=180
    ):
        assert error is None, error
        got.setdefault(name, {})[rank] = (trace, torch.from_numpy(model))
    whole = _whole_layout()
    initial, rows = _inputs(seed, whole.numel)
    shard_map = ShardMap.even(whole.numel, world, align=8)
    for name in names:
        single = make_strategy(_strategy_name(name), layout=whole, initial=initial,
                               config=GLOO_CASES[name], device="cpu")  # fmt: skip
        trace = _drive([(single, lambda t: t)], rows, seed)[0]
        assert single.version >= 2, name
        shards = [got[name][r] for r in range(world)]
        for r, (shard_trace, _) in enumerate(shards):
            assert shard_trace == trace, f"{name}: shard {r} took other decisions ({seed=})"
        joined = shard_map.join([m for _, m in shards])
        want = single.global_model()
        # Partial sums over shards (and clip norms summed from them) round differently.
        if name in REDUCING or "+dp" in name:
            err = float((joined - want).norm() / want.norm())
            assert err <= 1e-5, f"{name} on {world} shards: relative error {err:.2e} ({seed=})"
        else:
            diff = describe_difference(joined, want, shard_map.bounds)
            assert not diff, f"{name} on {world} shards ({seed=}): {diff}"
