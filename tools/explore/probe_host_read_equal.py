"""Which part of a run makes placement host-read's decode logits differ from full residency's on a GPU.

Tiny OLMoE and Qwen2-MoE (synthetic, seed 3, packed here), two prompts, 6 greedy tokens, batch 2. Four engines per
model: full residency (its short prompt passes replayed as captured graphs, padded to a length bucket), full
residency with every prompt pass eager, host-read at top_k of E resident (steps captured), host-read with
cuda_graphs=False. Prints each decode step's max |logit difference| against the first two.

    PYTHONPATH=. python3 tools/explore/probe_host_read_equal.py      (a CUDA device; ~15 s)

Record: results/residency/host-read-equal-h200.log (tests/test_host_read.py compares with eager prompt passes).
"""
import tempfile
from pathlib import Path

from runmap.arch.config import load_preset
from runmap.engine.engine import Engine
from runmap.format.pack import pack_checkpoint
from runmap.synth.checkpoint import write_synthetic

PROMPTS = ["the cache holds", "experts that were read from the host"]
RUNS = ("full", "full-eager-prefill", "host-read", "host-read-nograph")


def decode_logits(pack, cfg, name):
    """-> (generated token ids per prompt, [float32 (B, V) logits of each decode step]) of engine ``name``."""
    kw = {} if name.startswith("full") else dict(resident=cfg.top_k, expert_placement="host-read",
                                                 policy="lfu-decay", cache_contract="v2")
    if name == "host-read-nograph":
        kw["cuda_graphs"] = False
    eng = Engine.from_pack(pack, executor="grouped", device="cuda", max_batch=2, max_seq_len=48, **kw)
    try:
        if name == "full-eager-prefill":
            eng._prefiller = None  # every prompt pass eager, as host-read's are
        steps, decode = [], eng.decode

        def recording(*a, **k):
            out = decode(*a, **k)
            steps.append(out.detach().float().cpu().clone())
            return out

        eng.decode = recording
        tokens = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]
        return tokens, steps
    finally:
        eng.close()


def main():
    root = Path(tempfile.mkdtemp())
    print("model           engine               tokens=full  max|diff| per step vs full ; vs full-eager-prefill")
    for preset in ("tiny-olmoe", "tiny-qwen2-moe"):
        cfg, _ = load_preset(preset)
        pack = root / f"pk-{preset}"
        pack_checkpoint(write_synthetic(cfg, root / f"ck-{preset}", seed=3), pack, device="cpu")
        runs = {name: decode_logits(pack, cfg, name) for name in RUNS}
        for name, (tokens, steps) in runs.items():
            vs = [[f"{float((a - b).abs().max()):.2e}" for a, b in zip(steps, runs[ref][1])]
                  for ref in ("full", "full-eager-prefill")]
            print(f"{preset:15s} {name:20s} {str(tokens == runs['full'][0]):12s} {' '.join(vs[0])} ; {' '.join(vs[1])}")


if __name__ == "__main__":
    main()
