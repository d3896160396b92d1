"""What the operator chose at start-up: where to listen, who may call, and how much a request may take."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the operator opens it up on purpose
    port: int = 8000
    # Capture moves tensors out of the engine on behalf of one tenant; it is off unless asked for.
    enable_capture: bool = False
    # A request whose capture could exceed this (computed from its spec before it runs) is refused.
    max_capture_bytes: int = 256 << 20
    api_key: str | None = None  # None: no authentication (only sensible on loopback)
    served_model_name: str | None = None  # what /v1/models lists; default: the model as given
    # Activations up to this size travel inline as base64; larger ones become a download handle.
    inline_activation_bytes: int = 1 << 20
    activation_ttl_s: float = 600.0  # an undownloaded handle is dropped after this long
    max_body_bytes: int = 4 << 20  # request bodies beyond this are refused before parsing

    def __post_init__(self) -> None:
        for name in ("port", "max_capture_bytes", "inline_activation_bytes", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
        if self.activation_ttl_s <= 0:
            raise ValueError(f"activation_ttl_s: expected > 0 seconds, got {self.activation_ttl_s!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: empty; give a non-empty key or none")
