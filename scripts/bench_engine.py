"""Engine speed / memory benchmark on one GPU (issue 5), with transformers' bf16 eager decode in the SAME run.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bench_engine.py --preset olmoe-1b-7b-0924 \
        --work /tmp/rmbench --out $OUT/h200-olmoe.json

Stages (each recorded in the JSON even if a later one fails; the file is rewritten after every stage):
  prepare   synthetic checkpoint with the preset's REAL dimensions and RANDOM weights (runmap.synth.checkpoint,
            labelled synthetic) + runmap pack, in a subprocess so its memory is not counted below
  copy_bw   device copy bandwidth measured in this run (read + write bytes / time)
  memory    full residency, batch 1, a 4,096-token context (prompt + decode): torch.cuda.max_memory_reserved
  speed     full residency, batch 1, decode captured in CUDA graphs: tok/s, ratio to the byte floor
  variants  the same decode with stages changed (no graphs, no fused prologue, other executor, routed experts
            skipped) to show where the time goes
  check     logits of the speed engine vs the reference executor (same pack), fused vs torch prologue
  partial   resident 32 of 64: same greedy tokens as full? hit rate, host->device bytes and GB/s
  hf        transformers AutoModelForCausalLM bf16, eager, greedy decode tok/s on the same checkpoint
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def write(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, out)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prepare(preset: str, work: Path, device: str) -> dict:
    from runmap.arch.config import load_preset
    from runmap.format.pack import pack_checkpoint
    from runmap.synth.checkpoint import write_synthetic

    cfg, _ = load_preset(preset)
    ck, pk = work / "ck", work / "pk"
    t0 = time.perf_counter()
    if not (ck / "config.json").is_file():
        write_synthetic(cfg, ck, seed=0, device=device, overwrite=True)
    t1 = time.perf_counter()
    if not (pk / "manifest.json").is_file():
        pack_checkpoint(ck, pk, device=device, overwrite=True)
    t2 = time.perf_counter()
    return {"synth_s": t1 - t0, "pack_s": t2 - t1, "checkpoint": str(ck), "pack": str(pk)}


def copy_bandwidth(nbytes=1 << 30, iters=10) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    sync()
    dt = (time.perf_counter() - t) / iters
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / dt  # read + write bytes per second


def byte_floor(cfg, row_bytes: int, bw: float) -> dict:
    """Bytes a batch-1 decode step must read: top_k expert rows per layer + FP16 attention, router, lm_head."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = cfg.num_layers * (cfg.num_heads * D * H * 2 + 2 * cfg.num_kv_heads * D * H) * 2
    router = cfg.num_layers * cfg.num_experts * H * 4  # fp32 copy used for routing
    shared = cfg.num_layers * 3 * H * cfg.shared_expert_intermediate_size * 2
    lm = cfg.vocab_size * H * 2
    experts = cfg.num_layers * cfg.top_k * row_bytes
    total = attn + router + shared + lm + experts
    return {"expert_bytes": experts, "nonrouted_bytes": attn + router + shared + lm, "total_bytes": total,
            "copy_bw_Bps": bw, "floor_tok_s": bw / total}


class SkipExperts:
    """Profiling stand-in: routed experts return zeros (router and everything else still run)."""

    def __init__(self, inner):
        self.inner, self.validate = inner, True

    def begin(self):
        self.inner.begin()

    def end(self):
        self.inner.end()

    def __call__(self, layer, x, ids, gw):
        return torch.zeros_like(x)

    def telemetry(self):
        return self.inner.telemetry()


