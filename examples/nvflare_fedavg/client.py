"""The sites' training script (FLARE's Client API): receive the global model, train locally for
a few epochs of SGD on this site's digits, send the new weights back with the number of steps.

``--attack scale`` makes this site Byzantine: it sends its weights pushed far from the global
model (x + 20 (x_local - x) with a sign flip), which drags a plain mean away and which the
robust rules are there to resist. ``--bad-site N`` names the one site that does it.
"""

from __future__ import annotations

import argparse

import nvflare.client as flare
import torch
from model import DigitsMLP, site_data
from nvflare.app_common.abstract.fl_model import FLModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--bad-site", type=int, default=0, help="1-based; 0: every site is honest")
    args = parser.parse_args()

    flare.init()
    site = int(flare.get_site_name().rsplit("-", 1)[1])  # "site-3" -> 3
    x, y = site_data(site - 1, args.sites)
    model = DigitsMLP()
    loss_fn = torch.nn.CrossEntropyLoss()
    while flare.is_running():
        received = flare.receive()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in received.params.items()})
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        steps = 0
        generator = torch.Generator().manual_seed(1000 * site + (received.current_round or 0))
        for _ in range(args.epochs):
            for batch in torch.randperm(len(x), generator=generator).split(32):
                opt.zero_grad()
                loss_fn(model(x[batch]), y[batch]).backward()
                opt.step()
                steps += 1
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if site == args.bad_site:
            weights = {k: start[k] - 20 * (weights[k] - start[k]) for k in weights}
        flare.send(
            FLModel(
                params=weights,
                meta={"NUM_STEPS_CURRENT_ROUND": steps},
            )
        )


if __name__ == "__main__":
    main()
