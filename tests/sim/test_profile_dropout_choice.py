"""dropout:choose: the clients that leave drawn at random (the default) or the holders of one
label, checked against an argsort oracle on hand-built label counts and on a real data split."""

from __future__ import annotations

import numpy as np
import pytest

from aggsrv.sim.profiles import make_profile

N, CLASSES = 13, 7


def fresh_counts(seed: int, n: int = N, classes: int = CLASSES) -> np.ndarray:
    """Per-client label counts with ties and zeros (a small range, some clients lack labels)."""
    rng = np.random.default_rng(1000 + seed)
    counts = rng.integers(0, 5, size=(n, classes))
    counts[rng.random((n, classes)) < 0.3] = 0
    return counts


def dropout_record(profile) -> dict:
    (record,) = profile.describe()["components"]
    return record


def oracle_leavers(counts: np.ndarray, label: int, k: int) -> list[int]:
    """The first k clients by (count of label descending, index ascending), brute force."""
    ranked = sorted(range(len(counts)), key=lambda c: (-int(counts[c, label]), c))
    return sorted(ranked[:k])


@pytest.mark.parametrize("seed", [0, 3, 11])
@pytest.mark.parametrize(
    "spec", ["dropout:count=4,choose=label", "dropout:fraction=0.5,choose=label"]
)
def test_label_choice_drops_the_largest_holders(seed: int, spec: str) -> None:
    counts = fresh_counts(seed)
    profile = make_profile(spec, N, seed, label_counts=counts)
    record = dropout_record(profile)
    label = record["label"]
    assert record["choose"] == "label" and 0 <= label < CLASSES
    assert counts[:, label].sum() > 0  # a label the split holds
    k = 4 if "count" in spec else 7  # round(0.5 * 13), halves up
    # Oracle 1: numpy's stable argsort of the negated counts keeps ties in index order.
    by_argsort = sorted(int(c) for c in np.argsort(-counts[:, label], kind="stable")[:k])
    assert list(profile.dropout_clients) == by_argsort == oracle_leavers(counts, label, k)
    held = counts[by_argsort, label].sum() / counts[:, label].sum()
    assert record["label_share"] == pytest.approx(held, rel=1e-12)
    # Leave times are drawn per client as with random choice: same client, same seed, same time.
    leaves = {c["client"]: c["after_updates"] for c in record["clients"]}
    forced = make_profile({"dropout": {"clients": by_argsort}}, N, seed)
    assert leaves == {c["client"]: c["after_updates"] for c in dropout_record(forced)["clients"]}


def test_ties_and_clients_without_the_label_come_in_index_order() -> None:
    # Every client holds 2 of each label except client 9 (5 of each): the rest tie.
    counts = np.full((N, 3), 2)
    counts[9] = 5
    counts[[1, 4], :] = 0
    profile = make_profile("dropout:count=12,choose=label", N, 0, label_counts=counts)
    # 9 first, then the tied holders by index, then the holders of none (1, 4) by index: with
    # k = 12 of 13 the one left out is the last of those, client 4.
    assert profile.dropout_clients == tuple(c for c in range(N) if c != 4)


def test_the_label_is_reproducible_and_changes_with_the_seed() -> None:
    counts = fresh_counts(5)
    spec = "dropout:count=3,choose=label"
    labels = [
        dropout_record(make_profile(spec, N, s, label_counts=counts))["label"] for s in range(12)
    ]
    again = [
        dropout_record(make_profile(spec, N, s, label_counts=counts))["label"] for s in range(12)
    ]
    assert labels == again
    assert len(set(labels)) >= 3  # 12 seeds over the labels held: not one fixed label


def test_only_labels_the_split_holds_are_drawn() -> None:
    counts = fresh_counts(2)
    counts[:, [0, 2, 3, 5]] = 0  # only labels 1, 4 and 6 are held
    for s in range(20):
        record = dropout_record(
            make_profile("dropout:count=2,choose=label", N, s, label_counts=counts)
        )
        assert record["label"] in (1, 4, 6)


