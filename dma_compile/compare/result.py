"""What a comparison measures with (`Settings`) and what it found (`Comparison`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

# (perplexity windows, tokens each, generation prompts, prompt tokens, new
# tokens). Greedy agreement swings from prompt to prompt, so it takes more
# prompts than perplexity takes windows to mean something.
CPU_SETTINGS = (4, 1024, 8, 512, 32)
GPU_SETTINGS = (8, 2048, 16, 1024, 64)


@dataclass
class Settings:
    """Sizes of a comparison: perplexity windows and generation prompts."""

    windows: int
    window_len: int
    prompts: int
    prompt_len: int
    new_tokens: int

    @classmethod
    def for_device(cls, device: torch.device, **overrides) -> "Settings":
        base = cls(*(GPU_SETTINGS if device.type == "cuda" else CPU_SETTINGS))
        for name, value in overrides.items():
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
                setattr(base, name, value)
        return base


@dataclass
class Comparison:
    """What `compare` measured; `tables` are tabulate strings by section."""

    policies: dict[str, dict] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    speed: dict[str, dict] | None = None
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tables: dict[str, str] = field(default_factory=dict)
    plot: str | None = None

    def to_dict(self) -> dict:
        return {
            "settings": self.settings,
            "policies": self.policies,
            "layers": self.layers,
            "speed": self.speed,
            "notes": self.notes,
            "plot": self.plot,
        }

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def report(self) -> str:
        parts = [self.tables[k] for k in ("layers", "model", "speed") if k in self.tables]
        return "\n\n".join(parts + self.notes)
