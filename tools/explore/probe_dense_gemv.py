"""GPU probe (not a test): the decode step's dense fp16 projections, cuBLAS (``F.linear``) against Triton GEMVs.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/explore/probe_dense_gemv.py --out $OUT/dense-gemv.json

Why: in the OLMoE decode profile (results/campaigns/h200-decode) cuBLAS's qkv and o projections take ~240 us of a
~950 us step at batch 1 and 8, ~2.2 TB/s for 537 MB of fp16 weights; the same bytes read at the copy rate would take
~130 us. For each shape (qkv: N = 3 * 2048, o: N = 2048, K = 2048; Qwen1.5-MoE has the same) and M in {1, 8}, 16
layers of distinct weights (so that L2 holds none of them) are timed as one CUDA graph (per-layer time, median of 30
replays): ``F.linear`` and a Triton GEMV over a grid of tiles (one program per BLOCK_N output rows, the whole K; the
M rows of x in registers, products accumulated per lane and reduced once at the end). Every variant is checked
against an FP32 matmul of the same values (max |diff| / max |ref|, tolerance 2e-3). Fractions are of the 1 GiB device
copy measured in the same run.
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from runmap.atomic import write_json
from runmap.bench.kernel_workload import copy_bandwidth, graph_us

LAYERS = 16
SHAPES = {"qkv": (3 * 2048, 2048), "o": (2048, 2048)}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, M: tl.constexpr, M_P2: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] for BLOCK_N rows n and all M (<= M_P2) rows of x; fp32 sums, fp16 out."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, M_P2)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((M_P2, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + offs_n[:, None] * K + k0 + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], mask=(offs_m < M)[:, None], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # (M_P2, BN, BK)
    y = tl.sum(acc, axis=2)  # (M_P2, BN)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], y.to(tl.float16),
             mask=(offs_m < M)[:, None] & n_mask[None, :])


def triton_gemv(x, w, cfg):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float16, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](x, w, y, n, K=k, M=m, M_P2=max(triton.next_power_of_2(m), 1),
                                                    BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                                    num_warps=cfg["num_warps"])
    return y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON record to write")
    ap.add_argument("--tiles", default="4,8,16:256,512:4,8",
                    help="BLOCK_N list:BLOCK_K list:num_warps list of the Triton grid (default: %(default)s)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    bn, bk, nw = ([int(v) for v in part.split(",")] for part in args.tiles.split(":"))
    copy = copy_bandwidth(1 << 30)
    rows = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 8)):
        ws = [torch.randn(n, k, device="cuda").half() * 0.02 for _ in range(LAYERS)]
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(LAYERS)]
        refs = [(x.float() @ w.float().t()) for x, w in zip(xs, ws)]
        nbytes = n * k * 2

        def measure(label, fn, cfg=None):
            outs = [fn(x, w) for x, w in zip(xs, ws)]
            err = max(((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(outs, refs))
            us = graph_us(lambda: [fn(x, w) for x, w in zip(xs, ws)], LAYERS)
            row = {"shape": name, "n": n, "k": k, "m": m, "variant": label, "config": cfg, "us": us,
                   "gb_s": nbytes / us / 1e3, "fraction_of_copy": nbytes / us / 1e3 / copy["gbps"],
                   "rel_err": err, "ok": err <= 2e-3}
            rows.append(row)
            return row

        base = measure("cublas", lambda x, w: F.linear(x, w))
        best = None
        for b_n, b_k, warps in itertools.product(bn, bk, nw):
            if b_k > k or (m > 1 and b_n * b_k > 2048):
                continue
            cfg = {"BLOCK_N": b_n, "BLOCK_K": b_k, "num_warps": warps}
            try:
                r = measure("triton", lambda x, w, c=cfg: triton_gemv(x, w, c), cfg)
            except Exception as exc:  # a tile the compiler refuses (registers): recorded, not fatal
                rows.append({"shape": name, "m": m, "variant": "triton", "config": cfg, "error": repr(exc)[:200]})
                continue
            if r["ok"] and (best is None or r["us"] < best["us"]):
                best = r
        print(f"{name:4s} M={m}: cublas {base['us']:6.2f} us ({base['fraction_of_copy']:.2f} of copy)  best triton "
              f"{best['us'] if best else float('nan'):6.2f} us {best['config'] if best else None}", flush=True)
    write_json(args.out, {"format": "dense-gemv-probe-v1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "command": "python3 tools/explore/probe_dense_gemv.py " + " ".join(argv or []),
                          "device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__,
                                                                               "triton": triton.__version__},
                          "copy": copy, "layers": LAYERS, "rows": rows})


if __name__ == "__main__":
    main()
