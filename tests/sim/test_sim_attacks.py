"""Byzantine attackers in the simulator: each attack's arithmetic against a float64 numpy
oracle, the choice of attackers, the spec's errors, and short runs on both transports."""

from __future__ import annotations

import json
import random
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from aggsrv.cli import main
from aggsrv.client.train import TrainResult
from aggsrv.sim import SimConfig, run
from aggsrv.sim.attacks import (
    ATTACKS,
    Attack,
    alie_z_max,
    choose_attackers,
    parse_attack,
)
from aggsrv.sim.setup import client_id, prepare
from aggsrv.values import Recipe

SMALL = {
    "strategy": "fedavg",
    "strategy_config": {"learning_rate": 0.05, "batch_size": 16},
    "dataset": "digits",
    "clients": 5,
    "model": "mlp",
    "profile": "tiers",
    "budget": "3r",
    "eval_every": "1r",
    "transport": "inproc",
    "seed": 3,
}


class FixedTrainer:
    """Stands in for LocalTrainer: client c's job returns ``deltas[c]`` (float32)."""

    def __init__(self, deltas: dict[int, np.ndarray]) -> None:
        self.deltas = deltas

    def num_samples(self, client: int) -> int:
        return 10

    def run(self, client, round_, weights, *args, **kwargs) -> TrainResult:
        delta = torch.from_numpy(self.deltas[client].astype(np.float32))
        return TrainResult(
            weights=weights + delta, delta=delta.clone(), steps=3, epochs=1.0, examples=30,
            num_samples=10, mean_loss=0.5, seconds=0.0, complete=True,
            buffers=torch.full((3,), float(client)),
        )  # fmt: skip


def _attack(spec: str, clients: int, seed: int = 0) -> Attack:
    return Attack(parse_attack(spec), clients, seed, num_classes=10)


def _deltas(rng: np.random.Generator, clients: int, dim: int) -> dict[int, np.ndarray]:
    # float32-representable inputs, so the oracle starts from exactly what the trainer returns
    return {c: rng.normal(c * 0.1, 1 + c, dim).astype(np.float32) for c in range(clients)}


# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(("spec", "multiplier"), [
    ("sign_flip", -1.0), ("sign_flip:scale=2.5", -2.5), ("scale", 10.0),
    ("scale:factor=-0.3", -0.3),
])  # fmt: skip
def test_sign_flip_and_scale_are_exact(spec, multiplier) -> None:
    rng = np.random.default_rng(random.randrange(2**32))
    clients, dim = 7, 1013
    attack = _attack(spec + (":" if ":" not in spec else ",") + "fraction=0.3", clients)
    assert len(attack.attackers) == 2  # round(2.1)
    deltas = _deltas(rng, clients, dim)
    trainer = attack.wrap(FixedTrainer(deltas))
    start = torch.from_numpy(rng.normal(0, 1, dim).astype(np.float32))
    for c in range(clients):
        out = trainer.run(c, 0, start)
        honest = deltas[c].astype(np.float64)
        want = (multiplier * honest).astype(np.float32) if attack.is_attacker(c) else deltas[c]
        assert np.array_equal(out.delta.numpy(), want), c
        want_w = start.numpy().astype(np.float64) + want
        np.testing.assert_allclose(out.weights.numpy(), want_w, rtol=1e-6, atol=1e-6)
        assert torch.equal(out.buffers, torch.full((3,), float(c)))  # sent honestly
        assert out.steps == 3 and out.complete


def test_gaussian_noise_statistics_and_seeding() -> None:
    clients, dim, std = 4, 200_003, 0.37
    attack = _attack(f"gaussian:std={std},fraction=0.25", clients, seed=11)
    (a,) = attack.attackers
    deltas = {c: np.full(dim, 5.0, np.float32) for c in range(clients)}  # nothing of it shows
    trainer = attack.wrap(FixedTrainer(deltas))
    start = torch.zeros(dim)
    x = trainer.run(a, 2, start).delta.numpy().astype(np.float64)
    # mean within 6 standard errors, std within ~6 of its own standard errors (sd/sqrt(2D)),
    # excess kurtosis of a normal sample (sd sqrt(24/D) ~ 0.011): not uniform, not Laplace.
    assert abs(x.mean()) < 6 * std / np.sqrt(dim)
    assert abs(x.std() / std - 1) < 0.01
    assert abs(stats.kurtosis(x)) < 0.07
    again = _attack(f"gaussian:std={std},fraction=0.25", clients, seed=11)
    y = again.wrap(FixedTrainer(deltas)).run(a, 2, start).delta.numpy()
    assert np.array_equal(x.astype(np.float32), y)  # same (seed, client, round): same noise
    later = trainer.run(a, 3, start).delta.numpy()
    assert abs(np.corrcoef(x, later)[0, 1]) < 0.02  # another round: fresh noise
    other_seed = _attack(f"gaussian:std={std},fraction=0.25,seed=12", clients, seed=11)
    assert other_seed.seed == 12


