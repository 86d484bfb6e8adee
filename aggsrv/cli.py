"""The `aggsrv` command line: `simulate` runs an experiment, `report` compares runs, `sweep` runs a
setting over a grid, `tune` tries settings on a recorded trace, `serve` runs the aggregation
server, `client` trains as one of its clients, `status` / `checkpoint` / `shutdown` operate a
running server, `token` issues bearer tokens, `pull` downloads the global model, `info` describes
this installation."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path


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

    overrides = {key: getattr(args, key) for key in _SERVE_OPTIONS}
    _torchrun_shard(overrides)
    if args.dashboard_allowed_hosts:  # repeated and/or comma-separated: one list
        overrides["dashboard_allowed_hosts"] = [
            name.strip() for item in args.dashboard_allowed_hosts for name in item.split(",")
        ]
    if args.resume is not None:
        overrides["state_dir"] = args.resume
        overrides["resume"] = True
    tables = {}
    if args.dp_target_epsilon is not None:  # a strategy key, with a flag of its own
        tables["strategy_config"] = {"dp_target_epsilon": args.dp_target_epsilon}
    config, rc = _configured("serve", ServerConfig, args, overrides, tables)
    if config is None:
        return rc
    from aggsrv.logs import configure

    configure("debug" if args.verbose else config.log_level, config.log_format)
    try:
        return asyncio.run(serve(config))  # 1: the server stopped after a failure
    except (OSError, ValueError) as exc:  # e.g. an occupied state_dir, an unreadable TLS key
        logging.getLogger("aggsrv").error("%s", exc)
        sys.stderr.write(f"aggsrv serve: {exc}\n")
        return 2


def _configured(command: str, config_class, args: argparse.Namespace, overrides, tables):
    """(config, 0): the config built once from --config, the options' ``overrides`` and the
    ``tables``' keys; (None, exit code) when there is nothing to run: 2 after an error, 0
    after --print-config printed it."""
    try:
        config = config_class.load(args.config, overrides, tables)
    except (OSError, ValueError, TypeError) as exc:
        sys.stderr.write(f"aggsrv {command}: {exc}\n")
        return None, 2
    if args.print_config:
        sys.stdout.write(_printed_config(config))
        return None, 0
    return config, 0


def _printed_config(config) -> str:
    """--print-config: every key of the config, then every key of the strategy with the value
    it runs with, each with its description (a None key as a commented line), so the output
    documents both and loads back to the same configuration."""
    from aggsrv.config_file import described_table

    settings = config.strategy_settings
    cls = type(settings)
    presets = ", ".join(sorted(cls.PRESETS)) or "none"
    header = [f"{config.strategy} presets: {presets}"]
    header += [f"  {name}: {note}" for name, note in cls.PRESET_NOTES.items()]
    offered = settings.to_dict()
    offered = {key: offered[key] for key in cls.offered_keys()}
    table = described_table("strategy_config", offered, cls.field_help(), header)
    return config.described_toml(exclude=["strategy_config"]) + "\n" + table


def _torchrun_shard(overrides: dict) -> None:
    """Under torchrun (WORLD_SIZE, RANK and LOCAL_RANK set), one process per shard: take the
    shard count and rank from it, and give the processes of one machine ports P, P+1, ..."""
    env = os.environ
    if overrides.get("shards") is not None or "WORLD_SIZE" not in env or "RANK" not in env:
        return
    overrides["shards"] = int(env["WORLD_SIZE"])
    overrides["rank"] = int(env["RANK"])
    local = int(env.get("LOCAL_RANK", "0"))
    if local:
        from aggsrv.server.config import ServerConfig

        base = overrides.get("port")
        overrides["port"] = (ServerConfig.port if base is None else base) + local


# Server keys with their own `serve` option (every key can also be set in --config), with the
# type the option reads; each option's help is the key's description (ServerConfig.HELP).
_SERVE_OPTIONS = {
    "host": str,
    "port": int,
    "strategy": str,
    "device": str,
    "model_init": str,
    "max_clients": int,
    "max_concurrent_uploads": int,
    "events_file": str,
    "trace": str,
    "trace_max_bytes": int,
    "trace_backups": int,
    "auth": str,
    "auth_secret_file": str,
    "tokens_file": str,
    "tls_cert": str,
    "tls_key": str,
    "tls_client_ca": str,
    "state_dir": str,
    "durability": str,
    "checkpoint_every_updates": int,
    "checkpoint_every_seconds": float,
    "checkpoint_every_bytes": int,
    "checkpoint_keep": int,
    "metrics_port": int,
    "metrics_host": str,
    "dashboard_port": int,
    "dashboard_host": str,
    "eval": str,
    "eval_every_versions": int,
    "rate_limit_per_second": float,
    "max_concurrent_rpcs": int,
    "upload_idle_timeout_seconds": float,
    "log_format": str,
    "log_level": str,
    "shards": int,
    "rank": int,
    "dist_url": str,
    "shard_address": str,
}


def _serve_flag(key: str) -> str:
    """The `serve` option of a server key: --eval-every for eval_every_versions, --rate-limit
    for rate_limit_per_second, else the key with dashes."""
    return "--" + key.replace("_", "-").replace("-versions", "").replace("-per-second", "")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose options that set a config key take their help from the key's
    description (the config class's ``field_help``) when the help is shown: the one source of
    what a key does, without importing the config classes (and torch) to parse a command."""

    config_help: Callable[[], Mapping[str, str]] | None = None

    def format_help(self) -> str:
        if self.config_help is not None:
            descriptions = self.config_help()
            for action in self._actions:
                if action.help is None and action.dest in descriptions:
                    action.help = descriptions[action.dest].replace("%", "%%")
            self.config_help = None
        return super().format_help()


