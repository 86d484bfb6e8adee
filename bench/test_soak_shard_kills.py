"""A long soak of a sharded federation under random SIGKILLs (the suite's kill tests are bounded
to a few kills; this runs for minutes): clients push FedBuff one-hot DELTA updates all the while,
and again and again one shard, rank 0, or every shard is SIGKILLed at a random moment; the lost
shard is restarted alone (the others rejoin it) or every shard is restarted, at random. At the
end every acknowledged update must be counted exactly once (tests/support/shard_kills.py).

    pytest bench/test_soak_shard_kills.py -s                          # 10 minutes, 3 shards
    AGGSRV_SOAK_MINUTES=60 AGGSRV_SOAK_SHARDS=2 pytest bench/test_soak_shard_kills.py -s

It prints one line per kill and a summary: kills, acknowledged updates, and the longest time a
client waited for an acknowledgement (the recovery the clients saw).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import torch
from shard_kills import CLIENTS, D, ShardProcesses, check_exactly_once, flush, layout
from shard_kills import push_until_acked as push

from aggsrv.client import Client


def test_soak_random_sigkills(tmp_path: Path) -> None:
    minutes = float(os.environ.get("AGGSRV_SOAK_MINUTES", "10"))
    shards = int(os.environ.get("AGGSRV_SOAK_SHARDS", "3"))
    seed = int(os.environ.get("AGGSRV_SOAK_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    fed = ShardProcesses(tmp_path, shards)
    acked: list[str] = []
    stop = threading.Event()
    waits: list[float] = []

    def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            t0 = time.monotonic()
            push(f"c{i}", fed.address, 1, acked, stop, first=k)
            waits.append(time.monotonic() - t0)
            k += 1

    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=layout(), initial=torch.zeros(D))
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        end = time.monotonic() + 60 * minutes
        kills = 0
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.5, 5.0))
            victims = rng.choice([[0], [rng.randrange(1, shards)], list(range(shards))])
            alone = len(victims) == 1 and rng.random() < 0.5
            fed.kill(victims)
            if not alone:
                time.sleep(rng.uniform(0.0, 0.5))
                fed.kill(list(range(shards)))
            fed.start(resume=True, ranks=victims if alone else None)
            kills += 1
            print(f"kill {kills}: shards {victims}, restarted {'alone' if alone else 'all'}; "
                  f"{len(set(acked))} updates acknowledged", flush=True)  # fmt: skip
        stop.set()
        for t in threads:
            t.join(180)
        flush(fed.address, acked)
        version = check_exactly_once(fed, acked)
        print(f"soak (seed {seed}): {shards} shards, {minutes:g} min, {kills} kills, "
              f"{len(set(acked))} acknowledged updates, each counted once, version {version}; "
              f"longest wait for an acknowledgement {max(waits):.1f} s", flush=True)  # fmt: skip
    finally:
        stop.set()
        fed.close()
