"""FedDGIC grouping dendrograms: the layout equals scipy's, `aggsrv report` draws one per grouping
event of a run and prints k and the group sizes, and the degenerate n = 1 and n = 2 draw."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from aggsrv import cli
from aggsrv.sim.dendrogram import (
    cut_height,
    leaf_order,
    link_coordinates,
    load_groupings,
    plot_dendrogram,
)
from aggsrv.sim.report import report

pytest.importorskip("matplotlib")


def _assert_png(path: Path, min_bytes: int = 5000) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > min_bytes, (path, len(data))
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 300 and height > 300
    return width, height


def _scipy_event(n: int, seed: int, version: int = 3, reason: str = "initial") -> dict:
    """A grouping event from a real scipy average linkage of cosine distances."""
    hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
    from scipy.spatial.distance import squareform

    from aggsrv.strategies.grouping import cut_tree, group_count

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, 8))
    x = centres[np.arange(n) % 3] + 0.3 * rng.normal(size=(n, 8))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    d = np.clip(1.0 - x @ x.T, 0.0, None)
    np.fill_diagonal(d, 0.0)
    Z = hierarchy.linkage(squareform(d, checks=False), method="average")
    heights = np.maximum.accumulate(Z[:, 2])
    k, ratios = group_count(heights, 0.8)
    return {
        "event": "grouping",
        "strategy": "feddgic",
        "version": version,
        "time": 12.5,
        "clients": [f"client-{i:03d}" for i in range(n)],
        "labels": list(cut_tree(Z, k)),
        "k": k,
        "p": 0.8,
        "heights": heights.tolist(),
        "ratios": ratios,
        "linkage": Z.tolist(),
        "reason": reason,
    }


def _fake_run(root: Path, name: str, events: list[dict] | None, seed: int = 0) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    metrics = [
        {"version": v, "virtual_time": 2.0 * v, "test_accuracy": 0.2 + 0.2 * v} for v in range(4)
    ]
    summary = {
        "strategy": "feddgic",
        "label": "feddgic",
        "dataset": "digits",
        "scenario": "iid",
        "seed": seed,
        "final_accuracy": metrics[-1]["test_accuracy"],
        "best_accuracy": metrics[-1]["test_accuracy"],
        "updates_applied": 30,
        "virtual_time": metrics[-1]["virtual_time"],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if events is not None:
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("n", [2, 7, 30])
@pytest.mark.parametrize("method", ["average", "single", "complete"])
def test_layout_equals_scipy(n: int, method: str) -> None:
    hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
    for seed in range(4):
        Z = hierarchy.linkage(np.random.default_rng(seed).normal(size=(n, 5)), method=method)
        expected = hierarchy.dendrogram(Z, no_plot=True)
        icoord, dcoord = link_coordinates(Z)
        assert leaf_order(Z) == expected["leaves"]
        assert icoord == expected["icoord"]
        assert dcoord == expected["dcoord"]
        # The same from the JSON form an event carries.
        assert link_coordinates(json.loads(json.dumps(Z.tolist()))) == (icoord, dcoord)


def test_layout_single_leaf_and_bad_linkage() -> None:
    assert leaf_order([]) == [0] and link_coordinates([]) == ([], [])
    with pytest.raises(ValueError, match="twice"):
        leaf_order([[0, 1, 0.1, 2], [0, 2, 0.2, 2]])
    with pytest.raises(ValueError, match="not made before"):
        leaf_order([[0, 3, 0.1, 2], [1, 2, 0.2, 2]])


def test_cut_height_between_the_last_merge_made_and_the_next() -> None:
    h = [0.1, 0.12, 0.5, 0.9]  # n = 5
    assert cut_height(h, 2) == pytest.approx((0.5 + 0.9) / 2)
    assert cut_height(h, 3) == pytest.approx((0.12 + 0.5) / 2)
    assert cut_height(h, 1) > 0.9 and 0 < cut_height(h, 5) < 0.1
    assert cut_height([], 1) is None


# ----------------------------------------------------------------------------- events


def test_load_groupings(tmp_path) -> None:
    assert load_groupings(tmp_path) == []
    event = _scipy_event(6, 0)
    lines = [json.dumps({"event": "dropout", "client": "client-001"}), json.dumps(event)]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + '\n\n{"event": "grou')
    assert load_groupings(tmp_path) == [event]  # other kinds and a partial last line skipped
    (tmp_path / "events.jsonl").write_text('{"event": \n' + lines[1] + "\n")
    with pytest.raises(ValueError, match="events.jsonl:1"):
        load_groupings(tmp_path)


# ----------------------------------------------------------------------------- report


def test_report_writes_dendrograms_and_prints_groups(tmp_path, capsys) -> None:
    first, last = _scipy_event(12, 1, version=3), _scipy_event(12, 2, 9, "regroup")
    other = {"event": "dropout", "client": "client-004", "version": 5}
    run_dir = _fake_run(tmp_path / "runs", "feddgic-s0", [first, other, last])
    plain = _fake_run(tmp_path / "runs", "plain-s1", None, seed=1)
    plot = tmp_path / "out" / "report.png"
    plot.parent.mkdir()
    assert cli.main(["report", str(run_dir), str(plain), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    main = plot.with_name("report-dendrogram-feddgic-s0.png")
    earlier = plot.with_name("report-dendrogram-feddgic-s0-1.png")
    _assert_png(plot)
    _assert_png(main)
    _assert_png(earlier)
    assert sorted(p.name for p in plot.parent.iterdir()) == sorted(
        ["report.png", main.name, earlier.name]
    )
    # The grouping table: one line for the run with groupings, the last grouping's numbers.
    sizes = ", ".join(str(last["labels"].count(g)) for g in range(last["k"]))
    line = next(x for x in out.splitlines() if x.startswith(str(run_dir)))
    assert line.split()[1:4] == ["2", "9", str(last["k"])]
    assert sizes in line and str(main) in line
    assert last["k"] >= 2 and "group sizes" in out
    assert not any(x.startswith(str(plain)) for x in out.splitlines())

    # No plot, or --no-dendrogram: the table still, no files.
    for extra in (["--plot", ""], ["--plot", str(tmp_path / "b.png"), "--no-dendrogram"]):
        before = {p for p in tmp_path.rglob("*.png")}
        assert cli.main(["report", str(run_dir), *extra]) == 0
        out = capsys.readouterr().out
        assert "group sizes" in out and sizes in out and "dendrogram-" not in out
        new = {p for p in tmp_path.rglob("*.png")} - before
        assert all("dendrogram" not in p.name for p in new)


def test_report_without_groupings_is_unchanged(tmp_path) -> None:
    run_dir = _fake_run(tmp_path, "plain-s0", [{"event": "dropout", "client": "client-0"}])
    text, runs = report([run_dir], plot=tmp_path / "report.png")
    assert len(runs) == 1 and "group" not in text
    assert [p.name for p in tmp_path.glob("*.png")] == ["report.png"]


def test_report_names_runs_that_share_label_and_seed_apart(tmp_path) -> None:
    a = _fake_run(tmp_path / "one", "feddgic-s0", [_scipy_event(5, 0)])
    b = _fake_run(tmp_path / "two", "feddgic-s0", [_scipy_event(6, 1)])
    summary = json.loads((b / "summary.json").read_text())
    (b / "summary.json").write_text(json.dumps({**summary, "scenario": "dirichlet"}))
    report([a, b], plot=tmp_path / "r.png")
    assert sorted(p.name for p in tmp_path.glob("r-dendrogram-*.png")) == [
        "r-dendrogram-feddgic-digits-dirichlet-s0.png",
        "r-dendrogram-feddgic-digits-iid-s0.png",
    ]


# ----------------------------------------------------------------------------- degenerate


def test_single_client_and_two_clients_plot(tmp_path) -> None:
    one = {
        "event": "grouping",
        "clients": ["client-000"],
        "labels": [0],
        "k": 1,
        "p": 0.8,
        "heights": [],
        "ratios": [],
        "linkage": [],
        "version": 1,
        "reason": "initial",
    }
    two = {
        **one,
        "clients": ["client-000", "client-001"],
        "labels": [0, 0],
        "heights": [0.25],
        "linkage": [[0.0, 1.0, 0.25, 2.0]],
    }
    for name, event in (("one.png", one), ("two.png", two)):
        plot_dendrogram(event, tmp_path / name, title=name)
        _assert_png(tmp_path / name, min_bytes=2000)
    # A grouping that kept both clients apart (k = n) draws its cut below the merge.
    plot_dendrogram({**two, "labels": [0, 1], "k": 2}, tmp_path / "apart.png")
    _assert_png(tmp_path / "apart.png", min_bytes=2000)