def _server_help() -> Mapping[str, str]:
    from aggsrv.server.config import ServerConfig

    return ServerConfig.field_help()


def _sim_help() -> Mapping[str, str]:
    from aggsrv.sim.config import SimConfig

    return SimConfig.field_help()


def _connect(args: argparse.Namespace, client_id: str = "aggsrv-cli"):
    from aggsrv.client.client import Client

    return Client(
        args.address, client_id=client_id, token=args.token, token_file=args.token_file,
        tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        timeout=args.timeout, retries=0, direct_to_shards=not args.rank0_only,
    )  # fmt: skip


def _ask(args: argparse.Namespace, command: str, call):
    """``call(client)`` on a connection made from the command's options; (answer, exit code),
    the answer None and the code 1 when the server refused (the reason on stderr)."""
    import grpc

    try:
        with _connect(args) as client:
            return call(client), 0
    except grpc.RpcError as exc:
        sys.stderr.write(f"aggsrv {command}: {exc.code().name}: {exc.details()}\n")
        return None, 1


def _client(args: argparse.Namespace) -> int:
    import threading

    from aggsrv.client_command import ClientOptions, run_client, signals_stop

    names = ("server", "client_id", "token", "token_file", "tls_ca", "tls_cert", "tls_key",
             "data", "data_dir", "partition", "clients", "index", "model", "seed", "state_dir",
             "updates", "job_wait_seconds", "give_up_after")  # fmt: skip
    stop = threading.Event()
    try:
        with signals_stop(stop):
            return run_client(ClientOptions(**{n: getattr(args, n) for n in names}), stop)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"aggsrv client: {exc}\n")
        return 2


def _status(args: argparse.Namespace) -> int:
    status, rc = _ask(args, "status", lambda client: client.status())
    if status is None:
        return rc
    if args.json:
        import json

        from google.protobuf.json_format import MessageToDict

        sys.stdout.write(json.dumps(MessageToDict(status), indent=2, sort_keys=True) + "\n")
        return 0
    sys.stdout.write(format_status(status) + "\n")
    return 0


