"""A run directory: config.toml, metrics.jsonl (one line per evaluation), summary.json with
provenance, accuracy.png (test accuracy against virtual time) and, for strategies that emit
events (FedDGIC's groupings and dropout flags), events.jsonl."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from aggsrv.sim.config import SimConfig

__all__ = ["METRIC_FIELDS", "RunOutput", "plot_accuracy", "provenance"]

# Every metrics.jsonl line has these keys (wall_time is the only non-deterministic one).
METRIC_FIELDS = (
    "version",
    "virtual_time",
    "wall_time",
    "test_accuracy",
    "test_loss",
    "updates_applied",
    "updates_rejected",
    "updates_filtered",
    "bytes_received",
)
_PACKAGES = ("aggsrv", "torch", "numpy", "numba", "grpcio", "protobuf", "scikit-learn")


def provenance() -> dict[str, Any]:
    """Versions and the git revision of the code that ran (None outside a git checkout)."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = bool(
            subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.strip()  # fmt: skip
        )
    except (OSError, subprocess.SubprocessError):
        rev, dirty = None, None
    return {
        "packages": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_revision": rev,
        "git_dirty": dirty,
        "command": sys.argv,
    }


class RunOutput:
    """Writes one run's files as the run goes (metrics are flushed line by line)."""

    def __init__(self, config: SimConfig, directory: Path | None = None) -> None:
        self.dir = Path(directory or config.out_dir())
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.toml").write_text(config.to_toml())
        self._metrics = open(self.dir / "metrics.jsonl", "w")  # noqa: SIM115 - closed in close()

    def metric(self, row: dict[str, Any]) -> None:
        missing = [k for k in METRIC_FIELDS if k not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}")
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()

    def event(self, record: dict[str, Any]) -> None:
        """A strategy event (FedDGIC's grouping, ...) as one line of events.jsonl."""
        with open(self.dir / "events.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def finish(self, summary: dict[str, Any], metrics: list[dict[str, Any]]) -> None:
        self._metrics.close()
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_accuracy(
            {f"{summary['strategy']} (seed {summary['seed']})": metrics},
            self.dir / "accuracy.png",
            title=f"{summary['dataset']}, {summary['clients']} clients, {summary['scenario']}, "
            f"{summary['transport']}",
        )

    def close(self) -> None:
        if not self._metrics.closed:
            self._metrics.close()


def plot_accuracy(
    lines: dict[str, list[dict[str, Any]]],
    path: Path,
    title: str = "",
    target: float | None = None,
    bands: dict[str, tuple[list[float], list[float], list[float]]] | None = None,
) -> None:
    """Test accuracy against virtual time, one line per entry (and an optional +/- band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, rows in lines.items():
        xs = [r["virtual_time"] for r in rows]
        ys = [r["test_accuracy"] for r in rows]
        (line,) = ax.plot(xs, ys, label=label, linewidth=1.6)
        if bands and label in bands:
            bx, lo, hi = bands[label]
            ax.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
