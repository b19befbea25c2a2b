"""Model and text loading: checkpoints, tokenizers, texts and token windows.

Calibration, comparison, the command line and the benchmarks read a model
directory and a text file through these functions, so each input is checked
in one place and fails with one line naming it. A text's last
`HELDOUT_FRACTION` of tokens is held out for evaluation (`split_heldout`).
torch loads only inside the functions that use it, so the command line can
check its paths here before paying for it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Calibration windows come from the first part of a text, evaluation windows
# from this last fraction of its tokens, so the two never overlap.
HELDOUT_FRACTION = 0.1


def check_model_dir(path: str | os.PathLike, name: str = "model directory") -> str:
    """`path` if it is a transformers model directory (one with a config.json);
    otherwise a ValueError that calls it `name`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{name} {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{name} {path!r} has no config.json (not a transformers model directory)")
    return path


def read_text(path: str | os.PathLike) -> str:
    """A text file's content, with one-line errors for missing, unreadable or empty files."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"text file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"text file {path!r} is a directory") from None
    except UnicodeDecodeError:
        raise ValueError(f"text file {path!r} is not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"text file {path!r} cannot be read: {e.strerror}") from None
    if not text.strip():
        raise ValueError(f"text file {path!r} is empty")
    return text


def load_model(model, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """(model, tokenizer) from a model directory, or (model, None) for a
    model object. Loads in bf16, on the GPU when there is one."""
    if not isinstance(model, (str, os.PathLike)):
        return model, None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = check_model_dir(model)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16, attn_implementation="sdpa")
    except Exception as e:  # transformers raises many kinds for an unreadable checkpoint
        raise ValueError(f"model directory {path!r} cannot be loaded: {str(e).splitlines()[0]}") from None
    return loaded.to(device).eval(), tokenizer


def model_tokenizer(model, tokenizer):
    """`tokenizer`, or the one saved beside the local checkpoint `model` was loaded from."""
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if not name or not os.path.isdir(name):
        raise ValueError("tokenizer: pass tokenizer= (the model object does not name a local checkpoint)")
    return AutoTokenizer.from_pretrained(name)


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The 1-D token ids of `text`, without special tokens."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() == 0:
        raise ValueError("text: tokenizes to no tokens")
    return ids


def split_heldout(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration part, held-out part) of a 1-D token sequence."""
    n = ids.numel()
    if n < 4:
        raise ValueError(f"text: needs at least 4 tokens to split off a held-out part, got {n}")
    heldout = max(2, round(n * HELDOUT_FRACTION))
    return ids[: n - heldout], ids[n - heldout :]


def take_windows(ids: torch.Tensor, count: int, length: int, spread: bool) -> torch.Tensor:
    """Up to `count` non-overlapping windows of `length` tokens, (N, L): spread
    evenly over `ids`, or consecutive from its start. A part shorter than one
    window gives one window of the whole part."""
    if count < 1 or length < 2:
        raise ValueError(f"windows must be >= 1 and window length >= 2, got {count} and {length}")
    import torch

    length = min(length, ids.numel())
    count = max(1, min(count, ids.numel() // length))
    if spread and count > 1:
        starts = torch.linspace(0, ids.numel() - length, count).round().long().tolist()
    else:
        starts = [i * length for i in range(count)]
    return torch.stack([ids[s : s + length] for s in starts])