def format_status(s) -> str:
    """A status response as aligned lines for a person."""
    rows = [
        ("model", f"version {s.version} (oldest retained {s.oldest_retained_version}), "
                  f"{s.numel} parameters + {s.buffer_numel} buffer elements"
         if s.has_model else "none yet (waiting for the first client's model)"),
        ("strategy", s.strategy),
        ("clients", f"{s.clients_known} known, {s.clients_active} active"),
        ("updates", f"{s.updates_accepted} accepted ({s.updates_applied} applied), "
                    f"{s.updates_duplicate} duplicate, {s.updates_rejected} rejected"
                    + (f" {dict(s.rejected_by_code)}" if s.rejected_by_code else "")
                    + (f", {sum(s.filtered_by_reason.values())} filtered "
                       f"{dict(s.filtered_by_reason)}" if s.filtered_by_reason else "")
                    + (f", {s.updates_clipped} clipped" if s.updates_clipped else "")
                    + (" (public refusals only: differential privacy withholds the rest from "
                       "non-admin tokens)" if s.data_withheld else "")),
        ("queue", f"{s.queue_depth} waiting, {s.uploads_in_progress} uploading"),
        ("durability", s.durability + (f", {s.wal_bytes / 1e6:.1f} MB logged since the last "
                                       "checkpoint" if s.durability == "on" else "")),
        ("checkpoint", f"version {s.last_checkpoint_version} at "
                       f"{s.last_checkpoint_time.ToDatetime():%Y-%m-%d %H:%M:%S} UTC"
         if s.HasField("last_checkpoint_version") else "none"),
        ("auth", s.auth),
        ("memory", f"{s.cache_bytes / 1e6:.1f} MB in the strategy's tensors"
                   + (f"; row cache: {s.cache_rows} rows of {_size(s.cache_row_bytes)} "
                      f"({s.cache_dtype})" if s.cache_dtype else "")),
        ("evaluation", f"version {s.eval_version}: " + ", ".join(
            f"{k} {v:.4g}" for k, v in sorted(s.eval_metrics.items()))
         if s.HasField("eval_version") else "none"),
        ("uptime", f"{s.uptime.ToTimedelta()}"),
    ]  # fmt: skip
    if s.failure:
        rows.insert(1, ("writes", f"REFUSED: {s.failure}"))
    if s.HasField("privacy"):
        p = s.privacy
        budget = f"of {p.target_epsilon:g}" if p.HasField("target_epsilon") else "(no budget)"
        rows.insert(
            3,
            (
                "privacy",
                f"epsilon {p.epsilon:.4g} {budget} at delta {p.delta:g}, "
                f"{p.releases} releases, C {p.clip_norm:g}, z {p.noise_multiplier:g}, "
                + (
                    "clip count withheld (admin token only)"
                    if s.data_withheld
                    else f"{p.updates_clipped} clipped"
                )
                + (": budget spent, no more versions" if p.budget_spent else ""),
            ),
        )
    lines = [f"{k:<11} {v}" for k, v in rows]
    if s.shards:
        lines += ["", *format_shards(s)]
    return "\n".join(lines)


