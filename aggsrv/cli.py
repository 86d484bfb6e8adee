"""The `aggsrv` command line: `simulate` runs an experiment, `report` compares runs, `serve` runs
the aggregation server, `pull` downloads the global model, `info` describes this installation."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata


def _info(_: argparse.Namespace) -> int:
    import torch

    from aggsrv import kernels

    cuda = torch.cuda.is_available()
    lines = [
        f"aggsrv {metadata.version('aggsrv')}",
        f"torch {torch.__version__}, CUDA available: {cuda}",
        f"kernel backends: {', '.join(kernels.BACKENDS)}; "
        f"auto picks {'triton' if cuda else 'cpu'} for tensors on this machine's default device",
        f"torch threads: {torch.get_num_threads()}",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from aggsrv.server.app import serve
    from aggsrv.server.config import ServerConfig

    overrides = {
        "host": args.host,
        "port": args.port,
        "strategy": args.strategy,
        "device": args.device,
        "model_init": args.model_init,
        "max_clients": args.max_clients,
        "max_concurrent_uploads": args.max_concurrent_uploads,
        "events_file": args.events_file,
    }
    try:
        config = ServerConfig.load(args.config, overrides)
    except (OSError, ValueError, TypeError) as exc:
        sys.stderr.write(f"aggsrv serve: {exc}\n")
        return 2
    if args.print_config:
        sys.stdout.write(config.to_toml())
        return 0
    asyncio.run(serve(config))
    return 0


# Keys of SimConfig with their own option; every other key (and any strategy_config /
# model_config entry) is set with --set KEY=VALUE.
_SIM_OPTIONS = {
    "strategy": str,
    "dataset": str,
    "data_dir": str,
    "partition": str,
    "clients": int,
    "model": str,
    "profile": str,
    "base_time": float,
    "budget": str,
    "eval_every": str,
    "transport": str,
    "time_scale": float,
    "seed": int,
    "out": str,
    "scenario": str,
    "threads": int,
}


def _parse_value(text: str):
    """A --set value as TOML would read it (numbers, booleans, strings, arrays)."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def _simulate(args: argparse.Namespace) -> int:
    from aggsrv.sim.config import SimConfig

    overrides = {k: getattr(args, k) for k in _SIM_OPTIONS}
    nested: dict[str, dict] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            sys.stderr.write(f"aggsrv simulate: --set needs KEY=VALUE, got {item!r}\n")
            return 2
        table, dot, sub = key.partition(".")
        if dot:
            nested.setdefault(table, {})[sub] = _parse_value(value)
        else:
            overrides[key] = _parse_value(value)
    try:
        config = SimConfig.load(args.config, {k: v for k, v in overrides.items() if v is not None})
        for table, entries in nested.items():
            if table not in ("strategy_config", "model_config", "profile"):
                raise ValueError(
                    f"--set {table}.KEY: only strategy_config, model_config and profile are tables"
                )
            current = getattr(config, table)
            if isinstance(current, str):
                current = {"name": current}
            setattr(config, table, {**current, **entries})
        config = SimConfig.from_mapping(config.to_dict())  # re-validate the merged tables
    except (OSError, ValueError, TypeError) as exc:
        sys.stderr.write(f"aggsrv simulate: {exc}\n")
        return 2
    if args.print_config:
        sys.stdout.write(config.to_toml())
        return 0
    from aggsrv.data import DatasetUnavailable
    from aggsrv.sim import run
    from aggsrv.sim.report import format_table, load_run

    try:
        result = run(config, progress=args.progress)
    except DatasetUnavailable as exc:
        sys.stderr.write(f"aggsrv simulate: {exc}\n")
        return 2
    s = result.summary
    sys.stdout.write(
        format_table([load_run(result.out_dir)], args.target)
        + f"\n\n{s['strategy']} on {s['dataset']} ({s['clients']} clients, {s['transport']}): "
        f"final accuracy {s['final_accuracy']:.3f} (best {s['best_accuracy']:.3f}) after "
        f"{s['virtual_time']:.1f} virtual s, {s['versions']} versions, "
        f"{s['updates_applied']} updates, {s['wall_time']:.1f} s wall\n"
        f"files: {result.out_dir}/{{config.toml,metrics.jsonl,summary.json,accuracy.png}}\n"
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    from aggsrv.sim.report import report

    try:
        table, runs = report(
            args.runs, target=args.target, plot=args.plot, dendrogram=args.dendrogram
        )
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"aggsrv report: {exc}\n")
        return 2
    sys.stdout.write(table + "\n")
    if args.plot:
        sys.stdout.write(f"\n{len(runs)} runs; plot: {args.plot}\n")
    return 0


