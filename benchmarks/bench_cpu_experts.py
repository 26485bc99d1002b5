"""The cpu-int4 site's rate in GB/s of expert bytes against this machine's host memory-read bandwidth, measured
in the same run (issue 25 item 1: target >= 0.6 of the read bandwidth).

For each expert shape (OLMoE: H 2048, I 1024, top-8; Qwen1.5-MoE: H 2048, I 1408, top-4) a host source
(runmap.residency.host_source.HostSource) of random qpacked experts is built, larger than the last-level
cache, so that both the bandwidth probe and the experts are read from DRAM. The site repacks every expert once
(timed and its bytes recorded), then one MoE layer call per step routes each token to k experts taken from a
random permutation so that consecutive steps never reuse an expert (no cache reuse across steps):

* batch 1: k experts, one token each;
* batch 4 distinct: 4 tokens with disjoint experts (the union is 4k experts, one token each);
* batch 4 shared: 4 tokens with the same k experts (k experts, 4 tokens each).

GB/s counts the qpacked row bytes of the union (the pack's expert bytes); the repacked copy the kernel reads
is ``repack.bytes_per_row_byte`` times that. The host read bandwidth is a torch int64 sum over a buffer of at
least 1 GiB (and at least 2x the last-level cache), best of N, with the same threads. The record names the
machine and its load (os.getloadavg before and after): this development machine's 2 cores are shared.

``--call-path`` says what one timed layer call is. ``engine`` (the default for the cpu-native executors): what the
engine's decode pays on the CPU for a layer's CPU part, ``CpuExpertSite.prepare_subset_arrays`` on host arrays (the
checks, the assignment table, the FP16 activations widened) and then the prepared call, both inside the timed span.
``layer``: ``CpuExpertSite.moe`` on torch tensors (the per-layer API every executor has; the only one of cpu-int4).

``--workers`` (issue 25 item 1: the experts of a layer call computed concurrently, kernels/cpu_int4.py
``CpuExpertSite(workers=...)``) repeats every mode per worker count W at each thread count T: W workers with
max(1, T // W) torch threads each, so that every row spends the same thread budget as the read bandwidth it is
divided by (W > T is skipped). Each row records its workers, threads_per_worker and whether the layer output on
the spot-check batch is bitwise the one-worker output. A table of every row ends the run.

    PYTHONPATH=. python3 benchmarks/bench_cpu_experts.py --out results/cpu-experts/dev-2core.json
    PYTHONPATH=. python3 benchmarks/bench_cpu_experts.py --out $OUT/h200-workers.json --threads all --workers 1,2,4,8,all
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from runmap.atomic import write_json
from runmap.format.qpack import RowLayout
from runmap.kernels.cpu_int4 import SITE_EXECUTORS, TOLERANCE, CpuExpertSite
from runmap.kernels.cpu_native import EXECUTOR_PRECISION, TOLERANCE as NATIVE_TOLERANCE
from runmap.kernels.reference import reference_moe_f32
from runmap.provenance import library_versions, utc_timestamp
from runmap.residency.host_source import HostSource

KIND = "cpu-experts-bench"
TARGET = 0.6
SHAPES = {  # name: (hidden, intermediate, top_k)
    "olmoe": (2048, 1024, 8),
    "qwen1.5-moe": (2048, 1408, 4),
}


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult if text.rstrip("KMG").isdigit() else None


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    llc = None
    for idx in (3, 2):
        llc = _read_int(f"/sys/devices/system/cpu/cpu0/cache/index{idx}/size")
        if llc:
            break
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"host": platform.node(), "cpu": model, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "last_level_cache_bytes": llc, "memory_bytes": mem, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def read_bandwidth(nbytes: int, repeats: int) -> dict:
    """Best-of-N GB/s of an int64 sum (reads only) and of a copy (reads + writes, both counted)."""
    a = torch.ones(nbytes // 8, dtype=torch.int64)
    b = torch.empty_like(a)
    sums, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        sums.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b.copy_(a)
        copies.append(time.perf_counter() - t0)
    return {"bytes": a.nbytes, "repeats": repeats, "read_gbs": round(a.nbytes / min(sums) / 1e9, 3),
            "read_gbs_median": round(a.nbytes / sorted(sums)[len(sums) // 2] / 1e9, 3),
            "copy_gbs": round(2 * a.nbytes / min(copies) / 1e9, 3)}


def random_rows(layout: RowLayout, n: int, gen: torch.Generator) -> torch.Tensor:
    """n qpacked rows: random nibbles in 1..15 (q in -7..7) and FP16 scales in [0.004, 0.02]."""
    rows = torch.zeros(n, layout.row_bytes, dtype=torch.uint8)
    for proj in ("gate", "up", "down"):
        w, s = layout.section(f"{proj}.weight"), layout.section(f"{proj}.scale")
        lo = torch.randint(1, 16, (n, w.nbytes), dtype=torch.uint8, generator=gen)
        hi = torch.randint(1, 16, (n, w.nbytes), dtype=torch.uint8, generator=gen)
        rows[:, w.offset:w.offset + w.nbytes] = lo | (hi << 4)
        scales = (0.004 + 0.016 * torch.rand(n, s.nbytes // 2, generator=gen)).to(torch.float16)
        rows[:, s.offset:s.offset + s.nbytes] = scales.view(torch.uint8)
    return rows


def steps_for(mode: str, k: int, perm: list[int], step: int) -> list[list[int]]:
    """Routed ids per token of one step; consecutive steps walk on through the permutation."""
    e = len(perm)
    if mode == "b1":
        return [[perm[(step * k + j) % e] for j in range(k)]]
    if mode == "b4-distinct":
        return [[perm[(step * 4 * k + t * k + j) % e] for j in range(k)] for t in range(4)]
    return [[perm[(step * k + j) % e] for j in range(k)]] * 4  # b4-shared


def configs(threads: list[int], workers: list[int | str]) -> list[tuple[int, int, int]]:
    """(threads, workers, threads_per_worker) rows: each thread count with each worker count ('all' = that many
    workers, one thread each) that fits in it."""
    out = []
    for nt in threads:
        for w in dict.fromkeys(nt if w == "all" else w for w in workers):
            if w <= nt:
                out.append((nt, w, max(1, nt // w)))
    return out


def run_shape(name: str, hidden: int, inter: int, k: int, min_bytes: int, passes: int, seed: int,
              threads: list[int], read: dict, mode_seconds: float, workers: list[int | str] = (1,),
              executor: str = "cpu-int4", call_path: str = "layer") -> dict:
    layout = RowLayout.build(hidden, inter, 256)
    n = max(8 * k, math.ceil(min_bytes / layout.row_bytes))
    gen = torch.Generator().manual_seed(seed)
    rows = random_rows(layout, n, gen)
    host = HostSource.from_rows([rows], layout)
    del rows
    site = CpuExpertSite(host, workers=1, executor=executor)
    t0 = time.perf_counter()
    site.prepare()
    repack_s = time.perf_counter() - t0
    perm = torch.randperm(n, generator=gen).tolist()
    out = {"hidden": hidden, "intermediate": inter, "top_k": k, "block_size": 256, "row_bytes": layout.row_bytes,
           "experts": n, "expert_bytes": n * layout.row_bytes,
           "repack": {"seconds": round(repack_s, 3), "bytes": site.nbytes,
                      "bytes_per_row_byte": round(site.nbytes / (n * layout.row_bytes), 4)},
           "runs": []}
    # one correctness spot check on the benchmark's own data (the tests hold the shapes to the tolerance)
    cids = torch.tensor(steps_for("b4-distinct", k, perm, 0))
    cx = torch.randn(4, hidden, generator=gen).to(torch.float16)
    cw = torch.softmax(torch.randn(4, k, generator=gen), dim=1)
    union = sorted(set(cids.flatten().tolist()))
    table = torch.full((n,), -1, dtype=torch.int32)
    table[union] = torch.arange(len(union), dtype=torch.int32)
    storage = torch.stack([host.row_tensor(0, e) for e in union])  # a copy of the routed rows, for the reference
    ref = reference_moe_f32(cx, cids, cw, storage, table, layout)
    serial = site.moe(0, cx, cids, cw)
    serial_b1 = site.moe(0, cx[:1], cids[:1], cw[:1])
    err = float((serial.float() - ref).norm() / ref.norm())
    # the native paths' bound after the float16 output's rounding (i16: its own bound, larger than that rounding)
    tol = NATIVE_TOLERANCE["fp16-output"] if executor in EXECUTOR_PRECISION else TOLERANCE["bf16"]
    out["check"] = {"rel_error": err, "tolerance": tol, "pass": err <= tol}
    current = None
    for nt, nw, tpw, mode in [(*c, m) for c in configs(threads, workers) for m in ("b1", "b4-distinct", "b4-shared")]:
        torch.set_num_threads(nt)
        if current != (nt, nw, tpw):  # the same repacked experts, a new pool: the spot check again, bitwise
            current = (nt, nw, tpw)
            if executor not in EXECUTOR_PRECISION:  # the native kernel takes the calling thread's torch threads
                site.set_workers(nw, tpw)
            same = (torch.equal(site.moe(0, cx, cids, cw), serial)
                    and torch.equal(site.moe(0, cx[:1], cids[:1], cw[:1]), serial_b1))
        batch = 1 if mode == "b1" else 4
        per_pass = math.ceil(n / (k * (4 if mode == "b4-distinct" else 1)))
        x = torch.randn(batch, hidden, generator=gen).to(torch.float16)
        w = torch.softmax(torch.randn(batch, k, generator=gen), dim=1)
        step_ids = [torch.tensor(steps_for(mode, k, perm, s)) for s in range(per_pass)]
        call = layer_call(site, call_path, x, w)
        for ids in step_ids[:2]:  # warm-up: first-call allocations, thread pool start
            call(ids)
        rates, step_s, t_mode = [], [], time.perf_counter()
        for _ in range(passes):
            if rates and time.perf_counter() - t_mode > mode_seconds:  # a contended machine: keep the run bounded
                break
            nbytes, t = 0, 0.0
            for ids in step_ids:
                t0 = time.perf_counter()
                call(ids)
                dt = time.perf_counter() - t0
                t += dt
                step_s.append(dt)
                nbytes += len(set(ids.flatten().tolist())) * layout.row_bytes
            rates.append(nbytes / t / 1e9)
        step_s.sort()
        out["runs"].append({"mode": mode, "batch": batch, "threads": nt, "workers": nw, "threads_per_worker": tpw,
                            "bitwise_equal_to_serial": same, "steps_per_pass": per_pass, "passes": len(rates),
                            "union_experts": len(set(step_ids[0].flatten().tolist())),
                            "gbs": round(max(rates), 3), "gbs_median": round(sorted(rates)[len(rates) // 2], 3),
                            "step_ms_median": round(1e3 * step_s[len(step_s) // 2], 3)})
        r = out["runs"][-1]
        r["ratio_to_read"] = round(r["gbs"] / read[nt], 3)  # against the read bandwidth at the same threads
        r["target_met"] = r["ratio_to_read"] >= TARGET
        print(f"{name:12s} {mode:12s} threads {nt} workers {nw}x{tpw}: {r['gbs']:6.2f} GB/s of expert bytes (median "
              f"{r['gbs_median']:.2f}), {r['ratio_to_read']:.2f} of the {read[nt]:.2f} GB/s host read -> target "
              f"{TARGET} {'met' if r['target_met'] else 'NOT met'}; step {r['step_ms_median']:.2f} ms", flush=True)
    site.close()
    del site, host
    return out


def layer_call(site: CpuExpertSite, call_path: str, x: torch.Tensor, w: torch.Tensor):
    """One timed layer call on layer 0 for routed ids (T, k), by ``call_path`` (module docstring). The engine path's
    inputs are host arrays made once per mode, as the engine's decode keeps them in pinned host buffers; the set of
    experts computed here is every routed one (the engine's lease names them)."""
    if call_path == "layer":
        return lambda ids: site.moe(0, x, ids, w)
    x_np, w_np = x.numpy(), w.numpy().astype(np.float32)
    out = np.empty((x.shape[0], x.shape[1]), dtype=np.float32)
    ids_np = {}

    def call(ids):
        key = id(ids)
        if key not in ids_np:  # the ids as the engine holds them (an int array) and the experts its lease names
            ids_np[key] = (ids.numpy().astype(np.int64), tuple(sorted(set(ids.flatten().tolist()))))
        arr, experts = ids_np[key]
        site.prepare_subset_arrays(0, x_np, arr, w_np, experts, out)()
    return call


def table(rec: dict) -> str:
    """One line per run: the numbers a reader compares across worker counts."""
    lines = [f"{'shape':12s} {'mode':12s} {'thr':>3s} {'wrk':>3s} {'t/w':>3s} {'GB/s':>7s} {'read':>7s} "
             f"{'ratio':>5s} {'met':>3s} {'step ms':>8s} bitwise"]
    read = {r["threads"]: r["read_gbs"] for r in rec["host_read"]}
    for name, sh in rec["shapes"].items():
        for r in sh["runs"]:
            lines.append(f"{name:12s} {r['mode']:12s} {r['threads']:3d} {r['workers']:3d} {r['threads_per_worker']:3d} "
                         f"{r['gbs']:7.2f} {read[r['threads']]:7.2f} {r['ratio_to_read']:5.2f} "
                         f"{'yes' if r['target_met'] else 'no':>3s} {r['step_ms_median']:8.2f} "
                         f"{'yes' if r['bitwise_equal_to_serial'] else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="record path (results/cpu-experts/<machine>.json)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    p.add_argument("--passes", type=int, default=5, help="passes over every expert per mode (best and median kept)")
    p.add_argument("--bandwidth-repeats", type=int, default=7)
    p.add_argument("--mode-seconds", type=float, default=20.0,
                   help="no further pass of a mode starts after this many seconds (at least one pass runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", default="all,1",
                   help="comma-separated torch thread counts ('all' = torch's default, every core); default all,1: "
                        "on a shared machine one thread shows the kernel without waits for a busy second core")
    p.add_argument("--workers", default="1",
                   help="comma-separated CpuExpertSite worker counts ('all' = one per thread of the run's thread "
                        "count); each runs with max(1, threads // workers) torch threads per worker; default 1 "
                        "(the serial site)")
    p.add_argument("--executor", choices=SITE_EXECUTORS, default="cpu-int4",
                   help="the CPU site's kernel: cpu-int4 (torch's int4 matmul over repacked copies, bf16), "
                        "cpu-native (kernels/cpu_native.c over the host rows, fp32) or cpu-native-i16 (the same with "
                        "int16 activations and integer dot products); the native ones need --workers 1")
    p.add_argument("--call-path", choices=("engine", "layer"), default=None,
                   help="what one timed layer call is: engine (the cpu-native executors' default: the engine's decode "
                        "path, prepare_subset_arrays on host arrays then the call) or layer (CpuExpertSite.moe on "
                        "torch tensors; the only path of cpu-int4)")
    args = p.parse_args(argv)
    call_path = args.call_path or ("engine" if args.executor in EXECUTOR_PRECISION else "layer")
    if call_path == "engine" and args.executor not in EXECUTOR_PRECISION:
        print(f"bench_cpu_experts: --call-path engine needs a cpu-native executor ({', '.join(EXECUTOR_PRECISION)}); "
              f"{args.executor} has only the layer path", file=sys.stderr)
        return 2
    every = torch.get_num_threads()
    try:
        workers = [w.strip() if w.strip() == "all" else int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        workers = []
    if not workers or any(w != "all" and w < 1 for w in workers):
        print(f"bench_cpu_experts: --workers must be 'all' or positive integers, got {args.workers!r}", file=sys.stderr)
        return 2
    try:
        threads = [every if t.strip() == "all" else int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        threads = []
    if not threads or any(t < 1 for t in threads):
        print(f"bench_cpu_experts: --threads must be 'all' or positive integers, got {args.threads!r}", file=sys.stderr)
        return 2
    threads = list(dict.fromkeys(threads))
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes or args.passes < 1 or args.bandwidth_repeats < 1:
        print(f"bench_cpu_experts: shapes from {list(SHAPES)} (got {unknown or shapes}), --passes and "
              "--bandwidth-repeats >= 1", file=sys.stderr)
        return 2
    if args.executor in EXECUTOR_PRECISION and workers != [1]:
        print("bench_cpu_experts: --workers applies to --executor cpu-int4; cpu-native runs one parallel region per "
              "layer call (give --workers 1)", file=sys.stderr)
        return 2
    skipped = [(nt, w) for nt in threads for w in workers if w != "all" and w > nt]
    if skipped:
        print(f"bench_cpu_experts: skipping (threads, workers) {skipped}: more workers than the thread budget",
              file=sys.stderr)
    info = machine()
    # the probe and the expert set both exceed the last-level cache, so both are DRAM reads
    min_bytes = max(1 << 30, 2 * (info["last_level_cache_bytes"] or 0))
    rec = {"kind": KIND, "command": " ".join(["python3", "benchmarks/bench_cpu_experts.py"]
                                            + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]),
           "created_utc": utc_timestamp(), "machine": info, "versions": library_versions("numpy"),
           "executor": args.executor, "call_path": call_path, "precision": EXECUTOR_PRECISION.get(args.executor, "bf16"),
           "load_before": load(), "target_ratio": TARGET}
    if args.executor in EXECUTOR_PRECISION:  # the kernel's software prefetch distance ($RUNMAP_CPU_NATIVE_PREFETCH)
        from runmap.kernels.cpu_native import prefetch_bytes

        rec["prefetch_bytes"] = prefetch_bytes()
    t0 = time.perf_counter()
    rec["host_read"] = []
    for nt in threads:
        torch.set_num_threads(nt)
        rec["host_read"].append(dict(read_bandwidth(min_bytes, args.bandwidth_repeats), threads=nt))
        print(f"host read, threads {nt}: {rec['host_read'][-1]['read_gbs']:.2f} GB/s", flush=True)
    read = {r["threads"]: r["read_gbs"] for r in rec["host_read"]}
    rec["shapes"] = {}
    for i, name in enumerate(shapes):
        rec["shapes"][name] = run_shape(name, *SHAPES[name], min_bytes=min_bytes, passes=args.passes,
                                        seed=args.seed + i, threads=threads, read=read,
                                        mode_seconds=args.mode_seconds, workers=workers, executor=args.executor,
                                        call_path=call_path)
    torch.set_num_threads(every)
    # each (shape, mode) at all cores: met by at least one of the worker counts run (the site can be configured to
    # meet it); with --workers 1 this is every all-core run, as before the option
    best: dict[tuple[str, str], bool] = {}
    for sname, sh in rec["shapes"].items():
        for r in sh["runs"]:
            if r["threads"] == every:
                best[sname, r["mode"]] = best.get((sname, r["mode"]), False) or r["target_met"]
    rec["target_met_all_cores"] = bool(best) and all(best.values())  # False when no run used all cores
    rec["load_after"] = load()
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, rec)
    print(table(rec))
    print(f"load {rec['load_before']} -> {rec['load_after']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