def format_shards(s) -> list[str]:
    """Rank 0's table of the shards (StatusResponse.shards), then why each shard that does
    not take writes does not."""
    now = s.server_time.ToNanoseconds() / 1e9
    table = [("rank", "address", "slice", "version", "writes", "last heard", "log")]
    why = []
    for r in s.shards:
        if r.HasField("last_heard"):
            ago = max(0.0, now - r.last_heard.ToNanoseconds() / 1e9)
            heard = "now" if ago < 0.5 else f"{ago:.0f} s ago"
        else:
            heard = "never"
        log = "off" if r.durability != "on" else _size(r.wal_bytes)
        if r.HasField("last_checkpoint_version"):
            log += f", ckpt v{r.last_checkpoint_version}"
        writes = "yes" if r.takes_writes else "NO" if r.reachable else "UNREACHABLE"
        table.append((str(r.rank), r.address, f"[{r.begin}, {r.end})", str(r.version), writes,
                      heard, log))  # fmt: skip
        if not r.reachable:
            why.append(f"  shard {r.rank}: unreachable: {r.error}")
        elif r.failure:
            why.append(f"  shard {r.rank}: stopped taking writes: {r.failure}")
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [f"shards      {len(s.shards)} (rank 0 answered; slices of [0, {s.numel}))"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in table]  # fmt: skip
    return lines + why


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _checkpoint(args: argparse.Namespace) -> int:
    from aggsrv.v1 import aggregation_pb2 as pb

    resp, rc = _ask(
        args, "checkpoint", lambda c: c.admin_call("Checkpoint", pb.CheckpointRequest())
    )
    if resp is not None:
        sys.stdout.write(
            f"checkpoint of version {resp.version}: {resp.bytes / 1e6:.1f} MB in "
            f"{resp.took.ToTimedelta().total_seconds():.2f} s -> {resp.path}\n"
        )
    return rc


def _shutdown(args: argparse.Namespace) -> int:
    from aggsrv.v1 import aggregation_pb2 as pb

    request = pb.ShutdownRequest(grace_seconds=args.grace)
    resp, rc = _ask(args, "shutdown", lambda c: c.admin_call("Shutdown", request))
    if resp is not None:
        sys.stdout.write(f"server stopping at version {resp.version}\n")
    return rc


def _token(args: argparse.Namespace) -> int:
    from aggsrv.server import auth

    try:
        if args.new_secret:
            auth.save_secret(args.secret_file, auth.new_secret())
            sys.stderr.write(f"new secret in {args.secret_file}\n")
            if not args.subjects:
                return 0
        secret = auth.load_secret(args.secret_file)
        role = auth.ROLE_ADMIN if args.admin else auth.ROLE_CLIENT
        subjects = args.subjects or ([auth.ADMIN_SUBJECT] if args.admin else [])
        if not subjects:
            raise ValueError("name at least one CLIENT_ID (or --admin)")
        ttl = args.ttl_hours * 3600 if args.ttl_hours else None
        for subject in subjects:
            token = auth.issue_token(secret, subject, role=role, ttl_seconds=ttl)
            sys.stdout.write(f"{token}\n" if len(subjects) == 1 else f"{subject} {token}\n")
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"aggsrv token: {exc}\n")
        return 2
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
    "attack": str,
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
    tables: dict[str, dict] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            sys.stderr.write(f"aggsrv simulate: --set needs KEY=VALUE, got {item!r}\n")
            return 2
        table, dot, sub = key.partition(".")
        if dot and table not in ("strategy_config", "model_config", "profile"):
            sys.stderr.write(
                f"aggsrv simulate: --set {table}.KEY: only strategy_config, model_config and "
                "profile are tables\n"
            )
            return 2
        if dot:
            tables.setdefault(table, {})[sub] = _parse_value(value)
        else:
            overrides[key] = _parse_value(value)
    config, rc = _configured("simulate", SimConfig, args, overrides, tables)
    if config is None:
        return rc
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
        + _attack_line(s.get("attack"))
        + f"files: {result.out_dir}/{{config.toml,metrics.jsonl,summary.json,accuracy.png}}\n"
    )
    return 0


def _attack_line(attack: dict | None) -> str:
    """One line on the run's attackers and their crafted updates ('' without an attack)."""
    if not attack:
        return ""
    sent, accepted = attack["crafted_sent"], attack["crafted_accepted"]
    return (
        f"attack {attack['spec']}: attackers {', '.join(attack['attackers']) or 'none'}; "
        f"{sum(sent.values())} crafted updates sent, {sum(accepted.values())} accepted\n"
    )


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


