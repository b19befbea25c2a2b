"""Attention policies: which precision each tile of the score matrix runs in.

`AttentionPolicy` describes one attention layer: the precision tile, how many
sink and diagonal tiles run in the high format, the high and low formats, the
P·V precision and the MX details (with `rotate`, the Hadamard rotation of Q
and K before MX quantization, dma_compile.rotation), and how the KV cache
stores each token at decode time (`cache_k`, `cache_v`, `recent_tokens`).
Its compact string form is what travels as the custom op's argument, so
compiled-graph caches see it. `ModelPolicy` maps layer indices to policies
and is saved as JSON by calibration.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from dma_compile.formats import FORMATS, SCALE_RULES
from dma_compile.rotation import ROTATIONS

QK_FORMATS = ("none",) + FORMATS
PV_MODES = ("input", "fp8")
MX_MODES = ("exact", "folded")
TILES = (32, 64, 128, 256, 512, 1024)
# KV-cache storage formats (dma_compile.kv_cache): "none" keeps the input dtype.
CACHE_K_FORMATS = ("none", "mxfp8_e4m3", "mxfp4_e2m1")
CACHE_V_FORMATS = ("none", "mxfp8_e4m3")

# Short keys of the string form, in order.
_KEYS = {
    "tile": "tile",
    "sink_tiles": "sink",
    "diag_tiles": "diag",
    "hi": "hi",
    "lo": "lo",
    "pv": "pv",
    "mx_mode": "mx",
    "smooth_k": "smooth",
    "scale_rule": "scale",
    "min_q_len": "minq",
    "cache_k": "kcache",
    "cache_v": "vcache",
    "recent_tokens": "recent",
    "rotate": "rot",
    "balance_qk": "balance",
}
# Keys the string form leaves out at their default, so strings written before
# the field existed still parse to the same policy and name it the same way.
_OMITTED_AT_DEFAULT = {"rotate": "none", "balance_qk": False}
_FIELDS = {short: name for name, short in _KEYS.items()}


def _choice(name: str, value: Any, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"AttentionPolicy.{name} must be one of {list(accepted)}, got {value!r}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class AttentionPolicy:
    """Precision policy of one attention layer (see docs/semantics.md).

    hi: format of QK^T on the sink and diagonal tiles; lo: on the other tiles.
    Each is "none" (the input dtype), "mxfp8_e4m3", "mxfp8_e5m2" or
    "mxfp4_e2m1". pv: P·V in the input dtype ("input") or FP8 ("fp8").
    mx_mode: "exact" MX numerics or "folded" per-token FP8 scales. The defaults
    are the paper's configuration.

    cache_k / cache_v: how a KV cache stores the tokens outside its sinks
    (the first `sink_tiles * tile` tokens) and its recent window (the last
    `recent_tokens`), which stay in the input dtype: "none", "mxfp8_e4m3"
    (folded MXFP8: e4m3 elements and one power-of-two scale per token) or,
    for K only, "mxfp4_e2m1" (MX: e2m1 elements, one E8M0 scale per 32).

    rotate: "none", "hadamard" or "signed_hadamard" (dma_compile.rotation):
    Q and K (after smoothing) are rotated along the head dimension before
    every MX quantization, prefill and KV cache alike; tiles in "none" use
    them unrotated (the scores are the same). Needs a power-of-two head_dim.

    balance_qk: before MX quantization (and the rotation) the prefill
    multiplies Q's channel j by a power of two and divides K's by it, per
    batch and KV head, so that the two operands' channel ranges meet halfway
    (`dma_compile.balancing`); scores are unchanged in exact
    arithmetic. The KV cache's decode does not balance.
    """

    tile: int = 128
    sink_tiles: int = 1
    diag_tiles: int = 1
    hi: str = "mxfp8_e4m3"
    lo: str = "mxfp4_e2m1"
    pv: str = "input"
    mx_mode: str = "exact"
    smooth_k: bool = True
    scale_rule: str = "rceil"
    min_q_len: int = 16
    cache_k: str = "none"
    cache_v: str = "none"
    recent_tokens: int = 128
    rotate: str = "none"
    balance_qk: bool = False

    def __post_init__(self) -> None:
        _choice("tile", self.tile, TILES)
        _int_at_least("AttentionPolicy.sink_tiles", self.sink_tiles, 0)
        _int_at_least("AttentionPolicy.diag_tiles", self.diag_tiles, 1)
        _choice("hi", self.hi, QK_FORMATS)
        _choice("lo", self.lo, QK_FORMATS)
        _choice("pv", self.pv, PV_MODES)
        _choice("mx_mode", self.mx_mode, MX_MODES)
        _choice("smooth_k", self.smooth_k, (True, False))
        _choice("scale_rule", self.scale_rule, SCALE_RULES)
        _int_at_least("AttentionPolicy.min_q_len", self.min_q_len, 1)
        _choice("cache_k", self.cache_k, CACHE_K_FORMATS)
        _choice("cache_v", self.cache_v, CACHE_V_FORMATS)
        _int_at_least("AttentionPolicy.recent_tokens", self.recent_tokens, 0)
        _choice("rotate", self.rotate, ROTATIONS)
        _choice("balance_qk", self.balance_qk, (True, False))
        # The string form travels with every op call: build it once.
        parts = []
        for name, short in _KEYS.items():
            value = getattr(self, name)
            if name in _OMITTED_AT_DEFAULT and value == _OMITTED_AT_DEFAULT[name]:
                continue
            parts.append(f"{short}={int(value) if isinstance(value, bool) else value}")
        object.__setattr__(self, "_text", ",".join(parts))

    @property
    def formats(self) -> tuple[str, ...]:
        """The distinct QK^T formats this policy uses (hi first)."""
        return (self.hi,) if self.hi == self.lo else (self.hi, self.lo)

    @property
    def uses_mx(self) -> bool:
        return self.hi != "none" or self.lo != "none"

    @property
    def rotates_cache(self) -> bool:
        """Whether the KV cache stores K rotated (and rotates each query): only
        when it quantizes K."""
        return self.rotate != "none" and self.cache_k != "none"

    def replace(self, **changes: Any) -> "AttentionPolicy":
        return dataclasses.replace(self, **changes)

    def to_string(self) -> str:
        return self._text

    __str__ = to_string

    @classmethod
    def from_string(cls, text: str) -> "AttentionPolicy":
        """Parse the compact form; keys left out keep their defaults."""
        if not isinstance(text, str):
            raise ValueError(f"policy must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(
                f"policy string is empty: expected key=value items with keys in {list(_FIELDS)} "
                f"or a preset name in {list(PRESETS)}"
            )
        if text.strip() in PRESETS:
            return cls.preset(text.strip())
        values: dict[str, Any] = {}
        for item in (p.strip() for p in text.split(",")):
            key, sep, raw = item.partition("=")
            if not sep or key not in _FIELDS:
                raise ValueError(
                    f"policy string item {item!r} in {text!r}: expected key=value with key in "
                    f"{list(_FIELDS)} or a preset name in {list(PRESETS)}"
                )
            name = _FIELDS[key]
            if name in values:
                raise ValueError(f"policy string {text!r}: key {key!r} is given more than once")
            kind = type(getattr(cls, name))
            if kind is bool:
                if raw not in ("0", "1"):
                    raise ValueError(f"policy string item {item!r}: {key} must be 0 or 1")
                values[name] = raw == "1"
            elif kind is int:
                try:
                    values[name] = int(raw)
                except ValueError:
                    raise ValueError(f"policy string item {item!r}: {key} must be an integer") from None
            else:
                values[name] = raw
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionPolicy":
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"AttentionPolicy: unknown fields {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def paper(cls) -> "AttentionPolicy":
        """The paper's DMA: MXFP8 on sink and diagonal tiles, MXFP4 elsewhere."""
        return cls.preset("paper")

    @classmethod
    def hopper(cls) -> "AttentionPolicy":
        """DMA on Hopper's precision ladder: input dtype on sink and diagonal
        tiles, folded MXFP8 (per-token FP8 on fp8 tensor cores) elsewhere,
        P·V in FP8 (the preset "hopper_input_pv" keeps it in the input dtype)."""
        return cls.preset("hopper")

    @classmethod
    def preset(cls, name: str) -> "AttentionPolicy":
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {list(PRESETS)}, got {name!r}")
        return cls(**PRESETS[name])


