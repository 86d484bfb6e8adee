"""Server configuration: a dataclass with working defaults, loaded from TOML and overridden from
the command line. Unknown keys are an error, so a typo never silently falls back to a default."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aggsrv.config_file import TomlConfig
from aggsrv.strategies import StrategyConfig, strategy_class

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
    max_clients: int = 1024
    max_concurrent_uploads: int = 4
    chunk_bytes: int = MIB
    max_receive_message_bytes: int = 4 * MIB
    # HTTP/2 flow-control window per stream: what gRPC may buffer for an upload that waits for a
    # staging slot (memory <= waiting uploads x this); smaller windows slow single uploads.
    stream_window_bytes: int = 256 * 1024
    lease_seconds: float = 60.0
    retained_versions: int = 8
    # A waiting job stream sends a "pending" message at least this often (keeps proxies happy).
    pending_interval_seconds: float = 30.0
    # Append the strategy's events (FedDGIC's groupings and dropout flags) as JSON lines here.
    events_file: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        for name in ("max_clients", "max_concurrent_uploads", "retained_versions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
        # A bad strategy name or [strategy_config] key fails at startup, not at the first
        # registration (where it would reach a client as an opaque error).
        self.strategy_settings()

    def strategy_settings(self) -> StrategyConfig:
        """The strategy's config object, checked by its class; ValueError naming what is wrong."""
        try:
            cls = strategy_class(self.strategy)
        except NotImplementedError as exc:
            raise ValueError(str(exc)) from None
        try:
            return cls.config_class.from_dict(self.strategy_config)
        except TypeError as exc:  # e.g. a table where a number belongs
            raise ValueError(f"[strategy_config] for {cls.name}: {exc}") from None
