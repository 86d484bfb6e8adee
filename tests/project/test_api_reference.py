"""The API reference builds (pdoc, warnings as errors) and documents what a program uses."""

from __future__ import annotations

import asyncio
import gc
import re
from pathlib import Path

import pytest

pytest.importorskip("pdoc", reason="pdoc (a dev dependency) builds the API reference")

from aggsrv.api_reference import MODULES, build  # noqa: E402


def test_the_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    problems = build(tmp_path)
    assert not problems, "\n".join(problems)
    pages = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
    for name in MODULES:
        assert name.replace(".", "/") + ".html" in pages, sorted(pages)

    def ids(page: str) -> set[str]:
        return set(re.findall(r'id="([A-Za-z_.]+)"', (tmp_path / page).read_text()))

    assert {"weighted_sum", "quantized_accumulate", "QuantizedRows"} <= ids("aggsrv/kernels.html")
    assert {"Client", "Client.push", "Client.get_job"} <= ids("aggsrv/client.html")
    assert {"Strategy", "Strategy.on_update", "Strategy.folds_quantized_updates"} <= ids(
        "aggsrv/strategies/base.html"
    )
    assert {"Update", "QuantizedValues"} <= ids("aggsrv/values.html")
    assert "AggsrvStrategy" in ids("aggsrv/integrations/flower.html")
    assert {"AggsrvAggregator", "AsyncAggsrvController"} <= ids("aggsrv/integrations/nvflare.html")


def test_a_warning_of_collected_garbage_is_not_counted_as_the_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects that earlier code in the process left behind (an event loop a test never
    closed) warn when they are collected, which may fall in the build: not a problem of the
    reference. pdoc's own warnings still are. pdoc stands in here so both happen during it."""
    import warnings

    import pdoc

    def render(*modules: str, output_directory: Path) -> None:
        loop = asyncio.new_event_loop()  # never closed: ResourceWarning when it is collected
        del loop
        gc.collect()
        warnings.warn("cannot resolve aggsrv.Nowhere", UserWarning, stacklevel=1)

    monkeypatch.setattr(pdoc, "pdoc", render)
    assert build(tmp_path) == ["UserWarning: cannot resolve aggsrv.Nowhere"]
