"""GPU probe (not a test): programmatic dependent launch (PDL) in the batch-1 decode chain, with and without L2
prefetch of the next kernel's weights.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/explore/probe_decode_pdl.py --out $OUT/decode-pdl.json

Why: in the OLMoE batch-1 decode profile (results/campaigns/h200-decode) the step's ~170 launches each take a few
microseconds, and the expert launches read their bytes at 0.26-0.38 of the copy rate: every launch pays its ramp (the
first loads' latency) and its tail (the last wave) while the memory system idles. With PDL
(``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, Hopper) a kernel may start before its predecessor ends:
it does what does not depend on the predecessor (here: prefetch its weights into L2), then ``griddepcontrol.wait``
holds it until the predecessor's grid has completed and its writes are visible. The predecessor lets it start with
``griddepcontrol.launch_dependents``. Every kernel here waits before it reads anything an earlier kernel wrote, and
signals only after its own wait, so a kernel that starts early has an ancestor chain that has completed up to its
predecessor.

The chain per layer stands in for the decode step's weight-streaming launches on real OLMoE-1B-7B shapes: the q|k|v
GEMV (6,144 x 2,048 fp16) -> the o GEMV (2,048 x 2,048, reading the first 2,048 outputs of q|k|v) -> the experts'
gate/up and down launches (``topk-fused`` "words" kernels, 8 of 64 experts, random qpacked rows) -> the next layer;
16 layers of distinct weights per CUDA graph (the weights come from HBM). Variants: the product launches, PDL only,
PDL + L2 prefetch (the GEMVs' weight tiles, the down launch's expert rows once the route is known), and prefetch
without PDL. "plain" and "pdl" are the product's launches (``runmap.kernels.common.chained``, RUNMAP_PDL=0 / 1) since
the product chains its decode kernels; the first run of this probe (dd807e6) had its own PDL wrappers there. Every
variant's final activation is compared with the plain launches' (bitwise: the arithmetic is the same). Times are per layer, median of 30 replays, two passes; bytes per layer / time as a fraction of the same-run
device copy.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from runmap.atomic import write_json
from runmap.bench.kernel_workload import copy_bandwidth, graph_us, model_layers, routing, MODELS
from runmap.kernels import common
from runmap.kernels.common import PDL_ENV, reset_chained
from runmap.kernels.core import prefetch_l2, token_slots
from runmap.kernels.fused_ops import _gemv_kernel, _launch_gemv
from runmap.kernels.gemv_words import _words_down_kernel, _words_gate_up_kernel
from runmap.kernels.topk_fused import MAGIC_F32, _even, default_config, topk_down, topk_gate_up

LAYERS = 16
LINE = 128  # bytes per L2 prefetch


@triton.jit
def _gemv_pdl_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr = 1):
    if PREFETCH:  # the program's BLOCK_N whole weight rows: contiguous (N % BLOCK_N == 0 here)
        base = w_ptr.to(tl.pointer_type(tl.int8)) + tl.program_id(0).to(tl.int64) * BLOCK_N * K * 2
        prefetch_l2(base + tl.minimum(tl.arange(0, LINES) * 128, BLOCK_N * K * 2 - 1))
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, HAS_BIAS, BLOCK_N, BLOCK_K)


@triton.jit
def _gate_up_pdl_kernel(x_ptr, ids_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, n_experts, n_rows, row_bytes, stride_xm,
                        gate_w, gate_s, up_w, up_s, magic, N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
                        QBLOCK: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
                        EVEN: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the route (ids) comes from the launch before: nothing to prefetch before the wait
        gdc_wait()
        gdc_launch_dependents()
    _words_gate_up_kernel(x_ptr, ids_ptr, row_table_ptr, w_ptr, s_ptr, h_ptr, n_experts, n_rows, row_bytes, stride_xm,
                          gate_w, gate_s, up_w, up_s, magic, N, K, NB, QBLOCK, TOPK, BLOCK_N, SUB, EVEN)


@triton.jit
def _down_pdl_kernel(h_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, y_ptr, n_experts, n_rows, row_bytes,
                     stride_ym, down_w, down_s, magic, N: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
                     QBLOCK: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                     SUB: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                     LINES: tl.constexpr = 1):
    if PREFETCH:  # the route was complete before the gate/up launch passed its wait: the rows are known
        _p, _s_ok, w_row, _s_row, _ok, _gw = token_slots(tl.program_id(0), ids_ptr, wts_ptr, row_table_ptr, w_ptr,
                                                        s_ptr, n_experts, n_rows, row_bytes, TOPK, TOPK_P2)
        first = w_row + down_w + tl.program_id(1) * BLOCK_N * (K // 2)  # (S,) this program's rows: contiguous
        prefetch_l2(first[:, None] + tl.minimum(tl.arange(0, LINES) * 128, BLOCK_N * (K // 2) - 1)[None, :])
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    _words_down_kernel(h_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, y_ptr, n_experts, n_rows, row_bytes,
                       stride_ym, down_w, down_s, magic, N, K, NB, QBLOCK, TOPK, TOPK_P2, BLOCK_N, SUB, EVEN)


def gemv(x, w, pdl: bool, prefetch: bool):
    n, k = w.shape
    y = torch.empty(n, dtype=torch.float16, device=x.device)
    if not prefetch:  # the product's launch, chained or not as RUNMAP_PDL says (run() sets it)
        _launch_gemv(x, w, None, y)
        return y
    block_n = 16 if n >= 4096 else 4
    assert n % block_n == 0
    _gemv_pdl_kernel[(n // block_n,)](x, w, w, y, n, K=k, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=512, PDL=pdl,
                                     PREFETCH=prefetch, LINES=triton.next_power_of_2(triton.cdiv(block_n * k * 2, LINE)),
                                     launch_pdl=pdl)
    return y


def experts(x, ids, wts, storage, table, layout, pdl: bool, prefetch: bool):
    if not prefetch:  # the product's launches (chained or not as RUNMAP_PDL says)
        return topk_down(topk_gate_up(x, ids, storage, table, layout), ids, wts, storage, table, layout)
    t, k = ids.shape
    cfg = default_config(storage.device, t * k)
    g, u, d = (common.proj_sections(layout, s) for s in ("gate", "up", "down"))
    h = torch.empty((t * k, g.n), dtype=torch.float16, device=x.device)
    _gate_up_pdl_kernel[(t * k, triton.cdiv(g.n, cfg["BLOCK_N"]))](
        x, ids, table, storage, storage.view(torch.float16), h, table.numel(), storage.shape[0], layout.row_bytes,
        x.stride(0), g.w_off, g.s_off, u.w_off, u.s_off, MAGIC_F32, N=g.n, K=g.k, NB=g.nb, QBLOCK=layout.block_size,
        TOPK=k, BLOCK_N=cfg["BLOCK_N"], SUB=cfg["SUB"],
        EVEN=_even(g.k, g.n, g.nb, layout.block_size, cfg["BLOCK_N"], cfg["SUB"]), PDL=pdl,
        num_warps=cfg["num_warps"], launch_pdl=pdl)
    cfg = default_config(storage.device, t * k, d.nb)
    y = torch.empty((t, d.n), dtype=torch.float16, device=x.device)
    even = _even(d.k, d.n, d.nb, layout.block_size, cfg["DOWN_BLOCK_N"], cfg["DOWN_SUB"]) \
        and k == common.next_pow2(k)
    _down_pdl_kernel[(t, triton.cdiv(d.n, cfg["DOWN_BLOCK_N"]))](
        h, ids, wts, table, storage, storage.view(torch.float16), y, table.numel(), storage.shape[0],
        layout.row_bytes, y.stride(0), d.w_off, d.s_off, MAGIC_F32, N=d.n, K=d.k, NB=d.nb, QBLOCK=layout.block_size,
        TOPK=k, TOPK_P2=common.next_pow2(k), BLOCK_N=cfg["DOWN_BLOCK_N"], SUB=cfg["DOWN_SUB"], EVEN=even, PDL=pdl,
        PREFETCH=prefetch, LINES=triton.next_power_of_2(triton.cdiv(cfg["DOWN_BLOCK_N"] * d.k // 2, LINE)),
        num_warps=cfg["DOWN_num_warps"], launch_pdl=pdl)
    return y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON record to write")
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args(argv)
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    spec = MODELS["olmoe"]
    hid, k = spec["hidden"], spec["top_k"]
    layout, stores, table = model_layers(spec, gen)
    wqkv = [torch.randn(3 * hid, hid, device="cuda", generator=gen).half() * hid ** -0.5 for _ in range(LAYERS)]
    wo = [torch.randn(hid, hid, device="cuda", generator=gen).half() * hid ** -0.5 for _ in range(LAYERS)]
    routes = [routing(1, spec["experts"], k, gen) for _ in range(LAYERS)]
    routes = [(ids.to(torch.int32).contiguous(), w) for ids, w in routes]
    x0 = torch.randn(1, hid, device="cuda", generator=gen).half()
    copy = copy_bandwidth(1 << 30)["gbps"]
    dense_bytes = (3 * hid * hid + hid * hid) * 2
    expert_bytes = k * layout.row_bytes

    def chain(pdl, prefetch, dense=True, moe=True):
        def run():
            os.environ[PDL_ENV] = "1" if pdl else "0"
            reset_chained()
            x = x0
            for layer in range(LAYERS):
                if dense:
                    a = gemv(x.view(-1), wqkv[layer], pdl, prefetch)[:hid]
                    x = gemv(a, wo[layer], pdl, prefetch).view(1, hid)
                if moe:
                    ids, w = routes[layer]
                    x = experts(x, ids, w, stores[layer], table, layout, pdl, prefetch)
            return x
        return run

    variants = {"plain": (False, False), "pdl": (True, False), "pdl+prefetch": (True, True),
                "prefetch": (False, True)}
    parts = {"chain": (True, True), "experts": (False, True), "dense": (True, False)}
    rows = []
    refs = {p: chain(False, False, *parts[p])() for p in parts}
    for p, (dense, moe) in parts.items():
        nbytes = (dense_bytes if dense else 0) + (expert_bytes if moe else 0)
        for name, (pdl, pre) in variants.items():
            fn = chain(pdl, pre, dense, moe)
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                print(f"{p} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append({"part": p, "variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            same = bool(torch.equal(out.view(torch.int16), refs[p].view(torch.int16)))
            times = []
            for _ in range(args.passes):
                try:
                    times.append(graph_us(fn, LAYERS))
                except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                    print(f"{p} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    break
            if not times:
                rows.append({"part": p, "variant": name, "error": "capture or replay failed", "bitwise_equal": same})
                continue
            us = min(times)
            rows.append({"part": p, "variant": name, "us_per_layer": us, "passes_us": times, "bytes_per_layer": nbytes,
                         "fraction_of_copy": nbytes / us / 1e3 / copy, "bitwise_equal": same})
    print(f"copy {copy:.0f} GB/s; per layer: dense {dense_bytes / 1e6:.1f} MB, experts {expert_bytes / 1e6:.1f} MB")
    print(f"{'part':8} {'variant':14} {'us/layer':>9} {'frac':>6} {'equal':>6}  passes")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:8} {r['variant']:14} {'-':>9} {'-':>6} {str(r.get('bitwise_equal')):>6}  {r['error']}")
        else:
            print(f"{r['part']:8} {r['variant']:14} {r['us_per_layer']:9.2f} {r['fraction_of_copy']:6.3f} "
                  f"{str(r['bitwise_equal']):>6}  {[round(t, 2) for t in r['passes_us']]}")
    write_json(args.out, {"kind": "decode-pdl-probe", "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__,
                                                                                "triton": triton.__version__},
                          "copy_gbps": copy, "layers": LAYERS, "model": "olmoe", "rows": rows,
                          "seconds": time.time() - t0})


if __name__ == "__main__":
    main()
