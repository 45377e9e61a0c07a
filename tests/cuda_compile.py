"""Compile every Triton kernel of the CUDA runner for a Hopper GPU (sm_90) without a GPU: Triton's own compiler
and the ``ptxas`` its wheel carries, down to a cubin, for the dtypes, head sizes and flags the runner launches
them with. Run by tests/test_cuda_kernels.py in a process of its own (the tests' process runs the kernels
under Triton's interpreter, whose decorated kernels cannot be compiled). Prints one line per kernel; exits 1
when one fails.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: compiled kernels, not interpreted ones

from kvbaton.backend.compute.cuda import kernels
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def _sig(pointers: dict[str, str], scalars: dict[str, str], constexprs: dict[str, object]) -> tuple[dict, dict]:
    signature = {**pointers, **scalars, **{k: "constexpr" for k in constexprs}}
    return signature, constexprs


def cases():
    for dt in ("fp32", "bf16"):
        exact = dt == "fp32"
        for heads, kv_heads, d in ((9, 3, 64), (32, 8, 64), (32, 8, 128)):
            group = heads // kv_heads
            hidden = heads * d
            ptr = f"*{dt}"
            yield f"add_rms_norm {dt} hidden {hidden}", kernels._add_rms_norm_kernel, *_sig(
                {"x": ptr, "residual": ptr, "weight": ptr, "out_residual": ptr, "out_normed": ptr},
                {"eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_or": "i32", "stride_on": "i32"},
                {"N": hidden, "BLOCK": kernels._pow2(hidden, 16), "HAS_RESIDUAL": True}), 8
            for k_out in (False, True):
                yield f"rope_store {dt} {heads}/{kv_heads}x{d}{' k_out' if k_out else ''}", kernels._rope_store_kernel, *_sig(
                    {"qkv": ptr, "cos": ptr, "sin": ptr, "positions": "*i32", "slots": "*i32", "q_out": ptr,
                     "k_cache": ptr, "v_cache": ptr, "k_out": ptr},
                    {"stride_t": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ch": "i64", "stride_cs": "i32",
                     "stride_cos": "i32", "stride_kt": "i32", "stride_kh": "i32"},
                    {"HEADS": heads, "KV_HEADS": kv_heads, "HALF": d // 2,
                     "BLOCK_HEADS": kernels._pow2(heads + kv_heads, 1), "BLOCK_KV": kernels._pow2(kv_heads, 1),
                     "BLOCK_HALF": kernels._pow2(d // 2, 1), "K_OUT": k_out}), 4
            for splits in (1, 16):
                yield f"decode {dt} {heads}/{kv_heads}x{d} splits {splits}", kernels._decode_partial_kernel, *_sig(
                    {"q": ptr, "k_cache": ptr, "v_cache": ptr, "block_tables": "*i32", "context_lens": "*i32",
                     "mid_o": "*fp32", "mid_lse": "*fp32"},
                    {"scale": "fp32", "page_size": "i32", "stride_qb": "i32", "stride_qh": "i32", "stride_ch": "i64",
                     "stride_cs": "i32", "stride_bt": "i32", "stride_ob": "i32", "stride_oh": "i32", "stride_os": "i32",
                     "stride_lb": "i32", "stride_lh": "i32"},
                    {"GROUP": group, "BLOCK_H": kernels._pow2(group, 16), "HEAD_DIM": d, "BLOCK_D": kernels._pow2(d, 16),
                     "BLOCK_N": 64, "SPLITS": splits, "EXACT": exact}), 4
                yield f"decode merge {dt} splits {splits}", kernels._decode_merge_kernel, *_sig(
                    {"mid_o": "*fp32", "mid_lse": "*fp32", "out": ptr},
                    {"stride_ob": "i32", "stride_oh": "i32", "stride_os": "i32", "stride_lb": "i32", "stride_lh": "i32",
                     "stride_xb": "i32", "stride_xh": "i32"},
                    {"HEAD_DIM": d, "BLOCK_D": kernels._pow2(d, 16), "SPLITS": splits,
                     "BLOCK_S": kernels._pow2(splits, 2)}), 4
            block_m, block_n = (32, 32) if exact or d > 64 else (64, 64)
            yield f"prefill {dt} {heads}/{kv_heads}x{d}", kernels._prefill_kernel, *_sig(
                {"q": ptr, "k_cache": ptr, "v_cache": ptr, "out": ptr, "block_tables": "*i32", "cu_q": "*i32",
                 "positions": "*i32"},
                {"scale": "fp32", "page_size": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32",
                 "stride_oh": "i32", "stride_ch": "i64", "stride_cs": "i32", "stride_bt": "i32"},
                {"GROUP": group, "HEAD_DIM": d, "BLOCK_D": kernels._pow2(d, 16), "BLOCK_M": block_m,
                 "BLOCK_N": block_n, "EXACT": exact}), 4


def main() -> int:
    failed = 0
    for name, fn, signature, constexprs, warps in cases():
        try:
            compiled = triton_compile(ASTSource(fn, signature, constexprs), target=HOPPER, options={"num_warps": warps})
            print(f"ok   {name}: {len(compiled.asm['cubin'])} bytes of sm_90 code")
        except Exception:  # noqa: BLE001 - every kernel is tried, every failure printed
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc(limit=6)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
