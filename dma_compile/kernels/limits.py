"""What each attention kernel serves: the one table of the kernels' own limits.

The op's router (`dma_compile.ops`) reads it to pass over a kernel that
cannot serve a call without importing the kernel, and each kernel checks its
entry itself, so a direct call is refused with the same `Unsupported`
message. Limits that depend on the device (CUDA tensors, the interpreter,
fp8 tensor cores) stay with the kernels. Needs no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dma_compile.kernels import Unsupported


@dataclass(frozen=True)
class KernelLimits:
    """The input dtypes and head_dims a kernel takes, and whether it needs a
    positive softmax scale or V's head_dim equal to Q's."""

    label: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    positive_scale: bool = False
    equal_head_dims: bool = False

    def refusal(self, q: torch.Tensor, v: torch.Tensor, scale: float | None) -> str | None:
        """Why the kernel does not serve these inputs, None when it does
        (scale: the softmax scale, None for 1/sqrt(head_dim), which is positive)."""
        if q.dtype not in self.dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"q: {self.label} takes {names} inputs, got {q.dtype}"
        for name, dim in (("q, k", q.shape[-1]), ("v", v.shape[-1])):
            if dim not in self.head_dims:
                return f"{name}: {self.label} supports head_dim in {list(self.head_dims)}, got {dim}"
        if self.equal_head_dims and v.shape[-1] != q.shape[-1]:
            return f"v: {self.label} needs v's head_dim equal to q's ({q.shape[-1]}), got {v.shape[-1]}"
        if self.positive_scale and scale is not None and scale <= 0:
            return f"scale: {self.label} needs a positive softmax scale, got {scale}"
        return None

    def check(self, q: torch.Tensor, v: torch.Tensor, scale: float | None) -> None:
        """Raise Unsupported with the `refusal`, if any."""
        reason = self.refusal(q, v, scale)
        if reason is not None:
            raise Unsupported(reason)


_HALF = (torch.bfloat16, torch.float16)
# impl name (dma_compile.ops.KERNELS) -> limits.
LIMITS = {
    "sm90_gluon": KernelLimits("the Gluon sm90 kernel", _HALF, (64, 128), positive_scale=True, equal_head_dims=True),
    "sm90": KernelLimits("the sm90 kernel", _HALF, (32, 64, 128, 256), positive_scale=True),
    "sm100": KernelLimits("the sm100 kernel", _HALF + (torch.float32,), (16, 32, 64, 128, 256)),
}
# Above it no kernel serves a call: the compile pass and the transformers
# integration keep stock SDPA there.
MAX_HEAD_DIM = max(max(limits.head_dims) for limits in LIMITS.values())
