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


def test_the_imposed_weights_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(sizes) == 12 and all(n > 1000 for n in sizes.values()), sizes
    # the top-k sum (NORM False) is code the NORM True form leaves out
    assert all(sizes[f"{t}/{p}/False/{c}"] > sizes[f"{t}/{p}/True/{c}"]
               for t, p in ((8, 64), (4, 64), (2, 8)) for c in (False, True)), sizes
