"""Kernels that have not yet run on a GPU at least compile for one: Triton compiles for an sm_90 target without a GPU
(``triton.compile`` with a ``GPUTarget``, the wheel's own ptxas), which catches what the interpreter accepts and the
GPU compiler rejects. Not a substitute for the GPU tests (no value is computed here). Runs in a subprocess without
TRITON_INTERPRET, which the other tests set (as tests/test_sass_stats.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# fused_ops._imposed_weights_kernel (the fused op "imposed", compiled here before it first ran on a GPU): every (NORM, CHAINED) form at OLMoE's top-8 of
# 64, Qwen1.5-MoE's top-4 of 60 (padded to 64) and a tiny top-2 of 7 (padded to 8); prints the cubin sizes as JSON
SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from runmap.kernels import fused_ops

sig = {"logits_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32", "E": "i32", "TOPK": "constexpr",
       "NORM": "constexpr", "E_P2": "constexpr", "CHAINED": "constexpr"}
sizes = {}
for topk, e_p2 in ((8, 64), (4, 64), (2, 8)):
    for norm in (False, True):
        for chained in (False, True):
            src = ASTSource(fn=fused_ops._imposed_weights_kernel, signature=sig,
                            constexprs={"TOPK": topk, "NORM": norm, "E_P2": e_p2, "CHAINED": chained})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
            sizes[f"{topk}/{e_p2}/{norm}/{chained}"] = len(k.asm["cubin"])
print(json.dumps(sizes))
"""


def compiled_sizes(script: str) -> dict:
    """Run a compile script in a subprocess without TRITON_INTERPRET; its last stdout line: {name: cubin bytes}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_imposed_weights_kernel_compiles_for_sm90():
    sizes = compiled_sizes(SCRIPT)
    assert len(sizes) == 12 and all(n > 1000 for n in sizes.values()), sizes
    # the top-k sum (NORM False) is code the NORM True form leaves out
    assert all(sizes[f"{t}/{p}/False/{c}"] > sizes[f"{t}/{p}/True/{c}"]
               for t, p in ((8, 64), (4, 64), (2, 8)) for c in (False, True)), sizes


# the shared-expert kernels of the fused op "shared" (2026-12-07): the riding forms of the grouped launches (SHARED, at
# Qwen1.5-MoE's shapes, chained), the k-slot sum with the shared term, the one-row down kernel on the shared helper
# (core.gated_shared_down), the one-row GEMV on the helper it shares with the riding GEMV (core.gemv_row_sums) and the
# two launches of several rows; prints {name: cubin bytes} as JSON
SHARED_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from runmap.kernels import fused_ops, grouped

def build(fn, sig, ce, warps=4):
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in ce}), constexprs=ce)
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"])

gu_sig = {"x_ptr": "*fp16", "ids_ptr": "*i64", "order_ptr": "*i64", "row_table_ptr": "*i32", "w_ptr": "*u8",
          "s_ptr": "*fp16", "h_ptr": "*fp16", "P": "i32", "n_experts": "i32", "n_rows": "i32", "row_bytes": "i32",
          "host_off": "i32", "n_host_rows": "i32", "stride_xm": "i32", "gate_w": "i32", "gate_s": "i32", "up_w": "i32",
          "up_s": "i32", "sx_ptr": "*fp16", "sw_ptr": "*fp16", "sgu_ptr": "*fp16", "S_N": "i32"}
dn_sig = {"h_ptr": "*fp16", "ids_ptr": "*i64", "order_ptr": "*i64", "wts_ptr": "*fp32", "row_table_ptr": "*i32",
          "w_ptr": "*u8", "s_ptr": "*fp16", "ypair_ptr": "*fp32", "P": "i32", "n_experts": "i32", "n_rows": "i32",
          "row_bytes": "i32", "host_off": "i32", "n_host_rows": "i32", "down_w": "i32", "down_s": "i32",
          "sgu_ptr": "*fp16", "sd_ptr": "*fp16", "gs_ptr": "*fp32"}
sizes = {}
for shared in (False, True):
    sizes[f"gate_up/{shared}"] = build(grouped._grouped_gate_up_kernel, gu_sig, {
        "N": 1408, "K": 2048, "NB": 8, "QBLOCK": 256, "TOPK": 4, "SORTED": False, "P_PAD": 4, "BLOCK_M": 16,
        "BLOCK_N": 32, "BLOCK_K": 256, "TILE_SCALE": True, "DEQ_ASM": True, "CHAINED": True, "SCALE_COLS": 0,
        "SHARED": shared, "S_BLOCK_N": grouped.SHARED_GEMV_BLOCK_N, "S_BLOCK_K": grouped.SHARED_BLOCK_K})
    sizes[f"down/{shared}"] = build(grouped._grouped_down_kernel, dn_sig, {
        "N": 2048, "K": 1408, "NB": 6, "QBLOCK": 256, "SORTED": False, "P_PAD": 4, "BLOCK_M": 16, "BLOCK_N": 32,
        "BLOCK_K": 256, "TILE_SCALE": True, "DEQ_ASM": True, "CHAINED": True, "PF_LINES": 256, "SCALE_COLS": 0,
        "SHARED": shared, "S_I": 5632, "S_BLOCK_N": grouped.SHARED_DOWN_BLOCK_N,
        "S_BLOCK_K": grouped.SHARED_DOWN_BLOCK_K})
    sizes[f"sum/{shared}"] = build(grouped._sum_topk_kernel, {"ypair_ptr": "*fp32", "y_ptr": "*fp16", "gs_ptr": "*fp32",
                                   "H": "i32"}, {"TOPK": 4, "BLOCK_N": 256, "CHAINED": True, "SHARED": shared})
sizes["one_row_down"] = build(fused_ops._shared_down_kernel, {"gu_ptr": "*fp16", "w_ptr": "*fp16", "y_ptr": "*fp16",
                              "out_ptr": "*fp16", "N": "i32"}, {"I": 5632, "BLOCK_N": 4, "BLOCK_K": 512, "CHAINED": True})
sizes["gemv"] = build(fused_ops._gemv_kernel, {"x_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "y_ptr": "*fp16",
                     "N": "i32"}, {"K": 2048, "HAS_BIAS": True, "BLOCK_N": 16, "BLOCK_K": 512, "CHAINED": True})
sizes["silu_mul_rows"] = build(fused_ops._silu_mul_rows_kernel, {"gu_ptr": "*fp16", "a_ptr": "*fp16", "stride_gm": "i32",
                               "I": "i32"}, {"BLOCK": 1024})
sizes["shared_gate_add"] = build(fused_ops._shared_gate_add_kernel, {"h_ptr": "*fp16", "wg_ptr": "*fp16",
                                 "s_ptr": "*fp16", "y_ptr": "*fp16", "out_ptr": "*fp16", "stride_hm": "i32"},
                                 {"H": 2048, "BLOCK_N": 1024, "BLOCK_K": 1024})
print(json.dumps(sizes))
"""


def test_the_shared_expert_kernels_compile_for_sm90():
    sizes = compiled_sizes(SHARED_SCRIPT)
    assert len(sizes) == 10 and all(n > 1000 for n in sizes.values()), sizes
    # the riding forms carry the shared expert's programs: more code than the plain forms
    assert all(sizes[f"{k}/True"] > sizes[f"{k}/False"] for k in ("gate_up", "down", "sum")), sizes
