"""How the synthetic checkpoints route, next to the calibrated routing model of the same family.

For each model and generator init (runmap/synth/checkpoint.py INITS): write the synthetic checkpoint, pack it,
run what `runmap generate --trace` runs over several prompts (batched), greedy and at temperature 1 (one stream per prompt and
mode), and from the traces compute per layer

* the expert-load CV (std / mean of how often each expert was routed, over every step of every stream), and
* the LRU and Belady hit rates at 1, 2 and 4 x top-k experts per layer (sizes below the expert count only),
  each stream replayed from an empty cache over all its steps (prompt then decode), like the published
  512-token measurements the calibrated model was fitted to.

The calibrated model of the family (runmap/workload/calibration.py) is simulated with the same layers,
streams and stream lengths, so its CV (which grows with fewer tokens: counting noise) and its curve are
compared on equal terms.

    python tools/explore/probe_synth_routing.py --out results/routing/synth-probe.json

"small-olmoe" is OLMoE-1B-7B's hidden size, heads, experts and top-k (the dimensions that set the ratio of
embeddings to layer outputs, and the cache sizes) with 4 layers, expert width 256 and a 4096-token
vocabulary, so that it runs on a CPU; tiny-olmoe is the test preset (8 experts: only 1 x top-k is below E).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SCHEMA = "runmap-synth-routing-probe-v1"


def small_olmoe():
    from runmap.arch.config import load_preset

    cfg, _ = load_preset("olmoe-1b-7b-0924")
    return dataclasses.replace(cfg, num_layers=4, moe_intermediate_size=256, vocab_size=4096,
                               max_position_embeddings=1024, eos_token_id=2)


def model_config(name: str):
    from runmap.arch.config import load_preset

    return small_olmoe() if name == "small-olmoe" else load_preset(name)[0]


FAMILY = {"olmoe": "olmoe", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}


def prompts(n: int, words: int) -> list[str]:
    """n different slices of the tokenizer's corpus (natural text, so tokens repeat as in real prompts)."""
    from runmap.synth.corpus import CORPUS

    w = CORPUS.split()
    step = max(1, (len(w) - words) // max(1, n))
    return [" ".join(w[i * step:i * step + words]) for i in range(n)]


def layer_metrics(per_layer: list[list[list[list[int]]]], num_experts: int, top_k: int) -> dict:
    """per_layer[layer][stream] = step list. Per-layer load CV and LRU / Belady hit rates at 1, 2, 4 x top_k."""
    from runmap.workload import replay

    caps = [m * top_k for m in (1, 2, 4) if m * top_k < num_experts]
    cv, lru, bel = [], {c: [] for c in caps}, {c: [] for c in caps}
    for streams in per_layer:
        counts = np.bincount([e for steps in streams for s in steps for e in s], minlength=num_experts).astype(float)
        cv.append(float(counts.std() / counts.mean()))
        for c in caps:
            lru[c].append(replay.hit_rate(streams, c, "lru"))
            bel[c].append(replay.hit_rate(streams, c, "belady"))
    return {"load_cv_per_layer": [round(x, 3) for x in cv],
            "load_cv_mean": round(float(np.mean(cv)), 3),
            "lru_per_layer": {str(c): [round(x, 3) for x in v] for c, v in lru.items()},
            "lru": {str(c): round(float(np.mean(v)), 3) for c, v in lru.items()},
            "belady": {str(c): round(float(np.mean(v)), 3) for c, v in bel.items()}}


def calibrated_metrics(family: str, cfg, lengths: list[int], seed: int) -> dict:
    """The calibrated model of ``family`` at the checkpoint's experts, top-k and layers, one stream per length."""
    from runmap.workload.calibration import FAMILIES, StreamSampler, popularity

    p = FAMILIES[family].params
    rng = np.random.default_rng(seed)
    pop = np.stack([popularity(p, cfg.num_experts, rng) for _ in range(cfg.num_layers)])
    per_layer = [[] for _ in range(cfg.num_layers)]
    for n in lengths:
        s = StreamSampler(p, pop, cfg.top_k, rng)
        steps = np.stack([s.next() for _ in range(n)])
        for l in range(cfg.num_layers):
            per_layer[l].append(steps[:, l].tolist())
    return layer_metrics(per_layer, cfg.num_experts, cfg.top_k)


def quiet(argv: list[str]) -> int:
    """runmap's CLI in this process, its output kept off the probe's (shown when it fails)."""
    from runmap.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"runmap {' '.join(argv[:1])} failed ({rc}): {err.getvalue()[-2000:]}")
    return rc


