"""GPU probe (not a test): what each kind of launch costs on a decode step's critical path, by leaving it out.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/explore/probe_step_ablation.py --packed DIR --out $OUT/ablation.json

Why: with programmatic dependent launch a kernel starts while the one before it runs, so the torch profiler's
per-kernel durations overlap (a kernel's includes its wait) and do not say what removing a launch would save; the
fused op "tails" removed two launches per layer and made the step slower (results/campaigns/h100-decode-tails; it
was removed after this probe's run, results/campaigns/h100-step-ablation).
Here each variant replaces one wrapper of the decode step by a stand-in that launches nothing and returns a
preallocated tensor of the right shape (values are garbage: timing only), builds a fresh engine (full residency,
grouped executor, CUDA graphs: the stand-ins are captured as no launch at all) and times greedy decode; the step time
it saves against the unchanged engine of the same process is that launch kind's marginal cost on the critical path.

Variants (``--only`` picks some): none (the baseline), gemv (the one-token q|k|v and o projections), attention (the
split launch with its prologue, and its combine), combine (the combine alone), norm (every residual add + RMSNorm
that is not the router's), router (the norm + router-logits launch: the residual and norm pass through), topk (the
softmax + top-k launch: a fixed route of experts 0..k-1), sum (the k-slot sum after the experts), experts (the routed
experts: the engine's own ``skip_experts``). The baseline runs first and last, so drift between them shows.
``--device cpu`` runs it in the Triton interpreter on a tiny pack (a smoke run of the mechanics, no timing worth
reading; tests/test_layout.py keeps this file listed in the README).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from runmap.atomic import write_json

VARIANTS = ("none", "gemv", "attention", "combine", "norm", "router", "topk", "sum", "experts", "none")


class StandIns:
    """Preallocated outputs by (name, shape, dtype, device), made at the first (eager) call: a captured graph then
    holds no launch and no allocation for the wrapper it replaced."""

    def __init__(self):
        self.cache: dict = {}
        self.calls = 0  # calls of the stand-in: 0 would mean the variant left nothing out

    def get(self, name: str, shape, dtype, device, fill=0.0) -> torch.Tensor:
        self.calls += 1
        key = (name, tuple(shape), dtype, str(device))
        t = self.cache.get(key)
        if t is None:
            t = self.cache[key] = torch.full(tuple(shape), fill, dtype=dtype, device=device)
        return t


@contextlib.contextmanager
def ablated(variant: str):
    """Patch the wrappers one variant leaves out (module attributes: the model imports them at each call); yields the
    StandIns, whose ``calls`` say whether the step took the patched path."""
    import runmap.kernels.fused_ops as fo
    import runmap.kernels.grouped as kg

    s = StandIns()
    patches = []
    if variant == "gemv":
        patches.append((fo, "gemv", lambda x, w, b=None: s.get("gemv", (*x.shape[:-1], w.shape[0]), x.dtype, x.device)))
    elif variant == "attention":
        def attention(qkv, q_norm, k_norm, positions, slot, inv_freq, k_cache, v_cache, pad, n_keys, *, num_heads,
                      num_kv_heads, eps):
            D = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
            return s.get("attention", (qkv.shape[0], 1, num_heads * D), qkv.dtype, qkv.device)
        patches.append((fo, "decode_attention_with_prologue", attention))
    elif variant == "combine":
        def combine(part, ml, D):
            B, nh = part.shape[:2]
            return s.get("combine", (B, 1, nh * D), torch.float16, part.device)
        patches.append((fo, "_combine_splits", combine))
    elif variant == "norm":
        def norm(x, y, w, eps):
            s.calls += 1
            return x, x
        patches.append((fo, "add_rms_norm", norm))
    elif variant == "router":
        def router(x, y, norm_w, router32, eps):
            return x, x, s.get("logits", (x.numel() // x.shape[-1], router32.shape[0]), torch.float32, x.device)
        patches.append((fo, "add_norm_router_logits", router))
    elif variant == "topk":
        def topk(logits, top_k, norm_topk_prob):
            n = logits.shape[0]
            ids = s.cache.get(("ids", n, top_k))
            s.calls += 1
            if ids is None:
                ids = s.cache[("ids", n, top_k)] = torch.arange(top_k, device=logits.device).repeat(n, 1)
            return ids, s.get("wts", (n, top_k), torch.float32, logits.device, 1.0 / top_k)
        patches.append((fo, "route_topk", topk))
    elif variant == "sum":
        def sum_topk(ypair, t, k, gs=None):
            return s.get("sum", (t, ypair.shape[1]), torch.float16, ypair.device)
        patches.append((kg, "sum_topk", sum_topk))
    elif variant not in ("none", "experts"):
        raise SystemExit(f"unknown variant {variant!r}: choose from {sorted(set(VARIANTS))}")
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, fn in patches:
            setattr(mod, name, fn)
        yield s
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def time_variant(packed: Path, variant: str, batch: int, device: str, prompt_len: int, new_tokens: int,
                 repeats: int) -> dict:
    from runmap.engine.engine import DEFAULT_FUSED, Engine

    with ablated(variant) as stand_ins:
        eng = Engine.from_pack(packed, executor="grouped", device=device, max_batch=batch,
                               max_seq_len=prompt_len + new_tokens + 8, skip_experts=variant == "experts")
        if eng.device.type == "cpu":  # the CPU build runs torch ops; the interpreter runs the fused ones here
            eng.model.fused = frozenset(DEFAULT_FUSED)
        try:
            # a different prompt per row: identical rows route identically, so a batch of them reads one row's
            # experts (the union a real batch reads is wider; results/campaigns/h100-qwen-ablation's batch 8 had this)
            vocab = eng.cfg.vocab_size
            prompts = [[(100 + 7919 * b + i) % vocab for i in range(prompt_len)] for b in range(batch)]
            rates = []
            for _ in range(repeats):
                run = eng.run(prompts, max_new_tokens=new_tokens, ignore_eos=True)
                rates.append(run.timing_dict()["decode_tok_s"])
        finally:
            eng.close()
    med = statistics.median(rates)
    if variant not in ("none", "experts") and stand_ins.calls == 0:
        raise SystemExit(f"variant {variant}: the step never called the wrapper it replaces (nothing was left out)")
    return {"variant": variant, "decode_tok_s": [round(r, 1) for r in rates], "median_tok_s": round(med, 1),
            "step_us": round(1e6 * batch / med, 1), "stand_in_calls": stand_ins.calls}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", type=Path, required=True, help="a pack (e.g. runmap synth --direct-pack at real sizes)")
    ap.add_argument("--out", type=Path, required=True, help="JSON written here (atomically)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants, in order")
    args = ap.parse_args(argv)
    rows = []
    for v in args.only.split(","):
        t0 = time.perf_counter()
        row = time_variant(args.packed, v, args.batch, args.device, args.prompt_len, args.new_tokens, args.repeats)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"{v:10s} {row['median_tok_s']:9.1f} tok/s  {row['step_us']:8.1f} us/step  {row['decode_tok_s']}",
              flush=True)
    base = [r["step_us"] for r in rows if r["variant"] == "none"]
    ref = statistics.mean(base) if base else None
    for r in rows:
        r["saved_us_per_step"] = None if ref is None or r["variant"] == "none" else round(ref - r["step_us"], 1)
    if ref is not None:
        print(f"baseline {ref:.1f} us/step (runs {base}); saved per step by leaving each out:")
        for r in rows:
            if r["variant"] != "none":
                print(f"  {r['variant']:10s} {r['saved_us_per_step']:8.1f} us")
    write_json(args.out, {"kind": "step-ablation-probe", "packed": str(args.packed), "batch": args.batch,
                          "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                          "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": rows,
                          "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


if __name__ == "__main__":
    main()
