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


# fused op "tails" (2026-12-07): the split attention launches that combine their own splits (with and without the
# prologue) and the norm's launch that routes its rows (the router's top-k, an imposed routing's weights), chained, at
# OLMoE's / Qwen1.5-MoE's attention (16 heads of 128) and routers (top-8 of 64, top-4 of 60); prints {name: cubin
# bytes} as JSON
TAILS_SCRIPT = r"""
import json
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from runmap.kernels import fused_ops

ptx = {}

def build(fn, sig, ce, warps=4):
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in ce}), constexprs=ce)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx[len(ptx)] = k.asm["ptx"]
    return len(k.asm["cubin"])

def ops(text):  # the count's acquire-release atomic at GPU scope and the loads past the L1, as the PTX spells them
    lines = [re.sub(r"^@!?%p\d+\s+", "", l.strip()) for l in text.splitlines()]  # without a predicate guard
    return {"atom_acq_rel_gpu": any(l.startswith("atom.") and ".acq_rel" in l and ".gpu" in l for l in lines),
            "ld_cg": any(l.startswith("ld.global.cg") for l in lines)}

pro_sig = {"qkv_ptr": "*fp16", "stride_qkv_b": "i32", "qw_ptr": "*fp16", "kw_ptr": "*fp16", "pos_ptr": "*i64",
           "inv_freq_ptr": "*fp32", "k_ptr": "*fp16", "v_ptr": "*fp16", "part_ptr": "*fp32", "ml_ptr": "*fp32",
           "slot_ptr": "*i64", "pad_ptr": "*i64", "stride_cb": "i32", "stride_ch": "i32", "stride_cs": "i32",
           "scale": "fp32", "eps": "fp32", "out_ptr": "*fp16", "count_ptr": "*i32"}
split_sig = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "part_ptr": "*fp32", "ml_ptr": "*fp32",
             "slot_ptr": "*i64", "pad_ptr": "*i64", "stride_cb": "i32", "stride_ch": "i32", "stride_cs": "i32",
             "scale": "fp32", "out_ptr": "*fp16", "count_ptr": "*i32"}
norm_sig = {"x_ptr": "*fp16", "y_ptr": "*fp16", "nw_ptr": "*fp16", "rw_ptr": "*fp32", "x_out_ptr": "*fp16",
            "h_out_ptr": "*fp16", "logits_ptr": "*fp32", "E": "i32", "eps": "fp32", "ids_ptr": "*i64",
            "wts_ptr": "*fp32", "count_ptr": "*i32"}
sizes = {}
for tail in (False, True):
    for norm in (False, True):
        sizes[f"prologue_split/{tail}/{norm}"] = build(fused_ops._decode_attn_prologue_split_kernel, pro_sig, {
            "N_KEYS": 256, "NH": 16, "NKV": 16, "HALF": 64, "NH_P2": 16, "NKV_P2": 16, "HALF_P2": 64,
            "HAS_NORM": norm, "BLOCK_N": 32, "SPLITS": 8, "TAIL": tail, "CHAINED": True})
        sizes[f"ops/prologue_split/{tail}/{norm}"] = ops(ptx[len(ptx) - 1])
    sizes[f"split/{tail}"] = build(fused_ops._decode_attn_split_kernel, split_sig, {
        "N_KEYS": 256, "NH": 16, "NKV": 16, "D": 128, "D_P2": 128, "BLOCK_N": 32, "SPLITS": 8, "TAIL": tail,
        "CHAINED": True})
for tail in (0, 1, 2):
    for e, topk, norm in ((64, 8, False), (60, 4, False), (60, 4, True)):
        sizes[f"norm_router/{tail}/{e}/{topk}/{norm}"] = build(fused_ops._add_norm_router_kernel, norm_sig, {
            "H": 2048, "H_P2": 2048, "HAS_Y": True, "BLOCK_E": 2, "BLOCK_H": 1024, "TAIL": tail, "TOPK": topk,
            "NORM": norm, "E_P2": 64, "CHAINED": True})
        sizes[f"ops/norm_router/{tail}/{e}/{topk}/{norm}"] = ops(ptx[len(ptx) - 1])
print(json.dumps(sizes))
"""


def test_the_tail_kernels_compile_for_sm90():
    everything = compiled_sizes(TAILS_SCRIPT)
    flags = {k[4:]: v for k, v in everything.items() if k.startswith("ops/")}
    sizes = {k: v for k, v in everything.items() if not k.startswith("ops/")}
    assert len(sizes) == 6 + 9 and all(n > 1000 for n in sizes.values()), sizes
    # the count is an acquire-release atomic at GPU scope and the last program reads past its L1 exactly where a tail
    # is compiled in (core.counted_last's ordering argument rests on both)
    for name, f in flags.items():
        tail = name.split("/")[1] not in ("False", "0")
        assert f == {"atom_acq_rel_gpu": tail, "ld_cg": tail}, (name, f)
    # the tails are code the forms without them leave out
    assert all(sizes[f"prologue_split/True/{n}"] > sizes[f"prologue_split/False/{n}"] for n in (False, True)), sizes
    assert sizes["split/True"] > sizes["split/False"], sizes
    assert all(sizes[f"norm_router/{t}/60/4/False"] > sizes["norm_router/0/60/4/False"] for t in (1, 2)), sizes
