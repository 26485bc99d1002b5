"""GPU benchmark of the W4A16 executors (not a test): decode and prefill at OLMoE and Qwen1.5-MoE expert shapes.

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_kernels.py --out $OUT/bench-h200.json

(committed record: results/kernels/bench/h200.json, schema kernel-bench; see benchmarks/README.md)

Method (everything compared within this one run, the GPU being shared):
* Device-copy bandwidth: dst.copy_(src) of a 1 GiB buffer (bytes = read + write), CUDA events, median.
* Decode, T = 1..8 tokens, each routed to top-k distinct experts: 16 layers of distinct weights (so the
  weights come from HBM, not L2), the 16 layer calls captured in one CUDA graph like a real decode step;
  the time per layer is the graph's median / 16. Bytes = the distinct experts' rows (weights + scales) each
  layer must read. Fraction = (bytes / time) / copy bandwidth. Eager (no graph) time is recorded too.
* Prefill, 512 tokens routed over all experts: the grouped executor against torch's bf16 grouped path on
  the same problem (sort by expert, gate+up grouped matmul, SiLU*mul, down grouped matmul, weighted
  scatter): torch._grouped_mm when the installed torch has it (else one matmul per expert). Both sides are
  timed as a CUDA graph of the 4 layers (GPU time: host launch overhead, which made eager timings of the
  same config vary by up to 60 % between calls, does not enter) and eagerly; the ratio (bf16 time / W4A16
  time, >= 1 means the W4A16 path is at least as fast) is taken on graph times when both sides could be
  captured, and both ratios are recorded.
* A small tile sweep picks each executor's config on the timed problem; all tried configs are recorded.
"""
from __future__ import annotations

import argparse
import platform
import shlex
import sys
import traceback

import torch

from runmap.atomic import write_json
from runmap.bench.cuda_timing import event_times_ms
from runmap.bench.kernel_workload import (LAYERS, MODELS, PREFILL_LAYERS, PREFILL_TOKENS, bf16_grouped_layer,
                                          copy_bandwidth, graph_us, median, random_batches, random_layer)
from runmap.format.qpack import RowLayout
from runmap.kernels.executors import moe_experts
from runmap.kernels.reference import reference_moe_f32
from runmap.provenance import utc_timestamp

DECODE_TOKENS = (1, 2, 4, 8)
TARGET_DECODE_FRACTION = 0.70
TARGET_PREFILL_RATIO = 1.0

TOPK_CONFIGS = [  # "words" = kernels/gemv_words.py (default), "blocks" = kernels/gemv.py, "tiles" = kernels/topk_fused.py
    # the few-pairs default: DOWN_SUB left to topk_fused.default_config (one round of loads over the down row)
    {"KERNEL": "words", "BLOCK_N": 16, "SUB": 4, "num_warps": 8, "DOWN_BLOCK_N": 8, "DOWN_num_warps": 4},
    {"KERNEL": "words", "BLOCK_N": 16, "SUB": 2, "num_warps": 8, "DOWN_BLOCK_N": 8, "DOWN_SUB": 2, "DOWN_num_warps": 8},
    {"KERNEL": "words", "BLOCK_N": 32, "SUB": 2, "num_warps": 4, "DOWN_BLOCK_N": 16, "DOWN_SUB": 2, "DOWN_num_warps": 2},
    {"KERNEL": "words", "BLOCK_N": 16, "SUB": 2, "num_warps": 2, "DOWN_BLOCK_N": 16, "DOWN_SUB": 1, "DOWN_num_warps": 2},
    {"KERNEL": "blocks", "BLOCK_N": 16, "SUB": 2, "num_warps": 8, "DOWN_BLOCK_N": 8, "DOWN_SUB": 2, "DOWN_num_warps": 8},
    {"KERNEL": "tiles", "BLOCK_N": 16, "BLOCK_K": 512, "DOWN_BLOCK_N": 8, "DOWN_BLOCK_K": 1024, "num_warps": 4,
     "DOWN_num_warps": 4},
]
# DEQ_ASM (inline-PTX nibble decoding) is the GPU default; one row without it. The tiles below are the decode form's
# (SORTED False: the GPU's default asks for sorted runs from 33 pairs, grouped.DECODE_FORM_MAX_PAIRS); the empty
# config is the default as the product runs it
_DECODE_FORM = {"BLOCK_M": 16, "SORTED": False}
GROUPED_DECODE_CONFIGS = [
    {},
    {**_DECODE_FORM, "BLOCK_N": 32, "BLOCK_K": 256, "DOWN_BLOCK_N": 32, "DOWN_BLOCK_K": 256, "num_warps": 4,
     "num_stages": 3},
    {**_DECODE_FORM, "BLOCK_N": 32, "BLOCK_K": 256, "DOWN_BLOCK_N": 32, "DOWN_BLOCK_K": 256, "num_warps": 4,
     "num_stages": 3, "DEQ_ASM": False},
    {**_DECODE_FORM, "BLOCK_N": 64, "BLOCK_K": 512, "DOWN_BLOCK_N": 64, "DOWN_BLOCK_K": 512, "num_warps": 2,
     "num_stages": 3},
    {**_DECODE_FORM, "BLOCK_N": 64, "BLOCK_K": 256, "DOWN_BLOCK_N": 64, "DOWN_BLOCK_K": 256, "num_warps": 4,
     "num_stages": 3},
    {**_DECODE_FORM, "BLOCK_N": 32, "BLOCK_K": 128, "DOWN_BLOCK_N": 32, "DOWN_BLOCK_K": 128, "num_warps": 4,
     "num_stages": 5},
]
GROUPED_PREFILL_CONFIGS = [  # the best of results/kernels/explore/h200-prefill.json, and the previous default
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "DOWN_BLOCK_N": 64, "DOWN_BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "DOWN_BLOCK_N": 64, "DOWN_BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
     "DEQ_ASM": False},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "DOWN_BLOCK_N": 64, "DOWN_BLOCK_K": 256, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "DOWN_BLOCK_N": 128, "DOWN_BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "DOWN_BLOCK_N": 32, "DOWN_BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
]