# Hopper's precision ladder: input dtype on sink and diagonal tiles, folded MXFP8 elsewhere.
_HOPPER_TILES = {"hi": "none", "lo": "mxfp8_e4m3", "mx_mode": "folded"}
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    # FP8 P·V: the faster path of the Gluon kernel for a small accuracy cost
    # (BENCHMARKS.md, "FP8 P·V as Hopper's default").
    "hopper": {**_HOPPER_TILES, "pv": "fp8"},
    "hopper_input_pv": _HOPPER_TILES,
    "all_mxfp8": {"hi": "mxfp8_e4m3", "lo": "mxfp8_e4m3"},
    "all_mxfp4": {"hi": "mxfp4_e2m1", "lo": "mxfp4_e2m1"},
    # pv named although it is the default: calibration's last resort applies this over Hopper's FP8 P·V.
    "exact": {"hi": "none", "lo": "none", "smooth_k": False, "pv": "input"},
    # The MXFP4 presets with the rotation that measured best over both held-out
    # samples of BENCHMARKS.md; the others gain nothing measurable from it.
    "paper_rotated": {"rotate": "signed_hadamard"},
    "all_mxfp4_rotated": {"hi": "mxfp4_e2m1", "lo": "mxfp4_e2m1", "rotate": "signed_hadamard"},
    # The same with Q and K balanced per channel first: more accurate still
    # (BENCHMARKS.md, 2026-12-06), at the cost of reading Q and K once more.
    "paper_balanced": {"rotate": "signed_hadamard", "balance_qk": True},
    "all_mxfp4_balanced": {"hi": "mxfp4_e2m1", "lo": "mxfp4_e2m1", "rotate": "signed_hadamard", "balance_qk": True},
}
# The fixed presets every comparison reports beside a calibrated policy, and
# whose errors calibration records per layer, in the order they are reported.
REFERENCE_PRESETS = ("all_mxfp8", "all_mxfp4", "paper", "paper_rotated", "hopper")