def _sweep(args: argparse.Namespace) -> int:
    from aggsrv.sim.sweep import check_sweep, load_sweep, report_sweep, run_sweep

    try:
        sweep = load_sweep(args.file)
        if args.seeds:
            sweep.seeds = list(args.seeds)
            check_sweep(sweep)  # the same checks as the file's seeds (e.g. no repeats)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"aggsrv sweep: {exc}\n")
        return 2
    out = Path(args.out)
    failed = 0
    if not args.report_only:
        if args.jobs < 1:
            sys.stderr.write(f"aggsrv sweep: --jobs must be >= 1, got {args.jobs}\n")
            return 2
        phases = ("main",) if args.no_ablations else ("main", "ablations")
        failed = run_sweep(sweep, out, jobs=args.jobs, progress=args.progress, phases=phases)
    text, plots = report_sweep(sweep, out, plot=args.plot)
    sys.stdout.write(text)
    sys.stdout.write(f"\ntables: {out / 'sweep.md'}" + "".join(f"\nplot: {p}" for p in plots))
    sys.stdout.write("\n")
    if failed:
        sys.stderr.write(f"aggsrv sweep: {failed} runs failed (in the table; rerun to retry)\n")
        return 1
    return 0


def _tune(args: argparse.Namespace) -> int:
    from aggsrv.sim.config import SimConfig
    from aggsrv.sim.sweep import report_sweep, run_sweep
    from aggsrv.sim.tune import CURRENT, parse_grid, tune_sweep
    from aggsrv.sim.tune_report import tune_report

    try:
        base = SimConfig.load(args.config) if args.config else None
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        if not args.scale > 0:
            raise ValueError(f"--scale must be > 0, got {args.scale}")
        sweep = tune_sweep(
            args.trace, args.strategy, parse_grid(args.grid), args.seeds, base=base,
            scale=args.scale, budget=args.budget,
        )  # fmt: skip
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"aggsrv tune: {exc}\n")
        return 2
    out = Path(args.out)
    failed = run_sweep(sweep, out, jobs=args.jobs, progress=args.progress, phases=("main",))
    report_sweep(sweep, out, plot=False)
    text = tune_report(sweep, out, args.trace, baseline=CURRENT)
    sys.stdout.write(text + f"\ntable: {out / 'tune.md'} (the sweep's own: {out / 'sweep.md'})\n")
    if failed:
        sys.stderr.write(f"aggsrv tune: {failed} runs failed (in the table; rerun to retry)\n")
        return 1
    return 0


