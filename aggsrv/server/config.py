"""Server configuration: a dataclass with working defaults, loaded from TOML and overridden from
the command line. Unknown keys are an error, so a typo never silently falls back to a default."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aggsrv.config_check import Count
from aggsrv.config_file import TomlConfig
from aggsrv.strategies import StrategyConfig, strategy_settings

MIB = 1 << 20


@dataclass
class ServerConfig(TomlConfig):
    """Everything `aggsrv serve` needs; every key may appear in the TOML file."""

    KIND = "server"  # in error messages (not a field: no annotation)

    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port (tests)
    strategy: str = "fedasync"
    # The strategy's own keys ([strategy_config] table in TOML, e.g. alpha, max_staleness,
    # learning_rate), checked by the strategy's config class.
    strategy_config: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"  # auto | cpu | cuda
    model_init: str | None = None  # a torch.save'd state dict; None: adopt the first client's
    max_clients: Count = 1024
    max_concurrent_uploads: Count = 4
    chunk_bytes: int = MIB
    # Quantized values a client may send in its updates (docs/compression.md): offered in every
    # job's recipe (not under differential privacy), with the block size suggested.
    update_quantizations: list[str] = field(default_factory=lambda: ["int8", "int4"])
    quantization_block: int = 128
    max_receive_message_bytes: int = 4 * MIB
    # HTTP/2 flow-control window per stream: what gRPC may buffer for an upload that waits for a
    # staging slot (memory <= waiting uploads x this); smaller windows slow single uploads.
    stream_window_bytes: int = 256 * 1024
    lease_seconds: float = 60.0
    retained_versions: Count = 8
    # A waiting job stream sends a "pending" message at least this often (keeps proxies happy).
    pending_interval_seconds: float = 30.0
    # Append the strategy's events (FedDGIC's groupings and dropout flags) as JSON lines here.
    events_file: str | None = None
    # Record one line per job and per update here (aggsrv.trace_format), for replay.
    trace: str | None = None
    trace_max_bytes: int = 64 * MIB  # then the file rotates to trace.1, trace.2, ...
    trace_backups: int = 8  # rotated files kept

    # --- security (docs/operations.md "Authentication and TLS")
    # hmac: tokens signed with the server secret (client id inside); tokens: a TOML tokens file;
    # none: no authentication (only behind something else that authenticates).
    auth: str = "hmac"
    # The HMAC secret (hex). None: STATE_DIR/auth/secret, generated on first start and reused.
    auth_secret_file: str | None = None
    tokens_file: str | None = None  # auth = "tokens"
    # TLS: certificate chain and key (PEM); with tls_client_ca clients must present a certificate
    # signed by that CA (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    # --- limits (each refusal is RESOURCE_EXHAUSTED, except the idle upload: DEADLINE_EXCEEDED)
    max_concurrent_rpcs: Count = 256  # calls being served at once, all clients together
    # HTTP/2 concurrent streams on one connection (many in-process clients share one).
    max_streams_per_connection: Count = 128
    # Token bucket per client over PushUpdate and Register (updates/s, burst); 0 turns it off.
    rate_limit_per_second: float = 20.0
    rate_limit_burst: int = 40
    # An upload holding a staging slot is cut (its slot freed) after this long without a message.
    upload_idle_timeout_seconds: float = 30.0
    # A registration offering a model larger than this is refused before anything is allocated.
    max_model_bytes: int = 16 << 30
    max_labels: Count = 32  # per client, each key and value <= 256 bytes

    # --- durability (docs/operations.md "Durability")
    # Checkpoints and the write-ahead log live here; None or "": nothing is written.
    state_dir: str | None = "aggsrv-state"
    # on: every accepted update is in the fsynced write-ahead log before it is acknowledged;
    # off: checkpoints only; auto: on with a state_dir, off without one (resolved at load).
    durability: str = "auto"
    resume: bool = False  # continue from state_dir's newest checkpoint and log
    checkpoint_every_updates: int = 1000  # 0: not by count
    checkpoint_every_seconds: float = 300.0  # 0: not by time
    # Also checkpoint once the log since the last checkpoint holds this many bytes (GetJob,
    # Register and update records alike), so no client can grow it (and recovery) without bound.
    # None: the larger of 4x the model's bytes and twice the newest checkpoint's, at least
    # 16 MiB; 0: not by size.
    checkpoint_every_bytes: int | None = None
    checkpoint_keep: Count = 2  # newest checkpoints kept, with the log segments after the oldest
    # An update is logged while it arrives, in records of this many decoded bytes, each sent on
    # to the disk at once: smaller parts leave less for the acknowledging fsync, cost a record
    # header (about 100 bytes) and a write each. 0: logged whole once applied.
    wal_part_bytes: int = MIB

    # --- operations
    metrics_port: int | None = None  # Prometheus /metrics on metrics_host:metrics_port
    metrics_host: str = "127.0.0.1"
    # The read-only status page and its JSON (docs/operations.md "Status page"); no auth, so
    # loopback by default like the metrics.
    dashboard_port: int | None = None
    dashboard_host: str = "127.0.0.1"
    # Host names (no port) the page answers besides IP addresses and, on loopback, localhost,
    # e.g. the name a reverse proxy forwards; any other Host is refused (DNS rebinding).
    dashboard_allowed_hosts: list[str] = field(default_factory=list)
    # "module:function" called with the global model's state dict every eval_every_versions
    # versions, on its own thread; returns a mapping of metric name -> number (e.g. accuracy).
    eval: str | None = None
    eval_every_versions: Count = 50
    log_format: str = "text"  # text | json (one JSON object per line)
    log_level: str = "info"

    # --- sharding (docs/sharding.md): N processes that serve one federation, each a slice
    shards: Count = 1
    rank: int = 0
    # Rank 0's rendezvous for torch.distributed, tcp://HOST:PORT; None: torchrun's env://.
    dist_url: str | None = None
    # host:port clients reach this shard on (rank 0 hands the list out); None: host:port.
    shard_address: str | None = None
    # A collective between the shards that takes longer fails the federation (fail-stop).
    shard_timeout_seconds: float = 120.0
    # How long an update rank 0 ordered waits for another shard's slice before all refuse it.
    shard_slice_wait_seconds: float = 10.0
    # How long a slice on a shard of rank >= 1 waits for rank 0 to order its update.
    shard_order_wait_seconds: float = 60.0
    # Rank 0 sends a keep-alive this often when idle (a lost shard is noticed this fast).
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
