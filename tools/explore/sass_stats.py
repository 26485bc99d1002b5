"""Count the instructions of a decode GEMV kernel's inner loop as compiled for sm_90, without a GPU.

Triton compiles for a GPU target on any machine (``triton.compile`` with a ``GPUTarget``) and ships
``cuobjdump``, so the SASS of the main loop can be read and counted here. The figure of merit for the decode
GEMVs is instructions per weight byte: at batch 1 they are bound by instruction issue, not by memory.

    python tools/explore/sass_stats.py                       # words vs blocks, gate/up and down, a few tiles
    python tools/explore/sass_stats.py --dump /tmp/sass      # also keep the .ptx / .sass files

Also the grouped executor's tensor-core gate/up loop (family "dot": Triton's nibble decoding; "dot-asm": the
inline-PTX decoding of kernels/core.py) at a decode and a prefill tile; for these rows SUB is BLOCK_M.

The loop is the first backward branch's body. Integer arguments that are multiples of 16 at run time (row
bytes, section offsets, pointers) are marked divisible by 16, as Triton's launcher specializes them.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from runmap.kernels import gemv, gemv_words, grouped

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
GATE_UP_SIG = {"x_ptr": "*fp16", "ids_ptr": "*i32", "row_table_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*fp16",
               "h_ptr": "*fp16", "n_experts": "i32", "n_rows": "i32", "row_bytes": "i32", "stride_xm": "i32",
               "gate_w": "i32", "gate_s": "i32", "up_w": "i32", "up_s": "i32"}
DOWN_SIG = {"h_ptr": "*fp16", "ids_ptr": "*i32", "wts_ptr": "*fp32", "row_table_ptr": "*i32", "w_ptr": "*u8",
            "s_ptr": "*fp16", "y_ptr": "*fp16", "n_experts": "i32", "n_rows": "i32", "row_bytes": "i32",
            "stride_ym": "i32", "down_w": "i32", "down_s": "i32"}
GROUPED_GATE_UP_SIG = {"x_ptr": "*fp16", "ids_ptr": "*i32", "order_ptr": "*i32", "row_table_ptr": "*i32",
                       "w_ptr": "*u8", "s_ptr": "*fp16", "h_ptr": "*fp16", "P": "i32", "n_experts": "i32",
                       "n_rows": "i32", "row_bytes": "i32", "host_off": "i32", "n_host_rows": "i32",
                       "stride_xm": "i32", "gate_w": "i32", "gate_s": "i32", "up_w": "i32", "up_s": "i32",
                       "sx_ptr": "*fp16", "sw_ptr": "*fp16", "sgu_ptr": "*fp16", "S_N": "i32"}
NOT_DIV16 = {"n_experts", "n_rows", "magic", "P", "n_host_rows", "S_N"}  # host_off: a multiple of 16, as host_site checks


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int, dump: Path | None, name: str,
                 num_stages: int = 3) -> str:
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in signature if a not in NOT_DIV16}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / f"{name}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.ptx").write_text(kernel.asm["ptx"])
        (dump / f"{name}.sass").write_text(sass)
    return sass


def loop_counts(sass: str) -> collections.Counter:
    """Opcode counts of the body of the first backward branch (the main K loop)."""
    line_re = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(line_re.match, sass.splitlines()) if m]
    for addr, text in ins:
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            body = [t for a, t in ins if start <= a <= addr]
            return collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in body)
    raise RuntimeError("no backward branch: the loop was fully unrolled or the kernel has none")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", type=Path, help="directory for the .ptx / .sass of every variant")
    ap.add_argument("--json", action="store_true", help="print one JSON list of rows instead of the table")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("sass_stats: unset TRITON_INTERPRET (interpreted kernels cannot be compiled for a GPU target)")
    h, i, q, topk = 2048, 1024, 256, 8  # OLMoE expert shape
    rows = []
    for bn, sub, nw in [(16, 2, 8), (32, 2, 4), (16, 2, 2)]:
        ce = {"N": i, "K": h, "NB": h // q, "QBLOCK": q, "TOPK": topk, "BLOCK_N": bn, "SUB": sub, "EVEN": True}
        loop_bytes = bn * (q // 2) * sub * 2  # gate + up bytes per loop iteration
        rows.append(("gate_up", "blocks", bn, sub, nw, loop_bytes,
                     compile_sass(gemv._pair_gate_up_kernel, GATE_UP_SIG, ce, nw, args.dump, f"blocks_gu_{bn}_{sub}_{nw}")))
        rows.append(("gate_up", "words", bn, sub, nw, loop_bytes,
                     compile_sass(gemv_words._words_gate_up_kernel, dict(GATE_UP_SIG, magic="i32"), ce, nw, args.dump,
                                  f"words_gu_{bn}_{sub}_{nw}")))
    for bn, sub, nw in [(8, 2, 8), (16, 2, 2)]:
        ce = {"N": h, "K": i, "NB": i // q, "QBLOCK": q, "TOPK": topk, "TOPK_P2": topk, "BLOCK_N": bn, "SUB": sub,
              "EVEN": True}
        loop_bytes = topk * bn * (q // 2) * sub
        rows.append(("down", "blocks", bn, sub, nw, loop_bytes,
                     compile_sass(gemv._token_down_kernel, DOWN_SIG, ce, nw, args.dump, f"blocks_dn_{bn}_{sub}_{nw}")))
        rows.append(("down", "words", bn, sub, nw, loop_bytes,
                     compile_sass(gemv_words._words_down_kernel, dict(DOWN_SIG, magic="i32"), ce, nw, args.dump,
                                  f"words_dn_{bn}_{sub}_{nw}")))
    # grouped tensor-core gate/up (kernels/core.py dot_tiles): Triton's nibble decoding vs the inline PTX one,
    # at the decode tile (BLOCK_M 16, mma.sync) and the prefill tile (BLOCK_M 64, wgmma); SUB = BLOCK_M here
    for bm, bn, bk, nw, ns in [(16, 32, 256, 4, 3), (64, 64, 128, 4, 3)]:
        for fam, deq_asm in (("dot", False), ("dot-asm", True)):
            ce = {"N": i, "K": h, "NB": h // q, "QBLOCK": q, "TOPK": topk, "SORTED": bm > 16, "P_PAD": 2 if bm > 16 else 8,
                  "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "TILE_SCALE": True, "DEQ_ASM": deq_asm, "SCALE_COLS": 0}
            rows.append(("gate_up", fam, bn, bm, nw, 2 * bn * bk // 2,
                         compile_sass(grouped._grouped_gate_up_kernel, GROUPED_GATE_UP_SIG, ce, nw, args.dump,
                                      f"{fam}_gu_{bm}_{bn}_{bk}_{nw}", num_stages=ns)))
    table = []
    for launch, fam, bn, sub, nw, loop_bytes, sass in rows:
        c = loop_counts(sass)
        n = sum(c.values())
        table.append({"launch": launch, "family": fam, "BLOCK_N": bn, "SUB": sub, "num_warps": nw,
                      "loop_instructions": n, "bytes_per_thread": loop_bytes / (32 * nw),
                      "per_byte": n / (loop_bytes / (32 * nw)), "opcodes": dict(c)})
    if args.json:
        print(json.dumps(table))
        return
    print(f"{'launch':8s} {'family':7s} {'BN':>3s} {'SUB':>3s} {'warps':>5s} {'loop instr':>10s} {'per byte':>8s}  top opcodes")
    for r in table:
        top = ", ".join(f"{k} {v}" for k, v in collections.Counter(r["opcodes"]).most_common(6))
        print(f"{r['launch']:8s} {r['family']:7s} {r['BLOCK_N']:3d} {r['SUB']:3d} {r['num_warps']:5d} "
              f"{r['loop_instructions']:10d} {r['per_byte']:8.2f}  {top}")


if __name__ == "__main__":
    main()