def _pull(args: argparse.Namespace) -> int:
    import torch

    with _connect(args, client_id="aggsrv-pull") as client:
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
    parser = _Parser(prog="aggsrv", description=" ".join(__doc__.split()))
    parser.add_argument("--version", action="version", version=metadata.version("aggsrv"))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show versions and which kernel backend will be used")
    info.set_defaults(func=_info)

    sim = sub.add_parser(
        "simulate",
        help="run a federated experiment (simulated clients, stragglers, real data)",
        description="Every config key can be set in --config FILE.toml, by its option, or with "
        "--set KEY=VALUE (tables: --set strategy_config.learning_rate=0.05). --print-config "
        "prints every key with its value and description; docs/config.md lists them all.",
    )
    sim.config_help = _sim_help
    sim.add_argument("--config", help="TOML file with simulate keys (see --print-config)")
    for key, kind in _SIM_OPTIONS.items():
        # No help here: _Parser shows SimConfig's description of the key.
        sim.add_argument("--" + key.replace("_", "-"), dest=key, type=kind)
    sim.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other config key")
    sim.add_argument("--target", type=float, default=0.8, help="accuracy for 'time to target'")
    _progress_option(sim)
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

    sweep = sub.add_parser(
        "sweep",
        help="run a grid of settings, every method against its baselines; heat maps of margins",
        description="Runs what OUT/results.jsonl lacks (an interrupted sweep resumes), then "
        "writes OUT/sweep.md and OUT/heatmap-ARM.png. The sweep file format: docs/sweeps.md.",
    )
    sweep.add_argument("file", help="a sweep TOML (e.g. bench/experiments/sweeps/*.toml)")
    sweep.add_argument("--out", required=True, help="folder for the table, runs and report")
    sweep.add_argument("--jobs", type=int, default=1, help="simulations at once (1 thread each)")
    sweep.add_argument("--seeds", type=int, nargs="+", help="instead of the file's seeds")
    sweep.add_argument(
        "--report-only", action="store_true", help="report the table as it is; run nothing"
    )
    sweep.add_argument(
        "--no-ablations", action="store_true", help="run the methods and baselines only"
    )
    sweep.add_argument(
        "--no-plot", dest="plot", action="store_false", help="tables only, no heat maps"
    )
    _progress_option(sweep)
    sweep.set_defaults(func=_sweep)

    tune = sub.add_parser(
        "tune",
        help="try strategy settings on a recorded trace's timing (serve --trace) before "
        "changing them in production",
        description="Replays the trace's clients (profile trace:file=FILE) under the current "
        "setting and every point of --grid, over the seeds, and prints each point's accuracy "
        "and margin over the current setting. Runs resume from OUT/results.jsonl.",
    )
    tune.add_argument("--trace", required=True, help="a trace written by aggsrv serve --trace")
    tune.add_argument("--strategy", required=True, help="the strategy to tune")
    tune.add_argument(
        "--grid", action="append", required=True, metavar="KEY=V1,V2,...",
        help="strategy keys to try (repeat for a product): --grid buffer_size=5,10,20",
    )  # fmt: skip
    tune.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    tune.add_argument("--config", help="a simulate TOML: data, model, the current setting")
    tune.add_argument("--scale", type=float, default=1.0, help="multiplies every recorded time")
    tune.add_argument("--budget", help="instead of the recorded span (e.g. 600s, 200v)")
    tune.add_argument("--out", required=True, help="folder for the table, runs and report")
    tune.add_argument("--jobs", type=int, default=1, help="simulations at once (1 thread each)")
    _progress_option(tune)
    tune.set_defaults(func=_tune)

    serve = sub.add_parser(
        "serve",
        help="run the aggregation server",
        description="Every key can be set in --config FILE.toml; --print-config prints every key "
        "with its value and description, docs/config.md lists them all, and docs/operations.md "
        "explains authentication, TLS, durability, metrics and limits.",
    )
    serve.config_help = _server_help
    serve.add_argument("--config", help="TOML file with server keys (see --print-config)")
    for key, kind in _SERVE_OPTIONS.items():
        # No help here: _Parser shows ServerConfig's description of the key.
        serve.add_argument(_serve_flag(key), dest=key, type=kind)
    serve.add_argument(
        "--dashboard-allowed-host", dest="dashboard_allowed_hosts", action="append",
        metavar="NAME",
        help="a host name the page answers besides IPs and localhost (a proxy's); repeat, or "
        "use commas; replaces the file's list",
    )  # fmt: skip
    serve.add_argument(
        "--resume", metavar="DIR",
        help="continue the run whose checkpoints and log are in DIR (sets --state-dir DIR)",
    )  # fmt: skip
    serve.add_argument(
        "--dp-target-epsilon", type=float, metavar="EPS",
        help="with the dp_ keys: publish no version that takes epsilon past EPS "
        "(strategy_config.dp_target_epsilon)",
    )  # fmt: skip
    serve.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )
    serve.set_defaults(func=_serve)

    client = sub.add_parser(
        "client",
        help="run a training client: jobs from a server, trained on its part of a data set",
        description="Registers, then trains every job the server hands it on its part of a "
        "data set, by the job's recipe, and pushes the update, until --updates, a spent privacy "
        "budget or SIGTERM. Every client of a federation gives the same --data, --partition, "
        "--clients, --model and --seed, and its own --index and --client-id.",
    )
    client.add_argument("--server", required=True, help="host:port of the server")
    client.add_argument("--client-id", required=True, help="this client's id (its token's)")
    client.add_argument("--token", help="bearer token (aggsrv token ... CLIENT_ID)")
    client.add_argument("--token-file", help="file whose first line is the token")
    client.add_argument("--tls-ca", "--ca", dest="tls_ca",
                        help="CA certificate that signed the server's (TLS on)")  # fmt: skip
    client.add_argument("--tls-cert", help="client certificate for mutual TLS")
    client.add_argument("--tls-key", help="client key for mutual TLS")
    client.add_argument("--data", default="digits",
                        help="digits, fashion_mnist, mnist_subset, or module:callable")  # fmt: skip
    client.add_argument("--data-dir", help="where a data set's files are (the simulator's)")
    client.add_argument("--partition", default="iid", help="how the data set is split (simulate's)")
    client.add_argument("--clients", type=int, default=1, help="parts the data set is split in")
    client.add_argument("--index", type=int, default=0, help="this client's part, 0-based")
    client.add_argument("--model", default="mlp", help="a built-in model or module:callable")
    client.add_argument("--seed", type=int, default=0, help="the split's and the model's seed")
    client.add_argument("--state-dir", help="updates pushed and the one in flight, for restarts")
    client.add_argument(
        "--updates",
        type=int,
        help="stop once this many updates were accepted in all (restarts included)",
    )
    client.add_argument("--job-wait-seconds", type=float, default=300.0,
                        help="the longest one wait for a job and its download lasts")  # fmt: skip
    client.add_argument("--give-up-after", type=float, default=300.0,
                        help="seconds without the server before exiting (code 3)")  # fmt: skip
    client.set_defaults(func=_client)
    pull = sub.add_parser("pull", help="download the global model as a state dict")
    _connection_options(pull)
    pull.add_argument("--version", type=int, help="a retained version (default: the latest)")
    pull.add_argument("-o", "--output", required=True, help="where to torch.save the state dict")
    pull.set_defaults(func=_pull)

    status = sub.add_parser("status", help="print a running server's status")
    _connection_options(status)
    status.add_argument("--json", action="store_true", help="the raw status as JSON")
    status.set_defaults(func=_status)
    ckpt = sub.add_parser("checkpoint", help="make a running server checkpoint now (admin)")
    _connection_options(ckpt)
    ckpt.set_defaults(func=_checkpoint)
    stop = sub.add_parser("shutdown", help="stop a running server cleanly (admin)")
    _connection_options(stop)
    stop.add_argument("--grace", type=float, default=5.0, help="seconds for in-flight calls")
    stop.set_defaults(func=_shutdown)

    token = sub.add_parser(
        "token", help="issue bearer tokens from a server secret (hmac authentication)"
    )
    token.add_argument("subjects", nargs="*", metavar="CLIENT_ID", help="client ids to issue for")
    token.add_argument("--secret-file", required=True, help="the server's secret (hex)")
    token.add_argument(
        "--admin",
        action="store_true",
        help="an admin token: checkpoint and shutdown, and the whole status under DP",
    )
    token.add_argument("--ttl-hours", type=float, help="expire after this many hours")
    token.add_argument(
        "--new-secret", action="store_true", help="first write a new random secret to the file"
    )
    token.set_defaults(func=_token)
    return parser


def _progress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="draw the progress bar (default: when stderr is a terminal)",
    )  # fmt: skip


def _connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="host:port of the server")
    p.add_argument("--token", help="bearer token (admin for checkpoint and shutdown)")
    p.add_argument("--token-file", help="file whose first line is the token")
    p.add_argument("--tls-ca", help="CA certificate that signed the server's (TLS on)")
    p.add_argument("--tls-cert", help="client certificate for mutual TLS")
    p.add_argument("--tls-key", help="client key for mutual TLS")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds")
    p.add_argument(
        "--rank0-only", action="store_true",
        help="a sharded server: talk to rank 0 only, which fetches the other shards' slices "
        "(default: every shard)",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
