"""Server configuration: a dataclass with working defaults, loaded from TOML and overridden from
the command line. Unknown keys are an error, so a typo never silently falls back to a default."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aggsrv.config_check import Count
from aggsrv.config_file import TomlConfig
from aggsrv.strategies import StrategyConfig, strategy_settings

MIB = 1 << 20


@dataclass
class ServerConfig(TomlConfig):
    """Everything `aggsrv serve` needs; every key may appear in the TOML file.

    What each key does is in :attr:`HELP` (printed by --print-config, shown by the options'
    --help, listed in docs/config.md); the comments here say why a default is what it is.
    """

    KIND = "server"  # in error messages (not a field: no annotation)

    HELP: ClassVar[Mapping[str, str]] = {
        "host": "address the gRPC server listens on (0.0.0.0 or :: for every interface)",
        "port": "port the gRPC server listens on; 0 picks a free one",
        "strategy": "the aggregation strategy: a name (fedasync, fedavg, fedbuff, ...; "
        "docs/config.md lists them) or package.module:Class",
        "strategy_config": "the strategy's own keys (a [strategy_config] table), checked by its "
        "config class",
        "device": "where the strategy's tensors live: auto (cuda when available, else cpu), cpu, "
        "cuda or cuda:N",
        "model_init": "a torch.save'd state dict to start from, laid out as the clients lay out "
        "theirs; unset = the first client's model",
        "max_clients": "most clients the server registers; a new one beyond it is refused "
        "(RESOURCE_EXHAUSTED)",
        "max_concurrent_uploads": "staging slots: uploads decoded at once; more wait for a slot "
        "(backpressure, not an error)",
        "chunk_bytes": "largest tensor chunk either way, in bytes (a multiple of 4, >= 64, 64 "
        "below max_receive_message_bytes)",
        "update_quantizations": "quantized values (int8, int4) every job's recipe lets a client "
        "send its update in; none under DP",
        "quantization_block": "values per scale suggested to clients for quantized updates "
        "(1 to 65536)",
        "max_receive_message_bytes": "largest gRPC message the server receives or sends, in bytes",
        "stream_window_bytes": "HTTP/2 flow-control window per stream, in bytes: what gRPC "
        "buffers of an upload that waits for a slot",
        "lease_seconds": "seconds a client stays active after its last Register, GetJob, "
        "PushUpdate or Heartbeat",
        "retained_versions": "newest model versions GetModel serves, the current one included",
        "pending_interval_seconds": "a GetJob stream with no job yet sends JobPending after each "
        "change and at least this often, in seconds",
        "events_file": "append the strategy's events (e.g. FedDGIC's groupings) here as JSON "
        "lines; unset = none written",
        "trace": "record one JSON line per job and update here (no model data), for aggsrv tune; "
        "unset = no trace",
        "trace_max_bytes": "size in bytes at which the trace file rotates (to TRACE.1, TRACE.2, "
        "...)",
        "trace_backups": "rotated trace files kept",
        "auth": "hmac (tokens signed with the server secret, client id inside), tokens (a tokens "
        "file) or none",
        "auth_secret_file": "the HMAC secret (hex); unset = STATE_DIR/auth/secret, generated on "
        "first start and reused",
        "tokens_file": 'TOML file of the accepted tokens, for auth = "tokens"; unset = none',
        "tls_cert": "server certificate chain (PEM); with tls_key turns TLS on; unset = plaintext",
        "tls_key": "server private key (PEM), with tls_cert; unset = plaintext",
        "tls_client_ca": "CA (PEM) that must have signed each client's certificate (mutual TLS); "
        "unset = none asked",
        "max_concurrent_rpcs": "calls served at once, all clients together; more: "
        "RESOURCE_EXHAUSTED (from gRPC)",
        "max_streams_per_connection": "HTTP/2 streams one connection may have open at once",
        "rate_limit_per_second": "PushUpdate and Register calls per second per client id, GetJob "
        "calls apart; 0 = no limit",
        "rate_limit_burst": "calls a client id may make at once beyond the rate (the token "
        "bucket's size)",
        "upload_idle_timeout_seconds": "seconds an upload may send nothing before it is cut "
        "(DEADLINE_EXCEEDED) and its slot freed",
        "max_model_bytes": "largest initial model a client may offer, in bytes (4 per weight and "
        "buffer value)",
        "max_labels": "labels a client may register with (each key and value at most 256 bytes)",
        "state_dir": 'folder of the checkpoints and the write-ahead log; unset or "" = nothing '
        "is written",
        "durability": "on: each accepted update is in the fsynced log before its ack; off: "
        "checkpoints only; auto: on with a state_dir",
        "resume": "continue from state_dir's newest checkpoint and the log after it",
        "checkpoint_every_updates": "checkpoint after this many accepted updates; 0 = not by count",
        "checkpoint_every_seconds": "checkpoint this often, in seconds; 0 = not by time",
        "checkpoint_every_bytes": "checkpoint at this many bytes of log since the last; 0 = not "
        "by size; unset = max(4x model, 2x checkpoint, 16 MiB)",
        "checkpoint_keep": "newest checkpoints kept, with the log segments after the oldest of "
        "them",
        "wal_part_bytes": "an arriving update is logged in parts of this many decoded bytes; 0 = "
        "logged whole once applied",
        "metrics_port": "serve Prometheus /metrics on this port (0 picks a free one); unset = no "
        "metrics",
        "metrics_host": "address the /metrics endpoint listens on",
        "dashboard_port": "serve the read-only status page (and /api/status) on this port, 0 = a "
        "free one; unset = no page",
        "dashboard_host": "address the status page listens on (it has no authentication)",
        "dashboard_allowed_hosts": "host names (no port) the status page answers besides IP "
        "addresses and, on loopback, localhost",
        "eval": "module:function given the global model's state dict every eval_every_versions "
        "versions; unset = no evaluation",
        "eval_every_versions": "evaluate (eval) every this many versions",
        "log_format": "text, or json (one JSON object per line)",
        "log_level": "debug, info, warning, error or critical",
        "shards": "processes that serve the federation together, each a slice of the model "
        "(docs/sharding.md)",
        "rank": "this process's shard, 0 to shards - 1 (rank 0 coordinates)",
        "dist_url": "tcp://HOST:PORT of rank 0's rendezvous for torch.distributed; unset = "
        "env:// (torchrun's variables)",
        "shard_address": "host:port clients reach this shard on (rank 0 hands it out); unset = "
        "host:port, a wildcard host as the machine's name",
        "shard_timeout_seconds": "seconds a collective between the shards may take before the "
        "federation fails (fail-stop)",
        "shard_slice_wait_seconds": "seconds an update rank 0 ordered waits for another shard's "
        "slice before every shard refuses it",
        "shard_order_wait_seconds": "seconds a slice on a shard of rank >= 1 waits for rank 0 to "
        "order its update",
        "shard_heartbeat_seconds": "seconds between rank 0's keep-alives when idle (a lost shard "
        "is noticed this fast)",
    }

    host: str = "127.0.0.1"
    port: int = 50051
    strategy: str = "fedasync"
    strategy_config: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    model_init: str | None = None
    max_clients: Count = 1024
    max_concurrent_uploads: Count = 4
    chunk_bytes: int = MIB
    # Quantized updates (docs/compression.md) are offered unless differential privacy is on,
    # whose clipping bounds the norm of what a client sends.
    update_quantizations: list[str] = field(default_factory=lambda: ["int8", "int4"])
    quantization_block: int = 128
    max_receive_message_bytes: int = 4 * MIB
    # Memory <= waiting uploads x this; smaller windows slow single uploads.
    stream_window_bytes: int = 256 * 1024
    lease_seconds: float = 60.0
    retained_versions: Count = 8
    # Keeps proxies from closing an idle stream.
    pending_interval_seconds: float = 30.0
    events_file: str | None = None
    trace: str | None = None
    trace_max_bytes: int = 64 * MIB
    trace_backups: int = 8

    # --- security (docs/operations.md "Authentication and TLS"); auth = "none" only behind
    # something else that authenticates.
    auth: str = "hmac"
    auth_secret_file: str | None = None
    tokens_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    # --- limits (docs/operations.md "Limits"): none lets a client make the server allocate
    # more than its configuration allows.
    max_concurrent_rpcs: Count = 256
    max_streams_per_connection: Count = 128  # many in-process clients share one connection
    rate_limit_per_second: float = 20.0
    rate_limit_burst: int = 40
    upload_idle_timeout_seconds: float = 30.0
    # Checked before anything is allocated for the model.
    max_model_bytes: int = 16 << 30
    max_labels: Count = 32

    # --- durability (docs/operations.md "Durability")
    state_dir: str | None = "aggsrv-state"
    # "auto" is resolved in _check_durability when the config is built, so a built config
    # (and --print-config) holds "on" or "off".
    durability: str = "auto"
    resume: bool = False
    checkpoint_every_updates: int = 1000
    checkpoint_every_seconds: float = 300.0
    # By size too, so no client can grow the log (and recovery) without bound: GetJob, Register
    # and update records alike count. Unset: aggsrv.server.checkpoints' default, which scales
    # with the model and with a strategy's [K, D] cache (a checkpoint that large every few
    # updates would cost more than the log it saves).
    checkpoint_every_bytes: int | None = None
    checkpoint_keep: Count = 2
    # Each part is sent on to the disk at once: smaller parts leave less for the acknowledging
    # fsync, but cost a record header (about 100 bytes) and a write each.
    wal_part_bytes: int = MIB

    # --- operations
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # docs/operations.md "Status page". No auth, so loopback by default like the metrics.
    dashboard_port: int | None = None
    dashboard_host: str = "127.0.0.1"
    # Any other Host header is refused (DNS rebinding); a reverse proxy's name goes here.
    dashboard_allowed_hosts: list[str] = field(default_factory=list)
    # Runs on its own thread; returns a mapping of metric name -> number (e.g. accuracy).
    eval: str | None = None
    eval_every_versions: Count = 50
    log_format: str = "text"
    log_level: str = "info"

    # --- sharding (docs/sharding.md): N processes that serve one federation, each a slice
    shards: Count = 1
    rank: int = 0
    dist_url: str | None = None
    shard_address: str | None = None
    shard_timeout_seconds: float = 120.0
    shard_slice_wait_seconds: float = 10.0
    shard_order_wait_seconds: float = 60.0
    shard_heartbeat_seconds: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        unknown = set(self.update_quantizations) - {"int8", "int4"}
        if unknown:
            raise ValueError(f"update_quantizations are among int8 and int4, got {sorted(unknown)}")
        if not 1 <= self.quantization_block <= 1 << 16:
            raise ValueError(
                f"quantization_block must be in [1, 65536], got {self.quantization_block}"
            )
        if self.chunk_bytes < 64 or self.chunk_bytes % 4:
            raise ValueError(
                f"chunk_bytes must be a multiple of 4 and >= 64, got {self.chunk_bytes}"
            )
        if self.chunk_bytes > self.max_receive_message_bytes - 64:
            raise ValueError(
                f"chunk_bytes ({self.chunk_bytes}) must stay 64 bytes below "
                f"max_receive_message_bytes ({self.max_receive_message_bytes})"
            )
        if not 64 * 1024 <= self.stream_window_bytes <= 1 << 30:
            raise ValueError(
                f"stream_window_bytes must be in [65536, 2**30], got {self.stream_window_bytes}"
            )
        if self.lease_seconds <= 0 or self.pending_interval_seconds <= 0:
            raise ValueError("lease_seconds and pending_interval_seconds must be > 0")
        self._check_security()
        self._check_limits()
        self._check_durability()
        self._check_sharding()
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.dashboard_port is not None and not 0 <= self.dashboard_port < 65536:
            raise ValueError(f"dashboard_port must be in [0, 65535], got {self.dashboard_port}")
        self._check_dashboard_hosts()
        if self.trace_max_bytes < 4096 or self.trace_backups < 1:
            raise ValueError(
                f"trace_max_bytes must be >= 4096 and trace_backups >= 1, got "
                f"{self.trace_max_bytes} and {self.trace_backups}"
            )
        if self.eval is not None and ":" not in self.eval:
            raise ValueError(f"eval must be 'module:function', got {self.eval!r}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level must be debug, info, warning or error: {self.log_level!r}")
        # A bad strategy name or [strategy_config] key fails at startup, not at the first
        # registration (where it would reach a client as an opaque error). The typed settings
        # are what the federation and its strategy run with; ``strategy_config`` stays the
        # table as written (the TOML round trip, checkpoints, the shards' agreement), so a
        # changed table takes dataclasses.replace, which reads it again.
        self.strategy_settings: StrategyConfig = strategy_settings(
            self.strategy, self.strategy_config
        )
        settings = self.strategy_settings
        if getattr(settings, "private", False) and self.state_dir and self.durability == "off":
            raise ValueError(
                "differential privacy with a state_dir needs durability = 'on': with checkpoints "
                "only, a server resumed after a crash would not charge the versions it published "
                "since the last checkpoint, and would publish other ones under the same numbers. "
                "Set durability = 'on' (the default with a state_dir), or give no state_dir"
            )
        if getattr(settings, "dp_seed", None) is not None and not settings.dp_insecure_seed:
            raise ValueError(
                "dp_seed fixes the differential-privacy noise: anyone who knows or guesses it "
                "can recompute every draw and subtract it from the published models, so the "
                "guarantee is gone. Leave dp_seed unset (the server draws a 256-bit key from "
                "the OS), or set dp_insecure_seed = true for an experiment"
            )

    def _check_dashboard_hosts(self) -> None:
        from aggsrv.server.dashboard.web import host_name_wanted

        for name in self.dashboard_allowed_hosts:
            wanted = host_name_wanted(name)
            if wanted:
                raise ValueError(
                    f"dashboard_allowed_hosts: each entry must be {wanted}, got {name!r}"
                )

    def _check_security(self) -> None:
        if self.auth not in ("hmac", "tokens", "none"):
            raise ValueError(f"auth must be hmac, tokens or none, got {self.auth!r}")
        if self.auth == "tokens" and not self.tokens_file:
            raise ValueError("auth = 'tokens' needs tokens_file")
        if self.auth == "hmac" and not self.auth_secret_file and not self.state_dir:
            raise ValueError(
                "auth = 'hmac' needs auth_secret_file (--auth-secret-file FILE, made with "
                "aggsrv token --new-secret --secret-file FILE), or a state_dir to keep a "
                "generated secret in; --auth none turns authentication off"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")

    def _check_limits(self) -> None:
        if self.rate_limit_per_second < 0:
            raise ValueError("rate_limit_per_second must be >= 0 (0: no limit)")
        if self.rate_limit_per_second > 0 and self.rate_limit_burst < 1:
            raise ValueError("rate_limit_burst must be >= 1")
        if self.upload_idle_timeout_seconds <= 0:
            raise ValueError("upload_idle_timeout_seconds must be > 0")
        if self.max_model_bytes < 64:
            raise ValueError("max_model_bytes must be >= 64")

    def _check_durability(self) -> None:
        if self.durability not in ("auto", "on", "off"):
            raise ValueError(f"durability must be auto, on or off, got {self.durability!r}")
        if self.durability == "auto":
            # "--state-dir ''" alone means "write nothing": no log either.
            self.durability = "on" if self.state_dir else "off"
        if self.durability == "on" and not self.state_dir:
            raise ValueError(
                "durability = 'on' needs a state_dir for the write-ahead log: give state_dir "
                "(--state-dir DIR), or durability = 'off' (--durability off) to keep nothing"
            )
        if self.resume and not self.state_dir:
            raise ValueError("resume needs a state_dir")
        if self.wal_part_bytes and (self.wal_part_bytes < 64 or self.wal_part_bytes % 4):
            raise ValueError(
                f"wal_part_bytes must be 0 (off) or a multiple of 4 and >= 64, got "
                f"{self.wal_part_bytes}"
            )
        if self.checkpoint_every_updates < 0 or self.checkpoint_every_seconds < 0:
            raise ValueError("checkpoint_every_updates and checkpoint_every_seconds must be >= 0")
        if self.checkpoint_every_bytes is not None and self.checkpoint_every_bytes < 0:
            raise ValueError(
                "checkpoint_every_bytes must be >= 0 (0: not by size), or unset for 4x the model"
            )

    def _check_sharding(self) -> None:
        if not 0 <= self.rank < self.shards:
            raise ValueError(f"need 0 <= rank < shards, got {self.rank} of {self.shards}")
        if self.shards == 1:
            return
        if self.state_dir and self.durability == "off":
            raise ValueError(
                "a sharded server with a state_dir keeps its write-ahead log (durability = 'on'): "
                "a shard recovers from its checkpoint and rank 0's log of the calls after it"
            )
        if self.state_dir and self.checkpoint_keep < 2:
            raise ValueError(
                "a sharded server keeps at least 2 checkpoints (checkpoint_keep >= 2): a shard "
                "may have finished a checkpoint the others did not, and recovery then starts "
                "from the one before, which every shard has"
            )
        if self.shard_address is not None and self.shard_address.count(":") < 1:
            raise ValueError(f"shard_address must be host:port, got {self.shard_address!r}")
        waits = (self.shard_slice_wait_seconds, self.shard_heartbeat_seconds)
        if min(waits + (self.shard_order_wait_seconds,)) <= 0:
            raise ValueError("the shard_*_seconds settings must be > 0")
        if self.shard_timeout_seconds <= max(waits) + 1:
            raise ValueError(
                f"shard_timeout_seconds ({self.shard_timeout_seconds:g}) must exceed "
                "shard_slice_wait_seconds and shard_heartbeat_seconds by more than a second"
            )
