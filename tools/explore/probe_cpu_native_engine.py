"""Why the cpu-native site is slower inside the engine than alone (h200-cpu-native campaign: the build-time cost
measurement saw 0.23 GB/s on one expert where bench_cpu_experts saw 44 GB/s on eight; placement cpu decoded
58 tok/s where the kernel's bytes allow ~200). One process per variant (OpenMP reads its environment once):

* which OpenMP runtimes the process has loaded (/proc/self/maps), torch's and the kernel's; variants: the default
  and OMP_WAIT_POLICY=PASSIVE (the committed run, at 857cb91, also had a variant linking the compiler's libgomp
  where the kernel then linked torch's file: no difference beyond the run's spread, and that option was removed);
* inside an engine built for placement cpu at RESIDENT of 64 (calibrated routing): one expert at batch 1 and a
  4-expert layer call timed 30 times each (best, median) at several OpenMP thread counts, then a 64-token decode
  per thread count, and one decode under cProfile (host functions by own time).

    PYTHONPATH=. python3 tools/explore/probe_cpu_native_engine.py --pack /tmp/runmap-h200/pk-olmoe --out $OUT/probe.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path


def loaded_openmp() -> list[str]:
    libs = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if "/" in line else ""
        if "gomp" in path or "libomp" in path or "iomp" in path:
            libs.add(path)
    return sorted(libs)


def timed(fn, n=30):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return {"best_ms": round(1e3 * min(out), 4), "median_ms": round(1e3 * statistics.median(out), 4)}


def child(a) -> dict:
    import torch

    from runmap.engine.engine import Engine

    row = {"env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS",
                                                  "RUNMAP_CPU_NATIVE_OPENMP")},
           "torch_threads": torch.get_num_threads()}
    eng = Engine.from_pack(a.pack, resident=a.resident, device="cuda", max_batch=1, max_seq_len=160,
                           routing="calibrated:olmoe", expert_placement="cpu")
    site = eng.experts.cpu_site
    row["openmp_loaded"] = loaded_openmp()
    row["placement_costs"] = eng.experts.placement.describe().get("costs") if hasattr(eng.experts.placement, "costs") else None
    h = eng.cfg.hidden_size
    x = torch.randn(1, h).to(torch.float16)
    ids = torch.tensor([[1, 7, 20, 33]])
    w = torch.full((1, 4), 0.25)
    prompts = [[(17 * i) % 1000 + 5 for i in range(32)]]
    eng.run(prompts, max_new_tokens=8, ignore_eos=True)  # warm-up (graphs, first calls)
    row["threads"] = {}
    for t in [int(v) for v in a.threads.split(",")]:
        site.native_threads = t
        r = {"one_expert": timed(lambda: site.expert_output(0, 0, x)),
             "four_experts": timed(lambda: site.moe(0, x, ids, w))}
        r["one_expert_gb_s"] = round(eng.experts.layout.row_bytes / r["one_expert"]["best_ms"] / 1e6, 2)
        r["four_experts_gb_s"] = round(4 * eng.experts.layout.row_bytes / r["four_experts"]["best_ms"] / 1e6, 2)
        runs = [eng.run(prompts, max_new_tokens=64, ignore_eos=True).decode_tok_s for _ in range(2)]
        r["decode_tok_s"] = [round(v, 2) for v in runs]
        row["threads"][t] = r
        print(row["env"], t, r, flush=True)
    if a.profile:
        site.native_threads = None
        pr = cProfile.Profile()
        pr.enable()
        eng.run(prompts, max_new_tokens=32, ignore_eos=True)
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        row["profile_tottime"] = s.getvalue()[-5000:]
        print(row["profile_tottime"], flush=True)
    eng.close()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True)
    ap.add_argument("--resident", type=int, default=30)
    ap.add_argument("--threads", default="16,15,14,8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    rows = []
    for env, profile in (({}, True), ({"OMP_WAIT_POLICY": "PASSIVE"}, False)):
        cmd = [sys.executable, __file__, "--child", "--pack", a.pack, "--resident", str(a.resident),
               "--threads", a.threads] + (["--profile"] if profile else [])
        p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=240)
        sys.stdout.write(p.stdout[-6000:])
        sys.stderr.write(p.stderr[-3000:])
        res = [ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        rows.append(json.loads(res[0]) if res else {"env": env, "error": p.stderr[-2000:]})
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
