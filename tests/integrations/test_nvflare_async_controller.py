"""The asynchronous FLARE controller's bookkeeping, driven by hand: FLARE's task machinery is
replaced by a recorder of the tasks sent, the callbacks FLARE would call, and the tail of FLARE's
result handling, so failures and races are played in a chosen order."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

pytest.importorskip("nvflare")

from nvflare.app_common.abstract.fl_model import FLModel, ParamsType  # noqa: E402
from nvflare.app_common.app_constant import AppConstants  # noqa: E402
from nvflare.app_common.workflows.model_controller import ModelController  # noqa: E402

from aggsrv.integrations.nvflare import AsyncAggsrvController, ParamsLayout  # noqa: E402
from aggsrv.integrations.nvflare.async_controller import DISPATCH  # noqa: E402
from aggsrv.layout import ModelLayout  # noqa: E402
from aggsrv.strategies import make_strategy, strategy_settings  # noqa: E402

PARAMS = {"w": np.zeros((3, 5), dtype=np.float32), "b": np.zeros(5, dtype=np.float32)}
SITES = ("site-1", "site-2")


def _controller(monkeypatch, strategy: str, config: dict) -> tuple[AsyncAggsrvController, list]:
    c = AsyncAggsrvController(strategy=strategy, config=config, max_updates=50)
    c.layout = ParamsLayout.of(PARAMS)
    layout = ModelLayout.from_named_shapes([(e.name, e.shape) for e in c.layout.entries])
    c.aggregation = make_strategy(
        strategy, layout=layout, initial=torch.zeros(layout.numel),
        config=strategy_settings(strategy, config),
    )  # fmt: skip
    for site in SITES:
        c.aggregation.on_register(site, 0.0)
    sent: list[dict] = []
    monkeypatch.setattr(c, "send_model", lambda **task: sent.append(task))
    return c, sent


def _reply(value: float) -> FLModel:
    params = {k: np.full(v.shape, value, dtype=np.float32) for k, v in PARAMS.items()}
    return FLModel(params_type=ParamsType.FULL, params=params, meta={"NUM_STEPS_CURRENT_ROUND": 2})


def _flare_tail(monkeypatch, c: AsyncAggsrvController, task: dict, site: str) -> None:
    """The end of FLARE's result handling for ``task`` when the site's task failed: FLARE's own
    part (which then skips the callback) replaced by nothing, then the controller's."""
    monkeypatch.setattr(ModelController, "_process_result", lambda self, ct, ctx: None)
    client_task = types.SimpleNamespace(
        client=types.SimpleNamespace(name=site),
        task=types.SimpleNamespace(props={AppConstants.META_DATA: task["data"].meta}),
    )
    c._process_result(client_task, None)


def test_a_failed_task_counts_for_nothing_and_the_site_gets_a_fresh_one(monkeypatch) -> None:
    c, sent = _controller(monkeypatch, "fedasync", {})
    c._dispatch("site-1")
    _flare_tail(monkeypatch, c, sent[0], "site-1")
    c._step()
    assert [(f.site, f.status) for f in c.folded] == [("site-1", "REFUSED")]
    assert c.aggregation.version == 0 and len(sent) == 2  # a fresh task, nothing applied
    assert sent[1]["targets"] == ["site-1"] and sent[1]["data"].meta[DISPATCH] == 2


def test_a_result_then_flares_tail_of_the_same_task_is_one_update(monkeypatch) -> None:
    """FLARE calls the callback, the controller folds and sends the site its next task (the
    same job again while FedBuff's buffer fills), and only then does FLARE's handling of the
    first task end: that must not read as a failure of the second."""
    c, sent = _controller(monkeypatch, "fedbuff", {"buffer_size": 2})
    c._dispatch("site-1")
    sent[0]["callback"](_reply(1.0))
    c._step()
    assert len(sent) == 2 and sent[1]["data"].meta[DISPATCH] == 2
    _flare_tail(monkeypatch, c, sent[0], "site-1")  # the first task's tail, late
    assert c._results.empty()
    c._step()
    assert [(f.site, f.status) for f in c.folded] == [("site-1", "BUFFERED")]
    assert len(sent) == 2  # still one task standing for the site


def test_a_task_given_up_on_that_answers_late_is_not_folded(monkeypatch) -> None:
    c, sent = _controller(monkeypatch, "fedasync", {})
    c.job_timeout = 1
    c._dispatch("site-1")
    c._outstanding["site-1"].sent -= 10  # its time ran out
    c._step()
    assert len(sent) == 2  # given up on: a fresh task
    sent[0]["callback"](_reply(5.0))  # the old task answers after all
    c._step()
    assert c.folded == [] and c.aggregation.version == 0
    sent[1]["callback"](_reply(1.0))
    c._step()
    assert [(f.site, f.status) for f in c.folded] == [("site-1", "APPLIED")]


def test_flare_does_not_end_the_run_when_one_sites_task_fails(monkeypatch) -> None:
    """Each task has one target: under FLARE's default error policy one failed result leaves
    fewer good responses than needed and FLARE panics (ends the run)."""
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import make_reply

    c, sent = _controller(monkeypatch, "fedasync", {})
    panics: list[str] = []
    monkeypatch.setattr(c, "panic", lambda msg, *a, **k: panics.append(msg))
    # The state FLARE's broadcast sets for a task to one site.
    c._current_num_targets, c._current_min_responses, c._current_failed_clients = 1, 1, set()
    failed = make_reply(ReturnCode.EXECUTION_EXCEPTION)
    assert c._accept_train_result("site-1", failed, FLContext()) is False
    assert panics == []