def reference_policies() -> dict[str, AttentionPolicy]:
    """{name: policy} of the REFERENCE_PRESETS."""
    return {name: AttentionPolicy.preset(name) for name in REFERENCE_PRESETS}


def default_policy(device: torch.device | str | None = None) -> AttentionPolicy:
    """The default policy for a device: Hopper's on sm_90, the paper's elsewhere."""
    return _default_policy(torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=None)
def _default_policy(device: torch.device) -> AttentionPolicy:
    # Cached: the transformers integration asks for it on every attention call.
    if device.type == "cuda" and torch.cuda.is_available():
        if torch.cuda.get_device_capability(device) == (9, 0):
            return AttentionPolicy.hopper()
    return AttentionPolicy.paper()


def as_policy(policy: "AttentionPolicy | str | None", device: torch.device | str | None = None) -> AttentionPolicy:
    """Accept a policy, its string form, a preset name, or None (the device default)."""
    if policy is None:
        return default_policy(device)
    if isinstance(policy, AttentionPolicy):
        return policy
    if isinstance(policy, str):
        return AttentionPolicy.from_string(policy)
    raise ValueError(
        f"policy must be an AttentionPolicy, its string form, a preset name or None, "
        f"got {type(policy).__name__}"
    )


def _layer_index(key: Any) -> int:
    """A layer key of ModelPolicy.layers: an int >= 0, or its decimal string (JSON keys)."""
    if isinstance(key, str) and key.strip().isdecimal():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise ValueError(f"ModelPolicy.layers: key {key!r} is not a layer index (an integer >= 0)")
    return key


