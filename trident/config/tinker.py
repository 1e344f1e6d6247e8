"""The ``tinker:`` section: how ``trident tinker serve`` listens, whom it admits, where it keeps
its journal and snapshots, and which local checkpoints it serves under which model names."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TinkerConfig(BaseModel):
    """The Tinker-API training service (`trident tinker serve`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = Field(
        default="127.0.0.1",
        description="Address the service listens on; 0.0.0.0 exposes it beyond this machine.",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Port of the service.")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Accepted `X-API-Key` values; empty admits any key starting with `tml-` "
        "(the SDK refuses to start without one).",
    )
    state_dir: str = Field(
        default="runs/tinker",
        description="Journal, snapshots and saved weights; a restart on the same directory "
        "resumes from them.",
    )
    models: dict[str, str] = Field(
        default_factory=dict,
        description="Served model names to local checkpoint directories, e.g. "
        "`{Qwen/Qwen3.5-9B-Base: runs/demo-base}`: a `create_model`'s `base_model` is looked up "
        "here, so recipes that insist on a hub name train a local model.",
    )
    lora_alpha: float = Field(
        default=32.0,
        gt=0,
        description="LoRA alpha of new adapters: the Tinker API sends only the rank (32 is "
        "SkyRL's reading of Tinker's default).",
    )
    snapshot_every: int = Field(
        default=1,
        ge=1,
        description="Snapshot a model every this many `optim_step`s; a restart replays the "
        "journal since the newest snapshot (bitwise only under `run.deterministic`).",
    )