@pytest.mark.parametrize(
    ("n", "f", "s"), [(20, 4, 7), (10, 2, 4), (7, 1, 3), (5, 2, 1), (50, 10, 16)]
)
def test_alie_z_max_by_hand(n, f, s) -> None:
    """s = floor(n/2 + 1) - f worked out by hand; z_max = Phi^-1((n - s) / n) by scipy."""
    assert alie_z_max(n, f) == pytest.approx(stats.norm.ppf((n - s) / n), rel=1e-12, abs=1e-14)


def test_alie_z_max_refuses_a_majority() -> None:
    with pytest.raises(ValueError, match=r"s = floor\(n/2 \+ 1\) - f = 0 <= 0.*give z="):
        alie_z_max(10, 6)
    with pytest.raises(ValueError, match="z_max is infinite"):
        SimConfig(clients=10, attack="alie:fraction=0.6")
    SimConfig(clients=10, attack="alie:fraction=0.6,z=1.5")  # a given z needs no z_max


def _pool_oracle(pool: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    rows = np.stack([p.astype(np.float64) for p in pool])
    sigma = rows.std(0, ddof=1) if len(rows) > 1 else np.zeros(rows.shape[1])
    return rows.mean(0), sigma


@pytest.mark.parametrize("view", ["attackers", "all"])
@pytest.mark.parametrize("name", ["alie", "ipm"])
def test_alie_and_ipm_read_the_pool(name, view) -> None:
    """Honest clients train first, then each attacker in turn; every attacker's update is
    computed from the latest delta of each client in the pool it can see."""
    rng = np.random.default_rng(random.randrange(2**32))
    clients, dim = 20, 517
    spec = f"{name}:fraction=0.2,view={view}" + (",eps=0.7" if name == "ipm" else "")
    attack = _attack(spec, clients, seed=5)
    attackers = attack.attackers
    assert len(attackers) == 4
    if name == "alie":
        assert attack.z == pytest.approx(stats.norm.ppf(13 / 20))  # s = 11 - 4 = 7
    deltas = _deltas(rng, clients, dim)
    trainer = attack.wrap(FixedTrainer(deltas))
    start = torch.zeros(dim)
    honest = [c for c in range(clients) if c not in attackers]
    for c in honest:
        assert np.array_equal(trainer.run(c, 0, start).delta.numpy(), deltas[c])
    seen = list(honest) if view == "all" else []
    for k, a in enumerate(attackers):
        # a later job of the same client replaces its entry: deposit twice, the first stale
        attack.pool.deposit(a, torch.from_numpy(deltas[a] + 1))
        out = trainer.run(a, 1, start).delta.numpy().astype(np.float64)
        seen.append(a)
        mu, sigma = _pool_oracle([deltas[c] for c in seen])
        want = mu - attack.z * sigma if name == "alie" else -0.7 * mu
        np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())
        if k == 0 and view == "attackers":  # alone in the pool: sigma 0, mu its own delta
            assert np.allclose(out, deltas[a] if name == "alie" else -0.7 * deltas[a], atol=1e-6)
    assert attack.pool.clients() == sorted(seen)


def test_the_pool_keeps_no_non_finite_delta() -> None:
    """A diverged (NaN) honest delta is not deposited: alone, the attacker sends it unchanged
    (the server refuses it); with a finite entry in the pool, mu and sigma come from that."""
    dim = 9
    attack = _attack("alie:fraction=0.4,z=2", 5, seed=1)
    a, b = attack.attackers
    bad = np.full(dim, np.nan, np.float32)
    good = np.arange(dim, dtype=np.float32)
    trainer = attack.wrap(FixedTrainer({a: bad, b: good}))
    assert np.isnan(trainer.run(a, 0, torch.zeros(dim)).delta.numpy()).all()
    assert attack.pool.clients() == []
    assert np.array_equal(trainer.run(b, 0, torch.zeros(dim)).delta.numpy(), good)  # sigma 0
    assert np.array_equal(trainer.run(a, 1, torch.zeros(dim)).delta.numpy(), good)
    assert attack.pool.clients() == [b]