@dataclass
class ModelPolicy:
    """A default `AttentionPolicy` plus per-layer overrides, saved as JSON.

    `num_layers`, when known, is checked against the model a policy is applied
    to; `stats` holds whatever produced the choice (calibration statistics).
    """

    default: AttentionPolicy = field(default_factory=AttentionPolicy)
    layers: dict[int, AttentionPolicy] = field(default_factory=dict)
    num_layers: int | None = None
    stats: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.default = as_policy(self.default)
        if not isinstance(self.layers, dict):
            raise ValueError(
                "ModelPolicy.layers must map layer indices to policies (a JSON object), "
                f"got {type(self.layers).__name__}"
            )
        layers = {}
        for key, policy in self.layers.items():
            index = _layer_index(key)
            if index in layers:
                raise ValueError(f"ModelPolicy.layers: layer {index} is given more than once")
            if policy is None:
                raise ValueError(f"ModelPolicy.layers[{index}]: expected a policy, got None")
            try:
                layers[index] = as_policy(policy)
            except ValueError as e:
                raise ValueError(f"ModelPolicy.layers[{index}]: {e}") from None
        self.layers = layers
        if self.num_layers is not None:
            _int_at_least("ModelPolicy.num_layers", self.num_layers, 1)
            bad = [i for i in self.layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(
                    f"ModelPolicy.layers: layer indices {bad} outside 0..{self.num_layers - 1}"
                )

    def for_layer(self, index: int | None) -> AttentionPolicy:
        if index is None:
            return self.default
        return self.layers.get(int(index), self.default)

    def check_layers(self, num_layers: int) -> None:
        """Raise if this policy was made for a model with another layer count."""
        if self.num_layers is not None and self.num_layers != num_layers:
            raise ValueError(
                f"policy was calibrated for a model with {self.num_layers} attention layers, "
                f"this model has {num_layers}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "default": self.default.to_string(),
            "layers": {str(i): p.to_string() for i, p in sorted(self.layers.items())},
            "num_layers": self.num_layers,
            "stats": self.stats,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelPolicy":
        if not isinstance(data, dict) or "default" not in data:
            raise ValueError("ModelPolicy: expected a JSON object with a 'default' policy")
        return cls(
            default=AttentionPolicy.from_string(data["default"]),
            layers=data.get("layers", {}),
            num_layers=data.get("num_layers"),
            stats=data.get("stats"),
        )

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelPolicy":
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"policy file {os.fspath(path)!r} cannot be read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"policy file {os.fspath(path)!r} is not valid JSON: {e}") from None
        return cls.from_dict(data)


def as_model_policy(policy: "ModelPolicy | AttentionPolicy | str | os.PathLike | None") -> ModelPolicy | None:
    """Accept a ModelPolicy, an AttentionPolicy (used for every layer), a JSON
    path, a policy string or preset name, or None (the device default per call)."""
    if policy is None or isinstance(policy, ModelPolicy):
        return policy
    if isinstance(policy, AttentionPolicy):
        return ModelPolicy(default=policy)
    if isinstance(policy, (str, os.PathLike)):
        text = os.fspath(policy)
        if text.endswith(".json") or os.path.isfile(text):
            return ModelPolicy.load(text)
        return ModelPolicy(default=AttentionPolicy.from_string(text))
    raise ValueError(
        "policy must be a ModelPolicy, an AttentionPolicy, a policy JSON path, a policy string "
        f"or None, got {type(policy).__name__}"
    )
