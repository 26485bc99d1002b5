"""GPU probe (not a test, not the official record): where a warm batch-1 prefill's wall time goes on a full-residency
engine, per prompt length and prefill chunk size (issue 18 item 3).

For each (chunk, prompt length): the wall time of ``Engine.run(max_new_tokens=1)`` (its TTFT), the host time until
``prefill`` returns (everything queued) against the time until the device is done, and a torch.profiler pass with
CPU and CUDA activity: device busy time, kernel launches, and every host call that waits for the device
(``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, ``cudaMemcpy`` without Async)
with the Python frames that made it. A cProfile of the host side of one prefill at the first length. Then the grouped
executor's tile configs at the chunk sizes' pair counts (CUDA graphs, so no host time enters).

    PYTHONPATH=. python3 tools/explore/probe_prefill_floor.py --packed /tmp/runmap-h200/pk-olmoe --out OUT.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def host_vs_device(engine, ids: list[int], reps: int) -> dict:
    """Median seconds: host until prefill() returns, and until the device finished it."""
    toks = torch.tensor([ids], device=engine.device)
    pad = torch.zeros(1, dtype=torch.long, device=engine.device)
    issue, done = [], []
    with torch.inference_mode():
        engine.experts.begin()
        try:
            for _ in range(reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.prefill(toks, pad, pad_host=[0])
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                issue.append(t1 - t0)
                done.append(time.perf_counter() - t0)
        finally:
            engine.experts.end()
    return {"host_issue_s": statistics.median(issue[1:]), "device_done_s": statistics.median(done[1:])}


def profiled(engine, ids: list[int]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        engine.run([ids], max_new_tokens=1, ignore_eos=True)
        torch.cuda.synchronize()
    busy = launches = 0
    waits: dict[str, dict] = {}
    for ev in prof.events():
        dt = getattr(ev, "device_type", None)
        if dt is not None and "CUDA" in str(dt) and ev.device_time_total > 0 and not ev.is_legacy:
            busy += ev.device_time_total
        if ev.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += 1
        if ev.name.startswith(WAITS) and "Async" not in ev.name:
            frames = [f for f in (ev.stack or []) if "runmap" in f][:4]
            key = ev.name + " @ " + " < ".join(frames)
            w = waits.setdefault(key, {"count": 0, "us": 0.0})
            w["count"] += 1
            w["us"] += ev.cpu_time_total
    kernels: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            kernels[ev.key[:60]] = kernels.get(ev.key[:60], 0.0) + ev.device_time_total
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    return {"device_busy_us": busy, "launches": launches, "kernels_us": top,
            "waits": sorted(({"where": k, **v} for k, v in waits.items()), key=lambda r: -r["us"])[:12]}


def host_profile(engine, ids: list[int]) -> list[str]:
    pr = cProfile.Profile()
    pr.enable()
    engine.run([ids], max_new_tokens=1, ignore_eos=True)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    return s.getvalue().splitlines()[:40]


def tile_sweep(engine, tokens_list, reps: int) -> list[dict]:
    """The grouped executor at each token count's pair count, per tile config, as a CUDA graph of one layer."""
    from runmap.bench.kernel_workload import graph_us
    from runmap.kernels.executors import moe_experts

    cache = engine.experts.cache
    storage, table, layout = engine.experts.storage[0], engine.experts.tables[0], engine.experts.layout
    E, k, H = cache.num_experts, engine.cfg.top_k, engine.cfg.hidden_size
    rows = []
    int4 = [(64, 64, 128, 4, 3), (64, 128, 64, 4, 4)]  # the INT4 loop's default and the best other of the sweep
    decoded = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
               (128, 256, 64, 8, 3), (128, 128, 32, 8, 4), (64, 64, 64, 4, 4)]
    tiles = [(t, False) for t in int4] + [(t, True) for t in decoded]
    g = torch.Generator(device=engine.device).manual_seed(0)
    for T in tokens_list:
        x = torch.randn(T, H, device=engine.device, generator=g).half()
        logits = torch.randn(T, E, device=engine.device, generator=g)
        w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
        ref = None
        for (bm, bn, bk, nw, ns), dq in tiles:
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "DOWN_BLOCK_N": bn, "DOWN_BLOCK_K": bk,
                   "num_warps": nw, "num_stages": ns, "DEQUANT": dq}
            try:
                def call():
                    return moe_experts("grouped", x, ids, w.float(), storage, table, layout, validate=False,
                                       config=cfg)
                y = call()
                torch.cuda.synchronize()
                if ref is None:
                    ref = y.float()
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                us = graph_us(call, 1, reps=reps)
                flops = 2 * T * k * 3 * engine.cfg.moe_intermediate_size * H
                rows.append({"tokens": T, "tiles": [bm, bn, bk, nw, ns], "dequant": dq, "us": us,
                             "tflops": flops / us / 1e6, "max_rel_diff_vs_first": err})
                print(f"  tiles T={T} {'decoded' if dq else 'int4   '} {bm}x{bn}x{bk} w{nw} s{ns}: {us:8.1f} us "
                      f"{flops / us / 1e6:6.1f} TFLOP/s diff {err:.2e}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is a row, not the end
                rows.append({"tokens": T, "tiles": [bm, bn, bk, nw, ns], "dequant": dq,
                             "error": str(exc).splitlines()[0][:200]})
                print(f"  tiles T={T} {bm}x{bn}x{bk}: {exc}".splitlines()[0][:200], flush=True)
    return rows


def logits_composition(engine, n: int) -> dict:
    """Where the campaign's logits check at n tokens gets its difference: the engine's default (grouped, decoded
    weights from DEQUANT_MIN_PAIRS pairs per pass) and its INT4 loop (the mode off) each against the FP32 reference
    executor, the two against each other, and fused against torch non-expert ops; max |diff|, the position of the
    largest, and argmax agreement, all over every position of one n-token prompt."""
    import runmap.kernels.grouped as grouped

    ids = prompt(n, engine.cfg.vocab_size, n + 1)
    ref = engine.logits(ids, executor="reference").float()  # (T, V)
    default = engine.logits(ids).float()
    threshold = grouped.DEQUANT_MIN_PAIRS
    grouped.DEQUANT_MIN_PAIRS = 1 << 62
    try:
        int4_loop = engine.logits(ids).float()
    finally:
        grouped.DEQUANT_MIN_PAIRS = threshold
    torch_ops = engine.logits(ids, fused=False).float()

    def cmp(a, b):
        d = (a - b).abs().amax(-1)  # (T,)
        return {"max_abs": d.max().item(), "at": int(d.argmax().item()), "median_abs": d.median().item(),
                "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}

    out = {"tokens": n, "logit_scale": ref.abs().max().item(), "default_vs_reference": cmp(default, ref),
           "int4_loop_vs_reference": cmp(int4_loop, ref), "default_vs_int4_loop": cmp(default, int4_loop),
           "fused_vs_torch_ops": cmp(default, torch_ops)}
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"check {n}: {k:24s} max {v['max_abs']:.4f} at {v['at']:5d}, median {v['median_abs']:.4f}, "
                  f"argmax {v['argmax_agreement']:.4f}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--chunks", default="1024,8192")
    ap.add_argument("--tiles", default="1024,4096,8192", help="token counts of the tile sweep ('' = none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check", default="", help="prompt lengths of the logits composition ('' = none)")
    args = ap.parse_args()
    from runmap.engine.engine import Engine

    lengths = [int(v) for v in args.lengths.split(",")]
    checks = [int(v) for v in args.check.split(",") if v]
    t0 = time.perf_counter()
    engine = Engine.from_pack(args.packed, executor="grouped", max_batch=1, max_seq_len=max(lengths + checks) + 8)
    out = {"load_s": time.perf_counter() - t0, "device": torch.cuda.get_device_name(), "rows": []}
    first = None
    for chunk in (int(v) for v in args.chunks.split(",")):
        engine.prefill_chunk = chunk
        for P in lengths:
            ids = prompt(P, engine.cfg.vocab_size, P)
            t = time.perf_counter()
            engine.run([ids], max_new_tokens=1, ignore_eos=True)
            cold = time.perf_counter() - t
            ttft = statistics.median(engine.run([ids], max_new_tokens=1, ignore_eos=True).ttft_s
                                     for _ in range(args.reps))
            hd = host_vs_device(engine, ids, args.reps)
            prof = profiled(engine, ids)
            row = {"chunk": chunk, "prompt": P, "first_call_s": cold, "ttft_s": ttft, "tok_s": P / ttft, **hd, **prof}
            out["rows"].append(row)
            print(f"chunk {chunk:5d} P {P:5d}: ttft {ttft * 1e3:7.1f} ms ({P / ttft:8.0f} tok/s), host issue "
                  f"{hd['host_issue_s'] * 1e3:7.1f} ms, device done {hd['device_done_s'] * 1e3:7.1f} ms, busy "
                  f"{prof['device_busy_us'] / 1e3:7.1f} ms, {prof['launches']} launches, first call {cold:.2f} s",
                  flush=True)
            for name, us in prof["kernels_us"][:8]:
                print(f"    kernel {us / 1e3:8.2f} ms  {name}", flush=True)
            for w in prof["waits"][:3]:
                print(f"    wait {w['count']:4d} x {w['us'] / max(w['count'], 1):8.1f} us  {w['where'][:230]}",
                      flush=True)
            if first is None:
                first = ids
    out["host_profile"] = host_profile(engine, first)
    print("\n".join(out["host_profile"][:30]), flush=True)
    if checks:
        out["checks"] = [logits_composition(engine, n) for n in checks]
    if args.tiles:
        out["tiles"] = tile_sweep(engine, [int(v) for v in args.tiles.split(",")], reps=10)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