def rel_err(executor, batch, storage, table, layout, cfg) -> float:
    """Relative error of one layer call with ``cfg`` against the FP32 reference (every timed config is
    also checked for correctness on the GPU)."""
    x, ids, w = batch
    y = moe_experts(executor, x, ids, w, storage, table, layout, validate=False, config=cfg)
    ref = reference_moe_f32(x, ids, w, storage, table, layout)
    return float((y.float() - ref).norm() / ref.norm())


def bench_decode(model: str, spec: dict, layers: list, layout: RowLayout, copy_gbps: float, gen, log) -> list[dict]:
    h, e, k = spec["hidden"], spec["experts"], spec["top_k"]
    table = torch.arange(e, dtype=torch.int32, device="cuda")
    rows = []
    best_cfg = {}
    for tokens in DECODE_TOKENS:
        batches = random_batches(LAYERS, tokens, h, e, k, gen)
        distinct = sum(int(torch.unique(b[1]).numel()) for b in batches)
        expert_bytes = distinct * layout.row_bytes / LAYERS  # per layer, averaged
        for executor, configs in (("topk-fused", TOPK_CONFIGS), ("grouped", GROUPED_DECODE_CONFIGS)):
            tried = configs if tokens in (1, 8) or executor not in best_cfg else [best_cfg[executor]]
            results = []
            for cfg in tried:
                def step(cfg=cfg):
                    for (x, ids, w), st in zip(batches, layers):
                        moe_experts(executor, x, ids, w, st, table, layout, validate=False, config=cfg)
                try:
                    graph = graph_us(step, LAYERS, reps=40, warmup=5)
                    eager_ms = median(event_times_ms(step, reps=10)) / LAYERS
                except Exception as exc:  # a config the compiler rejects is recorded, not fatal
                    log(f"  {model} decode T={tokens} {executor} {cfg}: FAILED {type(exc).__name__}: {exc}")
                    results.append({"config": cfg, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                    continue
                err = rel_err(executor, batches[0], layers[0], table, layout, cfg)
                results.append({"config": cfg, "graph_us": graph, "eager_us": eager_ms * 1e3, "rel_err": err})
            ok = [r for r in results if "graph_us" in r and r["rel_err"] <= 2e-3]
            if not ok:
                continue
            best = min(ok, key=lambda r: r["graph_us"])
            if tokens in (1, 8) and (executor not in best_cfg or tokens == 8):
                best_cfg[executor] = best["config"]
            gbps = expert_bytes / (best["graph_us"] * 1e-6) / 1e9
            rows.append({
                "model": model, "phase": "decode", "tokens": tokens, "executor": executor,
                "median_us": best["graph_us"], "eager_us": best["eager_us"], "timing": "cuda-graph, 16 layers",
                "expert_bytes": expert_bytes, "gbps": gbps, "fraction_of_copy": gbps / copy_gbps,
                "meets_target": gbps / copy_gbps >= TARGET_DECODE_FRACTION,
                "config": best["config"], "tried": results,
            })
            log(f"  {model} decode T={tokens} {executor}: {best['graph_us']:.1f} us/layer, {gbps:.0f} GB/s, "
                f"{gbps / copy_gbps:.2f} of copy; tried " + ", ".join(f"{r.get('graph_us', float('nan')):.1f}" for r in results))
    return rows


def bench_prefill(model: str, spec: dict, layers: list, layout: RowLayout, gen, log) -> list[dict]:
    h, i, e, k = spec["hidden"], spec["intermediate"], spec["experts"], spec["top_k"]
    table = torch.arange(e, dtype=torch.int32, device="cuda")
    batches = random_batches(PREFILL_LAYERS, PREFILL_TOKENS, h, e, k, gen)

    def timings(step) -> dict:
        """{"graph_us", "eager_us"} per layer of ``step`` (4 layers); graph_us absent if capture fails."""
        out = {"eager_us": median(event_times_ms(step, reps=15)) / PREFILL_LAYERS * 1e3}
        try:
            out["graph_us"] = graph_us(step, PREFILL_LAYERS, reps=15)
        except Exception as exc:  # e.g. a baseline that synchronizes with the host
            out["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return out

    results = []
    for cfg in GROUPED_PREFILL_CONFIGS:
        def step(cfg=cfg):
            for (x, ids, w), st in zip(batches, layers[:PREFILL_LAYERS]):
                moe_experts("grouped", x, ids, w, st, table, layout, validate=False, config=cfg)
        try:
            t = timings(step)
        except Exception as exc:
            log(f"  {model} prefill grouped {cfg}: FAILED {type(exc).__name__}: {exc}")
            results.append({"config": cfg, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        err = rel_err("grouped", batches[0], layers[0], table, layout, cfg)
        results.append({"config": cfg, **{k_: v for k_, v in t.items() if k_ != "graph_error"}, "rel_err": err})
        log(f"  {model} prefill grouped {cfg}: graph {t.get('graph_us', float('nan')):.1f} / eager "
            f"{t['eager_us']:.1f} us/layer, rel err {err:.1e}")
    ok = [r for r in results if "graph_us" in r and r["rel_err"] <= 2e-3]
    best = min(ok, key=lambda r: r["graph_us"]) if ok else None

    # bf16 baseline, same routing; weights (E, 2I, H) and (E, H, I) per layer, viewed column-major as torch wants
    wgu = [torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
           for _ in range(PREFILL_LAYERS)]
    wd = [torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
          for _ in range(PREFILL_LAYERS)]
    xb = [(x.to(torch.bfloat16), ids, w) for x, ids, w in batches]
    baseline = {}
    for name, use in (("torch._grouped_mm", True), ("per-expert matmul", False)):
        if use and not hasattr(torch, "_grouped_mm"):
            continue

        def bstep(use=use):
            for (x, ids, w), a, b in zip(xb, wgu, wd):
                bf16_grouped_layer(x, ids, w, a.transpose(1, 2), b.transpose(1, 2), e, use)

        try:
            baseline[name] = timings(bstep)
            log(f"  {model} prefill bf16 {name}: graph {baseline[name].get('graph_us', float('nan')):.1f} / eager "
                f"{baseline[name]['eager_us']:.1f} us/layer")
        except Exception as exc:
            log(f"  {model} prefill bf16 {name}: FAILED {type(exc).__name__}: {exc}")
    graphed = {n: t["graph_us"] for n, t in baseline.items() if "graph_us" in t}
    if best is None or not graphed:
        return [{"model": model, "phase": "prefill", "tokens": PREFILL_TOKENS, "executor": "grouped",
                 "tried": results, "bf16_us": {n: t["eager_us"] for n, t in baseline.items()},
                 "error": "no W4A16 or bf16 path timed as a CUDA graph"}]
    bf16_name = min(graphed, key=graphed.get)
    bf16_eager = min(t["eager_us"] for t in baseline.values())
    flops = 2 * PREFILL_TOKENS * k * 3 * h * i
    return [{
        "model": model, "phase": "prefill", "tokens": PREFILL_TOKENS, "executor": "grouped",
        "median_us": best["graph_us"], "eager_us": best["eager_us"], "timing": "cuda-graph, 4 layers rotated",
        "expert_bytes": e * layout.row_bytes, "tflops": flops / (best["graph_us"] * 1e-6) / 1e12,
        "bf16_us": graphed, "bf16_eager_us": {n: t["eager_us"] for n, t in baseline.items()}, "bf16_best": bf16_name,
        "ratio_to_bf16": graphed[bf16_name] / best["graph_us"],
        "eager_ratio_to_bf16": bf16_eager / best["eager_us"],
        "meets_target": graphed[bf16_name] / best["graph_us"] >= TARGET_PREFILL_RATIO,
        "config": best["config"], "tried": results,
    }]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/kernels/bench/h200.json", help="output JSON (default %(default)s)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    import numpy
    import triton

    def log(msg):
        print(msg, flush=True)

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    copy_before = copy_bandwidth(1 << 30)
    log(f"device copy (1 GiB, read+write): {copy_before['gbps']:.0f} GB/s")
    rows = []

    def save(copy_after):
        doc = {
            "format": "kernel-bench-v1",
            "created": utc_timestamp(),
            "command": "PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_kernels.py "
                       + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "device": {"type": "cuda", "name": torch.cuda.get_device_name(0)},
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__, "numpy": numpy.__version__, "cuda": str(torch.version.cuda)},
            "copy_bandwidth": {"before": copy_before, "after": copy_after},
            "targets": {"decode_fraction_of_copy": TARGET_DECODE_FRACTION,
                        "prefill_ratio_to_bf16": TARGET_PREFILL_RATIO},
            "layers": LAYERS,
            "results": rows,
        }
        write_json(args.out, doc)  # after every model, so a run cut short still leaves a record

    for model in args.models.split(","):
        spec = MODELS[model]
        layout = RowLayout.build(spec["hidden"], spec["intermediate"], 256)
        layers = [random_layer(layout, spec["experts"], gen) for _ in range(LAYERS)]
        try:
            rows += bench_decode(model, spec, layers, layout, copy_before["gbps"], gen, log)
        except Exception:
            traceback.print_exc()
        save(copy_before)
        if not args.skip_prefill:
            try:
                rows += bench_prefill(model, spec, layers, layout, gen, log)
            except Exception:
                traceback.print_exc()
        del layers
        torch.cuda.empty_cache()
        save(copy_before)
    copy_after = copy_bandwidth(1 << 30)
    save(copy_after)
    cb = copy_before["gbps"]
    print(f"\ncopy bandwidth {cb:.0f} GB/s (before) / {copy_after['gbps']:.0f} GB/s (after); targets: decode >= "
          f"{TARGET_DECODE_FRACTION:.0%} of copy, prefill >= {TARGET_PREFILL_RATIO:.1f}x bf16")
    print(f"{'model':<12} {'phase':<8} {'T':>4} {'executor':<11} {'us/layer':>9} {'eager':>8} {'GB/s':>7} "
          f"{'frac':>5} {'xbf16 (graph, eager)':>20} {'TFLOP/s':>8} target")
    for r in rows:
        if "median_us" not in r:
            print(f"{r['model']:<12} {r['phase']:<8} {r['tokens']:>4} {r['executor']:<11} FAILED")
            continue
        eager = f"{r['eager_us']:.1f}" if "eager_us" in r else "-"
        gbps = f"{r['gbps']:.0f}" if "gbps" in r else "-"
        frac = f"{r['fraction_of_copy']:.2f}" if "fraction_of_copy" in r else "-"
        ratio = f"{r['ratio_to_bf16']:.2f}" if "ratio_to_bf16" in r else "-"
        if "eager_ratio_to_bf16" in r:
            ratio += f" ({r['eager_ratio_to_bf16']:.2f} eager)"
        tf = f"{r['tflops']:.0f}" if "tflops" in r else "-"
        print(f"{r['model']:<12} {r['phase']:<8} {r['tokens']:>4} {r['executor']:<11} {r['median_us']:>9.1f} "
              f"{eager:>8} {gbps:>7} {frac:>5} {ratio:>20} {tf:>8} {'met' if r['meets_target'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
