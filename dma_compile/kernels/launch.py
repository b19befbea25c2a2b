"""How the Triton kernels are launched on the host: the autotuning switch,
integer helpers, and a replay path for repeated calls.

Triton's `kernel[grid](**args)` binds and specialises every argument on every
launch (its cost grows with the kernel's argument count), and an eager DMA
call makes three to five launches. `Recording` watches the launches of one call
made through `launch`; when every tensor they read or write is one of the
call's inputs, its output, or a buffer the call allocated and filled by those
same launches, `Recording.replay` turns them into a `Replay`: one workspace
allocation for all the buffers (zeroed where the call allocated them with
`zeros`), and each launch straight through the launcher of the kernel
Triton compiled for the first call (whose specialisation the caller's
signature key fixes), with pointers as integers: no argument binding, and
none of the per-launch device lookup and hook metadata of
`CompiledKernel[grid](*args)`, whose path a replay takes while a launch hook
(a profiler's) is set. Under Triton's interpreter nothing is compiled, so
nothing is replayed.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

# Opt-in: autotuning compiles and times every candidate configuration at each
# new shape bucket (seconds); without it each kernel takes its rule's config.
AUTOTUNE = os.environ.get("DMA_COMPILE_AUTOTUNE", "0") == "1"
# Workspace buffers start at multiples of this (Triton specialises pointers on 16).
_ALIGN = 256


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers (triton.cdiv is a constexpr function, slow to call from host code)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class _Pointer:
    """A device address where a tensor descriptor wants its base tensor (only `data_ptr` is read)."""

    __slots__ = ("address",)

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


@dataclass
class _Launch:
    fn: object
    grid: tuple
    args: dict
    compiled: object


class Recording:
    """The launches made through `launch` while this recording is active (one thread)."""

    def __init__(self):
        self.launches: list[_Launch] = []
        self.replayable = True
        self.zeroed: list[int] = []  # storage addresses of the buffers `zeros` allocated

    def forbid_replay(self) -> None:
        """The call did work outside the recorded launches (e.g. a torch copy): never replay it."""
        self.replayable = False

    def replay(self, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> "Replay | None":
        """The recorded call as a `Replay` on new tensors shaped like `inputs`, or None
        where it cannot be replayed."""
        if not self.replayable or not self.launches or any(r.compiled is None for r in self.launches):
            return None
        storages = [x.untyped_storage().data_ptr() for x in inputs]
        if len(set(storages)) != len(storages):
            return None  # aliased inputs: an address could not be told apart
        out_storage = out.untyped_storage().data_ptr()
        buffers: dict[int, int] = {}  # storage address -> offset in the workspace
        size = 0
        # The zeroed buffers first, so that one fill at the workspace's start zeroes them all.
        for rec in self.launches:
            for value in rec.args.values():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self.zeroed:
                    base = value.untyped_storage().data_ptr()
                    if base not in buffers:
                        buffers[base] = size
                        size += cdiv(value.untyped_storage().nbytes(), _ALIGN) * _ALIGN
        zeroed_bytes = size
        launches = []
        for rec in self.launches:
            names = rec.fn.arg_names
            if any(n not in rec.args for n in names):
                return None
            values = [rec.args[n] for n in names]
            slots = []
            for i, value in enumerate(values):
                desc = None
                if _is_descriptor(value):
                    desc, value = _descriptor_at(value, None), value.base
                if not isinstance(value, torch.Tensor):
                    continue
                storage = value.untyped_storage()
                base = storage.data_ptr()
                inner = value.data_ptr() - base
                if base in storages:
                    j = storages.index(base)
                    slots.append((i, j, value.data_ptr() - inputs[j].data_ptr(), desc))
                elif base == out_storage:
                    slots.append((i, len(inputs) + 1, value.data_ptr() - out.data_ptr(), desc))
                else:
                    if base not in buffers:
                        buffers[base] = size
                        size += cdiv(storage.nbytes(), _ALIGN) * _ALIGN
                    slots.append((i, len(inputs), buffers[base] + inner, desc))
                values[i] = None  # filled per call; the template must not keep this call's tensors alive
            # CompiledKernel[grid] reads three grid dimensions (JITFunction.run pads them).
            grid = tuple(rec.grid) + (1,) * (3 - len(rec.grid))
            launches.append((*_launchers(rec.compiled, grid), values, tuple(slots)))
        return Replay(tuple(launches), max(size, 1), zeroed_bytes, tuple(out.shape), out.stride(), out.dtype)


@dataclass(frozen=True)
class Replay:
    """The launches of one call signature, replayed on new tensors: what `Recording.replay` builds."""

    launches: tuple
    workspace_bytes: int
    zeroed_bytes: int
    out_shape: tuple
    out_stride: tuple
    out_dtype: torch.dtype

    def run(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        device = inputs[0].device
        out = torch.empty_strided(self.out_shape, self.out_stride, dtype=self.out_dtype, device=device)
        workspace = _workspace(self.workspace_bytes, device)
        if self.zeroed_bytes:
            workspace[: self.zeroed_bytes].zero_()
        bases = [x.data_ptr() for x in inputs]
        bases.append(workspace.data_ptr())
        bases.append(out.data_ptr())
        # (No stream off CUDA, where only the tests' stand-in kernels replay.)
        stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None
        direct = not _launch_hooks()
        for launch_on, runner, template, slots in self.launches:
            args = template.copy()
            for i, source, offset, desc in slots:
                address = bases[source] + offset
                args[i] = address if desc is None else _descriptor_at(desc, address)
            if direct:
                launch_on(stream, *args)
            else:
                runner(*args, stream=stream)
        return out


def _launchers(compiled, grid: tuple) -> tuple:
    """Two ways to launch `compiled` over `grid`: `(stream, *args)` straight
    through its launcher, and CompiledKernel's own runner (`*args, stream=`),
    which also looks up the device and builds the metadata that launch hooks
    (profilers such as proton) read; `Replay.run` takes it while hooks are set.
    The attributes read here are named alike in Triton 3.6 to 3.9; where they
    are missing, both ways are the runner."""
    runner = compiled[grid]  # also loads the kernel's module
    try:
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return (lambda stream, *args: runner(*args, stream=stream)), runner
    gx, gy, gz = grid

    def launch_on(stream, *args):
        run(gx, gy, gz, stream, function, metadata, None, None, None, *args)

    return launch_on, runner


def _launch_hooks() -> bool:
    """Whether a Triton launch hook is set (then launches go through its runner).
    Triton 3.6 to 3.9 keep each hook as a chain of calls, empty by default."""
    from triton import knobs

    runtime = knobs.runtime
    return any(hook is not None and bool(getattr(hook, "calls", True))
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


_active = threading.local()


class recording:
    """`with recording() as rec:` records the launches of this thread made through `launch`."""

    def __enter__(self) -> Recording:
        self.rec = Recording()
        self.outer = getattr(_active, "rec", None)
        _active.rec = self.rec
        return self.rec

    def __exit__(self, *exc) -> None:
        _active.rec = self.outer


def forbid_replay() -> None:
    """Mark the active recording, if any, as not replayable (see `Recording.forbid_replay`)."""
    rec = getattr(_active, "rec", None)
    if rec is not None:
        rec.forbid_replay()


def zeros(numel: int, device: torch.device) -> torch.Tensor:
    """An int32 buffer of zeros for counters that a launch increments; a
    replay of the call zeroes it again (torch's fill is cheaper on the host
    than a launch of ours)."""
    buffer = torch.zeros(numel, dtype=torch.int32, device=device)
    rec = getattr(_active, "rec", None)
    if rec is not None:
        rec.zeroed.append(buffer.untyped_storage().data_ptr())
    return buffer


_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
# Compile options of every launch and offline compile. FP fusion (a * b + c
# as one FMA) was on by default through Triton 3.9, which the kernels are
# tested with; 3.10 turns it off by default (3.9 warns about it), so ask.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """fn[grid](*args, **kwargs, **LAUNCH_OPTIONS), recorded where a recording is active."""
    compiled = fn[grid](*args, **kwargs, **LAUNCH_OPTIONS)
    rec = getattr(_active, "rec", None)
    if rec is not None:
        if not isinstance(grid, tuple) or not hasattr(compiled, "__getitem__"):
            rec.forbid_replay()  # the interpreter, or an autotuner's grid function
            return
        named = dict(zip(fn.arg_names, args))
        named.update((k, v) for k, v in kwargs.items() if k not in _OPTIONS)
        rec.launches.append(_Launch(fn, grid, named, compiled))


def _is_descriptor(value) -> bool:
    from triton.tools.tensor_descriptor import TensorDescriptor

    return isinstance(value, TensorDescriptor)


def _descriptor_at(template, address: int | None):
    """A copy of tensor descriptor `template` over the tensor at `address`
    (None: no tensor yet), with the fields as this Triton version has them;
    the constructor's checks passed on the recorded descriptor."""
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = None if address is None else _Pointer(address)
    return desc