def test_label_flip_flips_only_the_attackers_labels(tmp_path) -> None:
    cfg = SimConfig.from_mapping({**SMALL, "clients": 6, "attack": "label_flip:fraction=0.5",
                                  "out": str(tmp_path / "x")})  # fmt: skip
    setup = prepare(cfg)
    attack = setup.attack
    assert len(attack.attackers) == 3
    trainer = setup.trainer()
    y = setup.dataset.y_train.numpy()
    for c in range(6):
        own = y[setup.parts[c]]
        want = 9 - own if attack.is_attacker(c) else own
        assert np.array_equal(trainer.inner.labels(c).numpy(), want), c
    # What an attacker sends is exactly an honest job on the flipped labels.
    a = attack.attackers[0]
    recipe = Recipe(learning_rate=0.05)
    sent = trainer.run(a, 0, setup.initial, recipe)
    plain = prepare(SimConfig.from_mapping({**SMALL, "clients": 6, "out": str(tmp_path / "y")}))
    clean = plain.trainer()
    clean.set_labels(a, 9 - clean.labels(a))
    assert torch.equal(sent.delta, clean.run(a, 0, plain.initial, recipe).delta)
    assert not torch.equal(sent.delta, plain.trainer().run(a, 0, plain.initial, recipe).delta)


# ----------------------------------------------------------------------------- attackers