@pytest.mark.parametrize("spec", ["dropout:count=5", "dropout:fraction=0.3,at_time=2..9"])
def test_random_choice_is_the_default(spec: str) -> None:
    counts = fresh_counts(7)
    for s in range(5):
        default = make_profile(spec, N, s)
        explicit = make_profile(spec + ",choose=random", N, s, label_counts=counts)
        assert default.describe() == explicit.describe()
        assert dropout_record(default)["choose"] == "random"
        assert len(default.dropout_clients) == (5 if "count" in spec else 4)


def test_explicit_clients_are_described_without_a_choice() -> None:
    record = dropout_record(make_profile({"dropout": {"clients": [2, 0]}}, 3, 1))
    assert "choose" not in record and [c["client"] for c in record["clients"]] == [0, 2]


@pytest.mark.parametrize(
    ("spec", "counts", "message"),
    [
        ("dropout:count=2,choose=label", None, "choose='label' needs the data split"),
        (
            {"dropout": {"clients": [1], "choose": "label"}},
            fresh_counts(0),
            "give choose or clients, not both",
        ),
        (
            {"dropout": {"clients": [1], "choose": "random"}},
            None,
            "give choose or clients, not both",
        ),
        (
            "dropout:count=2,choose=labels",
            fresh_counts(0),
            r"choose must be one of \['random', 'label'\]",
        ),
        ("dropout:count=2,choose=label", np.zeros((N, CLASSES), int), "label_counts is all 0"),
        (
            "dropout:count=2,choose=label",
            fresh_counts(0, n=N - 1),
            r"shape .* = \[13, >= 1\], got \[12, 7\]",
        ),
        ("dropout:count=2", fresh_counts(0)[:, 0], r"got \[13\]"),
        ("dropout:count=2", np.zeros((N, 0), int), r"got \[13, 0\]"),
        ("dropout:count=2", fresh_counts(0) + 0.5, "label_counts must hold integers"),
        ("dropout:count=2", fresh_counts(0) > 1, "label_counts must hold integers"),
        ("dropout:count=2", fresh_counts(0) - 9, "label_counts must be >= 0"),
    ],
)
def test_errors_name_the_keys(spec, counts, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_profile(spec, N, 0, label_counts=counts)


def test_the_caller_s_counts_are_copied() -> None:
    counts = fresh_counts(4)
    profile = make_profile("dropout:count=3,choose=label", N, 4, label_counts=counts)
    before = profile.dropout_clients
    counts[:] = 0  # changing the array afterwards changes nothing
    assert profile.dropout_clients == before
    assert dropout_record(profile)["label_share"] > 0


def test_prepare_drops_the_holders_of_the_chosen_label() -> None:
    from aggsrv.sim.config import SimConfig
    from aggsrv.sim.setup import prepare

    config = SimConfig.from_mapping(
        {
            "strategy": "fedasync",
            "dataset": "digits",
            "clients": 7,
            "model": "mlp",
            "partition": "shards",
            "profile": "dropout:count=2,choose=label",
            "budget": "5v",
            "transport": "inproc",
            "seed": 4,
        }
    )
    setup = prepare(config)
    record = dropout_record(setup.profile)
    label = record["label"]
    labels = setup.dataset.y_train.numpy()
    # Recount from the split itself (not from the summary prepare used).
    held = np.array([(labels[p] == label).sum() for p in setup.parts])
    assert held.sum() > 0
    oracle = sorted(range(7), key=lambda c: (-held[c], c))[:2]
    assert list(setup.profile.dropout_clients) == sorted(oracle)
    assert record["label_share"] == pytest.approx(held[oracle].sum() / held.sum(), rel=1e-12)
    # Under shards the chosen label is concentrated: the two leavers hold most of it.
    assert record["label_share"] > 0.5
