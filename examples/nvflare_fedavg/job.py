"""aggsrv inside NVIDIA FLARE's simulator (README.md beside this file).

    python examples/nvflare_fedavg/job.py --aggregator median --sites 4 --rounds 5 --bad-site 4
    python examples/nvflare_fedavg/job.py --strategy fedbuff --updates 24 --sites 4

The first builds FLARE's PyTorch ``FedAvgRecipe`` with ``AggsrvAggregator(aggregator)`` (rounds,
a robust rule); the second swaps the FedAvg controller for ``AsyncAggsrvController`` (no rounds:
each result is folded in as it arrives and its site gets the next job at once). Either runs in
FLARE's simulator (one thread per site), then loads the final global model and prints its
accuracy on the digits test split as the last line (``accuracy 0.9xxx``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model import DigitsMLP, test_accuracy  # noqa: E402
from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST  # noqa: E402
from nvflare.app_common.widgets.component_path_authorizer import CLASS_ALLOW_LIST  # noqa: E402
from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe  # noqa: E402
from nvflare.recipe import SimEnv  # noqa: E402

from aggsrv.integrations.nvflare import AggsrvAggregator, AsyncAggsrvController  # noqa: E402

# FLARE instantiates only the job components its sites allow (the class allow list in each
# site's local/resources.json); the simulator's workspace gets the defaults plus aggsrv's.
AGGSRV_COMPONENTS = "aggsrv.integrations.nvflare."


def allow_aggsrv(workspace: Path) -> None:
    """Write the simulator's local/resources.json: FLARE's default allow list and aggsrv."""
    local = workspace / "local"
    local.mkdir(parents=True, exist_ok=True)
    resources = {
        "format_version": 2,
        CLASS_ALLOW_LIST: [*DEFAULT_CLASS_ALLOW_LIST, AGGSRV_COMPONENTS],
    }
    (local / "resources.json").write_text(json.dumps(resources, indent=2))


class AsyncRecipe(FedAvgRecipe):
    """FLARE's PyTorch FedAvg recipe (its model persistor and client script runner) with the
    asynchronous controller in place of FedAvg's rounds."""

    def __init__(self, *, strategy: str, config: dict, updates: int, **kwargs) -> None:
        self.async_args = {"strategy": strategy, "config": config, "max_updates": updates}
        super().__init__(**kwargs)

    def _create_controller(self, persistor_id, model_params, model_aggregator):
        return AsyncAggsrvController(
            **self.async_args, num_clients=self.min_clients, persistor_id=persistor_id
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aggregator", default="mean", help="an aggsrv aggregator spec")
    parser.add_argument("--strategy", default="", help="an aggsrv strategy: run asynchronously")
    parser.add_argument("--updates", type=int, default=24, help="results to fold in (--strategy)")
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2, help="local epochs per round")
    parser.add_argument("--bad-site", type=int, default=0, help="1-based Byzantine site; 0: none")
    parser.add_argument("--workspace", default="/tmp/nvflare/aggsrv-example")
    args = parser.parse_args()

    common = dict(
        model=DigitsMLP(),
        min_clients=args.sites,
        train_script=str(HERE / "client.py"),
        train_args=f"--sites {args.sites} --epochs {args.epochs} --bad-site {args.bad_site}",
    )
    if args.strategy:
        name = f"aggsrv_{args.strategy}"
        config = {"buffer_size": max(2, args.sites // 2)} if args.strategy == "fedbuff" else {}
        recipe = AsyncRecipe(
            name=name, strategy=args.strategy, config=config, updates=args.updates, **common
        )
    else:
        name = "aggsrv_fedavg"
        aggregator = AggsrvAggregator(args.aggregator, expected_clients=args.sites)
        recipe = FedAvgRecipe(name=name, num_rounds=args.rounds, aggregator=aggregator, **common)
    workspace = Path(args.workspace)
    allow_aggsrv(workspace / name)
    env = SimEnv(num_clients=args.sites, workspace_root=str(workspace))
    recipe.execute(env)
    if env.last_run_failed:
        raise SystemExit("the FLARE simulation failed (its log is under the workspace)")
    saved = sorted(workspace.glob(f"{name}/server/simulate_job/**/*.pt"), key=os.path.getmtime)
    if not saved:
        raise SystemExit(f"no global model was saved under {workspace / name}")
    model = DigitsMLP()
    state = torch.load(saved[-1], map_location="cpu", weights_only=False)
    state = state.get("model", state)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    print(f"accuracy {test_accuracy(model):.4f}")


if __name__ == "__main__":
    main()