def probe(model: str, init: str, work: Path, args) -> dict:
    from runmap.engine.engine import Engine
    from runmap.synth.checkpoint import embedding_std, write_synthetic
    from runmap.workload.trace import read_trace, write_trace

    cfg = model_config(model)
    ck, pk = work / f"{model}-{init}-ckpt", work / f"{model}-{init}-pack"
    t0 = time.time()
    write_synthetic(cfg, ck, seed=args.seed, init=init, overwrite=True)
    quiet(["pack", str(ck), str(pk), "--force", "--no-progress", "--device", "cpu"])
    built = time.time() - t0
    out = {"model": model, "init": init, "embedding_std": round(embedding_std(cfg, init), 5),
           "num_layers": cfg.num_layers, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
           "hidden_size": cfg.hidden_size, "seed": args.seed, "modes": {}}
    texts = prompts(args.prompts, args.prompt_words)
    # The path of `runmap generate --trace` (Engine.from_pack with record_routes, generate, routes.trace(),
    # write_trace), with every prompt of a mode in one batch: one stream per row, as the trace format has it,
    # and one engine per checkpoint (on this CPU a fresh process per prompt cost minutes of start-up each).
    # FP16 experts are the pack's INT4 experts dequantized once (the same values the reference executor
    # dequantizes at every step), so the routes are the INT4 model's; on a CPU they decode several times faster.
    eng = Engine.from_pack(pk, executor="reference", device="cpu", max_batch=len(texts), record_routes=True,
                           max_seq_len=args.max_seq_len, expert_format=args.expert_format)
    for mode, temp in (("greedy", 0.0), ("temperature-1", 1.0)):
        eng.routes._groups.clear()  # this mode's streams only
        eng.generate(texts, max_new_tokens=args.new_tokens, temperature=temp, seed=0, ignore_eos=True)
        tr = write_trace(work / f"{model}-{init}-{mode}.json", eng.routes.trace())
        t = read_trace(tr)
        lengths = [int(a.shape[0]) for a in t.streams]
        per_layer = [[a[:, l, :].tolist() for a in t.streams] for l in range(cfg.num_layers)]
        m = layer_metrics(per_layer, cfg.num_experts, cfg.top_k)
        m["steps_per_stream"] = lengths
        m["prompt_tokens"] = [int(p) for p in t.prompt_tokens]
        out["modes"][mode] = m
        print(f"{model} {init} {mode}: steps {lengths}, load CV {m['load_cv_per_layer']}, LRU {m['lru']}, "
              f"Belady {m['belady']}", file=sys.stderr, flush=True)
    eng.close()
    fam = FAMILY[cfg.arch]
    out["calibrated"] = {"family": fam, **calibrated_metrics(fam, cfg, out["modes"]["greedy"]["steps_per_stream"],
                                                               args.seed)}
    print(f"{model} calibrated:{fam} at the same lengths: load CV {out['calibrated']['load_cv_mean']}, "
          f"LRU {out['calibrated']['lru']}", file=sys.stderr)
    out["wall_s"] = round(time.time() - t0, 1)
    out["build_s"] = round(built, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["small-olmoe", "tiny-olmoe"])
    ap.add_argument("--inits", nargs="+", default=["hf", "routing"])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per mode (one stream each)")
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--expert-format", default="fp16", choices=["fp16", "int4"])
    ap.add_argument("--seed", type=int, default=0, help="checkpoint seed (the temperature-1 sampling seed is 0)")
    ap.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    os.environ.setdefault("RUNMAP_PACK_VERIFY", "0")  # the probe packed these itself a moment ago
    from runmap import atomic
    from runmap.provenance import utc_timestamp
    from runmap.synth import checkpoint

    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        runs = [probe(m, i, work, args) for m in args.models for i in args.inits]
    doc = {"schema": SCHEMA, "created_utc": utc_timestamp(),
           "command": "python tools/explore/probe_synth_routing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "embed_ratio": checkpoint.EMBED_RATIO, "default_init": checkpoint.DEFAULT_INIT,
           "prompts": args.prompts, "prompt_words": args.prompt_words, "new_tokens": args.new_tokens,
           "runs": runs}
    if args.out:
        atomic.write_json(args.out, doc)
    print(json.dumps(doc, indent=1) if not args.out else f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