def prompt_ids(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()


def timed_decode(eng, prompt, new, repeats=2):
    best = None
    for _ in range(repeats):
        res = eng.generate([prompt], max_new_tokens=new, ignore_eos=True)
        t = dict(eng.last_timing)
        if best is None or t["decode_tok_s"] > best["decode_tok_s"]:
            best = t
    return best, res[0].token_ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="olmoe-1b-7b-0924")
    ap.add_argument("--work", default="/tmp/rmbench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--executor", default="topk-fused")
    ap.add_argument("--alt-executor", default="grouped")
    ap.add_argument("--decode-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--partial", type=int, default=32)
    ap.add_argument("--hf-new", type=int, default=32)
    ap.add_argument("--stages", default="prepare,copy_bw,memory,speed,check,variants,partial,hf")
    ap.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.prepare_only:
        print(json.dumps(prepare(args.preset, work, dev)))
        return 0

    from runmap.arch.config import load_preset
    from runmap.engine.engine import Engine

    cfg, _ = load_preset(args.preset)
    stages = args.stages.split(",")
    doc = {"command": " ".join(["python3", "scripts/bench_engine.py"] + sys.argv[1:]),
           "preset": args.preset, "weights": "synthetic: real dimensions, random weights (runmap.synth.checkpoint seed 0)",
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "executor": args.executor, "stages": {}, "errors": {}}
    S = doc["stages"]

    def stage(name, fn):
        if name not in stages:
            return
        t = time.perf_counter()
        try:
            S[name] = fn()
        except Exception as e:  # keep going: later stages are independent
            doc["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"[{name}] FAILED: {e}", flush=True)
        S.setdefault(name, {})["stage_s"] = time.perf_counter() - t
        write(out, doc)
        print(f"[{name}] {time.perf_counter() - t:.1f} s", flush=True)

    def _prepare():
        r = subprocess.run([sys.executable, __file__, "--prepare-only", "--preset", args.preset, "--work",
                            str(work), "--out", str(out)], capture_output=True, text=True, env=dict(os.environ))
        if r.returncode:
            raise RuntimeError(r.stderr[-3000:])
        return json.loads(r.stdout.strip().splitlines()[-1])

    stage("prepare", _prepare)
    pk = work / "pk"
    stage("copy_bw", lambda: {"copy_bw_Bps": copy_bandwidth() if dev == "cuda" else None})
    bw = S.get("copy_bw", {}).get("copy_bw_Bps") or 4.21e12
    state = {}

    def _memory():
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        eng = Engine.from_pack(pk, executor=args.executor, device=dev, max_batch=1, max_seq_len=args.context)
        load_s = time.perf_counter() - t
        state["eng"] = eng
        new = min(64, args.context // 2)
        p = prompt_ids(cfg, args.context - new + 1, seed=1)
        eng.generate([p], max_new_tokens=new, ignore_eos=True)
        r = {"load_s": load_s, "prompt_tokens": len(p), "new_tokens": new, "context": len(p) + new - 1,
             "timing": eng.last_timing}
        if dev == "cuda":
            r["max_memory_reserved_GiB"] = torch.cuda.max_memory_reserved() / 2**30
            r["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        tel = eng.telemetry()
        r.update({k: tel[k] for k in ("resident_bytes", "spare_bytes", "staging_bytes", "nonrouted_bytes",
                                      "kv_cache_bytes", "cuda_graphs", "regime", "executor")})
        r["target_GiB"] = 5.0
        return r

    stage("memory", _memory)

    def _speed():
        eng = state.get("eng") or Engine.from_pack(pk, executor=args.executor, device=dev, max_batch=1,
                                                   max_seq_len=args.context)
        state["eng"] = eng
        p = prompt_ids(cfg, args.prompt_len, seed=2)
        eng.generate([p], max_new_tokens=16, ignore_eos=True)  # warm-up: graph capture for the first bucket
        best, toks = timed_decode(eng, p, args.decode_len)
        state["full_tokens"] = toks
        fl = byte_floor(cfg, eng.experts.cache.row_bytes, bw)
        r = {"prompt_tokens": len(p), "new_tokens": args.decode_len, "timing": best,
             "decode_tok_s": best["decode_tok_s"], "byte_floor": fl,
             "ratio_to_floor": best["decode_tok_s"] / fl["floor_tok_s"],
             "floor_tok_s_design": 3600.0, "ratio_to_design_floor": best["decode_tok_s"] / 3600.0,
             "target_tok_s": 800.0}
        if dev == "cuda":
            r["max_memory_reserved_GiB_after_speed"] = torch.cuda.max_memory_reserved() / 2**30
        return r

    stage("speed", _speed)

    def _check():
        eng = state["eng"]
        p = prompt_ids(cfg, 24, seed=3)
        a = eng.logits(p)
        ex = eng.experts.executor
        eng.experts.executor = "reference"
        b = eng.logits(p)
        eng.experts.executor = ex
        fused = eng.model.fused
        eng.model.fused = frozenset()
        c = eng.logits(p)
        eng.reset_graphs()
        q = prompt_ids(cfg, args.prompt_len, seed=2)
        torch_tokens = eng.generate([q], max_new_tokens=32, ignore_eos=True)[0].token_ids
        eng.model.fused = fused
        eng.reset_graphs()
        full = state.get("full_tokens") or []
        scale = b.abs().max().item()
        return {"executor_vs_reference_max_abs": (a - b).abs().max().item(),
                "fused_vs_torch_ops_max_abs": (a - c).abs().max().item(), "logit_scale": scale,
                "argmax_agree_executor_vs_reference": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                "decode_32_tokens_fused_graphs_equal_torch_ops_graphs": full[:32] == torch_tokens[:len(full[:32])]}

    stage("check", _check)

    def _variants():
        eng = state["eng"]
        p = prompt_ids(cfg, args.prompt_len, seed=2)
        n = min(128, args.decode_len)
        r = {}
        all_ops = eng.model.fused

        def run(name):
            eng.reset_graphs()
            eng.generate([p], max_new_tokens=16, ignore_eos=True)
            best, _ = timed_decode(eng, p, n)
            r[name] = best["decode_tok_s"]
            print(f"  variant {name}: {r[name]:.1f} tok/s", flush=True)

        from runmap.engine.engine import FUSED_OPS

        run("graphs, default fused ops (main)")
        for op in sorted(FUSED_OPS):
            eng.model.fused = all_ops ^ {op}
            run(f"graphs, {'without' if op in all_ops else 'with'} fused {op}")
        eng.model.fused = frozenset()
        run("graphs, no fused ops (torch)")
        eng.model.fused = all_ops
        eng.experts.executor = args.alt_executor
        run(f"graphs, executor {args.alt_executor}")
        eng.experts.executor = args.executor
        inner = eng.experts
        eng.experts = SkipExperts(inner)
        run("graphs, routed experts skipped (non-expert cost)")
        eng.experts = inner
        eng.use_graphs = False
        run("no graphs (eager)")
        if dev == "cuda":  # kernels launched by one eager decode step = nodes of the captured graph
            from torch.profiler import ProfilerActivity, profile

            tok = torch.tensor([p[-1]], device=dev)
            pad = torch.zeros(1, dtype=torch.long, device=dev)
            with torch.inference_mode():
                eng.experts.begin()
                eng.decode(tok, len(p) + 1, pad)
                sync()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    eng.decode(tok, len(p) + 1, pad)
                    sync()
                eng.experts.end()
            ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0)]
            ev = sorted(ev, key=lambda e: -getattr(e, "device_time_total", 0))
            r["eager_step_kernels"] = int(sum(e.count for e in ev))
            r["eager_step_top"] = [(e.key[:80], e.count, round(getattr(e, "device_time_total", 0), 1)) for e in ev[:15]]
        eng.use_graphs = dev == "cuda"
        eng.reset_graphs()
        return r

    stage("variants", _variants)

    def _partial():
        full_tokens = state.get("full_tokens")
        state.pop("eng", None)
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        eng = Engine.from_pack(pk, executor=args.executor, device=dev, max_batch=1, max_seq_len=1024,
                               resident=args.partial)
        p = prompt_ids(cfg, args.prompt_len, seed=2)
        t0 = eng.telemetry()
        n = min(64, args.decode_len)
        res = eng.generate([p], max_new_tokens=n, ignore_eos=True)[0]
        t1 = eng.telemetry()
        dh2d = t1["bytes_h2d"] - t0["bytes_h2d"]
        dt = t1["h2d_seconds"] - t0["h2d_seconds"]
        hits, misses = t1["hits"] - t0["hits"], t1["misses"] - t0["misses"]
        r = {"resident": args.partial, "new_tokens": n, "timing": eng.last_timing,
             "same_tokens_as_full": (full_tokens[:n] == res.token_ids) if full_tokens else None,
             "first_divergence": next((i for i, (x, y) in enumerate(zip(full_tokens or [], res.token_ids)) if x != y),
                                      None),
             "hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1), "bytes_h2d": dh2d,
             "miss_transaction_s": dt, "h2d_GBps_effective": (dh2d / dt / 1e9) if dt > 0 else None,
             "observations": t1["observations"], "generations": t1["generations"]}
        del eng
        gc.collect()
        return r

    stage("partial", _partial)

    def _hf():
        from transformers import AutoModelForCausalLM

        state.clear()
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(work / "ck"), dtype=torch.bfloat16).to(dev).eval()
        load_s = time.perf_counter() - t
        ids = torch.tensor([prompt_ids(cfg, args.prompt_len, seed=2)], device=dev)

        def gen(n):
            sync()
            t = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            sync()
            return time.perf_counter() - t

        gen(4)  # warm-up
        t1, tn = gen(1), gen(args.hf_new)
        tok_s = (args.hf_new - 1) / (tn - t1)
        r = {"load_s": load_s, "new_tokens": args.hf_new, "decode_tok_s": tok_s, "attn": model.config._attn_implementation}
        if dev == "cuda":
            r["max_memory_reserved_GiB"] = torch.cuda.max_memory_reserved() / 2**30
        sp = S.get("speed", {}).get("decode_tok_s")
        if sp:
            r["engine_over_hf"] = sp / tok_s
        return r

    stage("hf", _hf)
    write(out, doc)
    # short table last
    rows = [("decode tok/s (full, graphs)", S.get("speed", {}).get("decode_tok_s")),
            ("ratio to byte floor (same-run copy bw)", S.get("speed", {}).get("ratio_to_floor")),
            ("HF bf16 eager tok/s", S.get("hf", {}).get("decode_tok_s")),
            ("engine / HF", S.get("hf", {}).get("engine_over_hf")),
            ("peak reserved GiB @4096 ctx", S.get("memory", {}).get("max_memory_reserved_GiB")),
            ("partial same tokens", S.get("partial", {}).get("same_tokens_as_full")),
            ("partial hit rate", S.get("partial", {}).get("hit_rate")),
            ("partial h2d GB/s", S.get("partial", {}).get("h2d_GBps_effective"))]
    for k, v in rows:
        print(f"{k:42s} {v if not isinstance(v, float) else round(v, 3)}")
    print("variants:", json.dumps(S.get("variants", {})))
    print("check:", json.dumps(S.get("check", {})))
    print("errors:", list(doc["errors"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
