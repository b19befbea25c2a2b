"""The quantization passes with the Hadamard rotation (kernels/hadamard.py)
compile for sm_90 and sm_100, without spills.

The rotation's numbers are checked under the interpreter elsewhere
(test_kernels_quantize.py, test_kernels_sm100.py, test_kernels_decode.py);
this checks that Triton's real compiler takes the butterfly's reshapes,
transposes, splits, joins and pair sums at every supported head_dim, keeps
it in registers and shared memory, and up to D 128 out of shared memory. Runs in a subprocess (tests/offline_compile.py).

Run as a script (`python tests/test_kernels_hadamard.py`) it prints each
pass's registers, stack and shared-memory instructions with and without
rotation.
"""

from offline_compile import compile_in_subprocess, resources, script_main

HEAD_DIMS = (64, 128, 256)
# Head dims whose rotating token pass holds each token's MX blocks in one thread.
IN_THREAD_DIMS = (64, 128)


def _token_pass(d: int, rotate: bool, capability: int, rotating_blocks: bool = False):
    """The token pass; rotating_blocks: unrotated, with the rotating pass's tokens per program."""
    import torch

    from dma_compile.kernels.hadamard import inverse_sqrt_constant
    from dma_compile.kernels.quantize import _quantize_tokens_kernel, _token_block
    from dma_compile.kernels.target_compile import compile_for_target

    x, f32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    u8, i32 = torch.empty(1, dtype=torch.uint8), torch.empty(1, dtype=torch.int32)
    args = dict(X=x, sx_b=4096 * d, sx_h=4096 * d, sx_l=d, sx_d=1, MEAN=f32, NONE_OUT=x, OUT1=u8, EXPS1=i32,
                SCALES1=f32, OUT2=u8, EXPS2=i32, SCALES2=f32, SIGNS=f32, H=32, L=16384, D=d, BLOCK_T=_token_block(d, rotate or rotating_blocks),
                SMOOTH=True, WRITE_NONE=False, FMT1=1, FMT2=3, FOLDED=True, RCEIL=True, POW2=True, HW_CVT=True,
                SIGNS_BH=0, ROTATE=rotate, PRESCALE=False, INV_SQRT_D=inverse_sqrt_constant(d))
    return compile_for_target(_quantize_tokens_kernel, args, capability, 4, 3)


def _payload_pass(d: int, rotate: bool, capability: int):
    import torch

    from dma_compile.kernels.hadamard import inverse_sqrt_constant
    from dma_compile.kernels.quantize_mx import _mx_payload_kernel
    from dma_compile.kernels.target_compile import compile_for_target

    x, f32, u8 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1), torch.empty(1, dtype=torch.uint8)
    args = dict(X=x, sx_b=4096 * d, sx_h=4096 * d, sx_l=d, sx_d=1, MEAN=f32, NONE_OUT=x, PAYLOAD1=u8, SCALES1=u8,
                PAYLOAD2=u8, SCALES2=u8, SIGNS=f32, H=32, L=16384, D=d, BLOCK_T=max(8, 2048 // d), SMOOTH=True,
                WRITE_NONE=True, FMT1=1, FMT2=3, RCEIL=True, HW_CVT=True, SIGNS_BH=0, ROTATE=rotate, PRESCALE=False,
                INV_SQRT_D=inverse_sqrt_constant(d))
    return compile_for_target(_mx_payload_kernel, args, capability, 4, 3)


def compile_all() -> dict:
    import triton

    result = {"triton": triton.__version__, "configs": {}}
    for name, build, capability in (("token_pass_sm90", _token_pass, 90), ("payload_pass_sm100", _payload_pass, 100)):
        for d in HEAD_DIMS:
            for rotate in (False, True):
                kernel = build(d, rotate, capability)
                result["configs"][f"{name}_d{d}{'_rotate' if rotate else ''}"] = resources(kernel.asm["cubin"])
    for d in IN_THREAD_DIMS:
        kernel = _token_pass(d, False, 90, rotating_blocks=True)
        result["configs"][f"token_pass_sm90_d{d}_rotating_blocks"] = resources(kernel.asm["cubin"])
    return result


def test_rotating_passes_compile_without_spills():
    configs = compile_in_subprocess(__file__)["configs"]
    assert len(configs) == 2 * 2 * len(HEAD_DIMS) + len(IN_THREAD_DIMS)
    for name, info in configs.items():
        if info:  # empty where the wheel ships no cuobjdump
            assert info["local_loads"] == 0 and info["local_stores"] == 0, (name, info)
    # Up to D 128 the rotating token pass keeps each token's blocks in one
    # thread (hadamard.py, quantize._token_block): the butterfly converts no
    # layout, so it adds no shared-memory instruction to the same pass unrotated.
    for d in IN_THREAD_DIMS:
        plain, rotated = configs[f"token_pass_sm90_d{d}_rotating_blocks"], configs[f"token_pass_sm90_d{d}_rotate"]
        if rotated:
            assert rotated["shared_ops"] <= plain["shared_ops"], (d, plain, rotated)


def _print_table(result: dict) -> None:
    from tabulate import tabulate

    rows = [[name, info.get("reg", "?"), info.get("stack", "?"), info.get("shared_ops", "?")]
            for name, info in result["configs"].items()]
    print(f"Triton {result['triton']}: the quantization passes, compiled")
    print(tabulate(rows, headers=["pass", "registers", "stack bytes", "shared-memory instructions"]))


if __name__ == "__main__":
    script_main(compile_all, _print_table)