@pytest.mark.parametrize(("fraction", "clients", "count"), [
    (0.2, 10, 2), (0.25, 10, 2), (0.35, 10, 4), (0.3, 7, 2), (0.0, 5, 0), (0.9, 11, 10),
])  # fmt: skip
def test_attacker_count_and_choice(fraction, clients, count) -> None:
    spec = parse_attack(f"sign_flip:fraction={fraction}")
    assert spec.count(clients) == count
    choices = set()
    for seed in range(8):
        chosen = _attack(f"sign_flip:fraction={fraction}", clients, seed).attackers
        assert len(set(chosen)) == count and all(0 <= c < clients for c in chosen)
        assert chosen == choose_attackers(clients, count, seed)  # a pure function of the seed
        choices.add(tuple(chosen))
    if 0 < count < clients:
        assert len(choices) > 1  # the seed decides
    fixed = {tuple(_attack(f"ipm:fraction={fraction},seed=4", clients, s).attackers)
             for s in range(3)}  # fmt: skip
    assert len(fixed) == 1  # the spec's seed overrides the run's


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(("spec", "message"), [
    ("sing_flip", r"unknown attack 'sing_flip'.*attacks: sign_flip, gaussian, scale, alie, ipm"),
    ("ipm:epsilon=0.1", r"attack 'ipm': unknown parameter 'epsilon'; ipm takes fraction, seed, "
                        r"eps, view"),
    ("label_flip:scale=2", r"unknown parameter 'scale'; label_flip takes fraction, seed$"),
    ("scale:factor=big", r"attack 'scale': factor must be a number, got 'big'"),
    ("gaussian:std=0", r"std must be > 0"),
    ("gaussian:std=nan", r"std must be finite"),
    ("alie:seed=1.5", r"seed must be an integer, got '1.5'"),
    ("alie:view=some", r"view must be one of \('attackers', 'all'\), got 'some'"),
    ("sign_flip:fraction=1", r"fraction must be in \[0, 1\), got 1"),
    ("sign_flip:fraction=-0.1", r"fraction must be in \[0, 1\)"),
    ("sign_flip:scale", r"expected key=value, got 'scale'"),
    ("sign_flip:scale=1,scale=2", r"'scale' given twice"),
    ("", r"empty spec"),
])  # fmt: skip
def test_spec_errors_are_clear(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_attack(spec)
    with pytest.raises(ValueError, match=message):
        SimConfig(attack=spec)


def test_spec_defaults_labels_and_config(tmp_path) -> None:
    spec = parse_attack(" alie : z=1.5, fraction=0.3 ")
    assert (spec.name, spec.fraction, spec.seed) == ("alie", 0.3, None)
    assert dict(spec.params) == {"z": 1.5, "view": "attackers"}
    assert spec.label() == "alie:fraction=0.3,z=1.5"
    assert parse_attack("gaussian").params == ATTACKS["gaussian"]
    assert parse_attack("scale:factor=3").params["factor"] == 3.0  # an int is a number
    with pytest.raises(ValueError, match="leaves no honest client"):
        SimConfig(clients=2, attack="sign_flip:fraction=0.8")
    cfg = SimConfig.from_mapping({**SMALL, "attack": "sign_flip:scale=3", "out": str(tmp_path)})
    assert cfg.scenario_label() == "tiers/iid/sign_flip:fraction=0.2,scale=3"
    assert SimConfig.from_mapping(tomllib.loads(cfg.to_toml())) == cfg


def test_cli_sets_and_prints_the_attack(capsys) -> None:
    assert main(["simulate", "--attack", "ipm:eps=0.5,view=all", "--print-config"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["attack"] == "ipm:eps=0.5,view=all"
    assert main(["simulate", "--attack", "ipm:eps=0.5,views=all", "--print-config"]) == 2
    assert "unknown parameter 'views'; ipm takes" in capsys.readouterr().err


# ----------------------------------------------------------------------------- runs


def _run(tmp_path: Path, name: str, **changes):
    return run({**SMALL, "out": str(tmp_path / name), **changes}, progress=False)


def test_sign_flip_wrecks_fedavg_and_the_summary_names_the_attackers(tmp_path, capsys) -> None:
    """One attacker of five sending -20x its delta turns FedAvg's mean step into ascent: the
    model ends at chance (0.1 on digits) where the clean run is well above 0.8. The attacked
    run goes through the command line, which prints the attack."""
    clean = _run(tmp_path, "clean")
    assert clean.final_accuracy > 0.8 and clean.summary["attack"] is None
    out = tmp_path / "hit"
    argv = ["simulate", "--no-progress", "--out", str(out), "--attack", "sign_flip:scale=20"]
    for key in ("strategy", "dataset", "clients", "model", "profile", "budget", "eval_every",
                "transport", "seed"):  # fmt: skip
        argv += ["--" + key.replace("_", "-"), str(SMALL[key])]
    for key, value in SMALL["strategy_config"].items():
        argv += ["--set", f"strategy_config.{key}={value}"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] < 0.2, summary
    a = summary["attack"]
    assert a["name"] == "sign_flip" and a["params"] == {"scale": 20.0} and a["seed"] == 3
    (attacker,) = a["attackers"]
    assert a["attackers"] == [client_id(c) for c in choose_attackers(5, 1, 3)]
    # sync FedAvg, full participation: the attacker sends one update per round
    assert a["crafted_sent"] == a["crafted_accepted"] == {attacker: 3}
    assert summary["scenario"] == "tiers/iid/sign_flip:fraction=0.2,scale=20"
    printed = capsys.readouterr().out
    line = f"attack sign_flip:fraction=0.2,scale=20: attackers {attacker}; 3 crafted updates sent"
    assert line in printed


def test_pool_attack_runs_are_deterministic_inproc(tmp_path) -> None:
    """ALIE with the omniscient pool: the same config gives the same metrics and counts."""
    runs = [_run(tmp_path, n, strategy="fedasync", strategy_config={"learning_rate": 0.05},
                 budget="3s", eval_every="1s", attack="alie:fraction=0.4,view=all,z=3")
            for n in ("a", "b")]  # fmt: skip
    strip = [[{k: v for k, v in m.items() if k != "wall_time"} for m in r.metrics] for r in runs]
    assert strip[0] == strip[1]
    a, b = (r.summary["attack"] for r in runs)
    assert a == b and len(a["attackers"]) == 2 and sum(a["crafted_sent"].values()) >= 2


def test_grpc_attackers_push_crafted_updates(tmp_path) -> None:
    """Over a real server: the same attackers as inproc for the seed, each pushes updates
    the server accepts, and their noise (std 10, where honest deltas are ~1e-3 per
    coordinate) shows in the served model's test loss (an honest model's is below 3)."""
    r = _run(tmp_path, "grpc", transport="grpc", strategy="fedasync",
             strategy_config={"learning_rate": 0.05, "alpha": 0.6}, budget="6v",
             eval_every="4s", time_scale=0.25, attack="gaussian:std=10,fraction=0.4")  # fmt: skip
    a = r.summary["attack"]
    inproc = prepare(SimConfig.from_mapping({**r.config.to_dict(), "transport": "inproc"}))
    assert a["attackers"] == [client_id(c) for c in inproc.attack.attackers]
    assert a["attackers"] == [client_id(c) for c in choose_attackers(5, 2, 3)]
    assert len(a["attackers"]) == 2
    assert sum(a["crafted_sent"].values()) >= 1
    assert 1 <= sum(a["crafted_accepted"].values()) <= r.summary["updates_applied"]
    assert r.metrics[-1]["test_loss"] > 20, r.metrics