def _pull(args: argparse.Namespace) -> int:
    import torch

    from aggsrv.client.client import Client

    with Client(args.address, client_id="aggsrv-pull") as client:
        status = client.status()
        if not status.has_model:
            sys.stderr.write("aggsrv pull: the server has no model yet\n")
            return 1
        version, flat = client.get_model(args.version)
        # The trainable layout travels in the model header; rebuild names and shapes from it.
        layout = client.last_model_layout
    state = {name: t.clone() for name, t in layout.unflatten(flat).items()}
    torch.save(state, args.output)
    sys.stdout.write(f"version {version}: {layout.numel} parameters -> {args.output}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aggsrv", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=metadata.version("aggsrv"))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show versions and which kernel backend will be used")
    info.set_defaults(func=_info)

    sim = sub.add_parser(
        "simulate",
        help="run a federated experiment (simulated clients, stragglers, real data)",
        description="Every config key can be set in --config FILE.toml, by its option, or with "
        "--set KEY=VALUE (tables: --set strategy_config.learning_rate=0.05).",
    )
    sim.add_argument("--config", help="TOML file with simulate keys (see --print-config)")
    for key, kind in _SIM_OPTIONS.items():
        sim.add_argument("--" + key.replace("_", "-"), dest=key, type=kind)
    sim.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other config key")
    sim.add_argument("--target", type=float, default=0.8, help="accuracy for 'time to target'")
    sim.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="draw the progress bar (default: when stderr is a terminal)",
    )  # fmt: skip
    sim.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )
    sim.set_defaults(func=_simulate)

    rep = sub.add_parser("report", help="compare finished runs: a table and one plot")
    rep.add_argument("runs", nargs="+", help="run directories, or folders holding them")
    rep.add_argument("--target", type=float, default=0.8, help="accuracy for 'time to target'")
    rep.add_argument("--plot", default="report.png", help="where to write the plot ('' for none)")
    rep.add_argument(
        "--no-dendrogram", dest="dendrogram", action="store_false",
        help="no FedDGIC grouping dendrograms (PLOT_STEM-dendrogram-LABEL-sSEED.png by default)",
    )  # fmt: skip
    rep.set_defaults(func=_report)

    serve = sub.add_parser("serve", help="run the aggregation server")
    serve.add_argument("--config", help="TOML file with server keys (see --print-config)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--strategy",
        help="fedavg, fedasync, fedbuff, fedprox, fedogd, orthofl, feden, fedhist, feddgic, "
        "mifa, ca2fl, twafl, fedfg (or package.module:Class)",
    )
    serve.add_argument("--device", help="auto, cpu or cuda[:N]")
    serve.add_argument("--model-init", help="a torch.save'd state dict to start from")
    serve.add_argument("--max-clients", type=int)
    serve.add_argument("--max-concurrent-uploads", type=int)
    serve.add_argument(
        "--events-file", help="append the strategy's events (FedDGIC's groupings) here, JSON lines"
    )
    serve.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )
    serve.set_defaults(func=_serve)

    pull = sub.add_parser("pull", help="download the global model as a state dict")
    pull.add_argument("address", help="host:port of the server")
    pull.add_argument("--version", type=int, help="a retained version (default: the latest)")
    pull.add_argument("-o", "--output", required=True, help="where to torch.save the state dict")
    pull.set_defaults(func=_pull)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
