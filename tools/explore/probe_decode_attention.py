"""GPU probe (not a test): the decode attention launch (with its prologue) and its combine, over split shapes.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/explore/probe_decode_attention.py --out $OUT/decode-attention.json

Why: the step ablations put decode attention at ~6-7 us a layer at batch 1 (OLMoE 107.8 us of an 848.6 us step,
results/campaigns/h100-step-ablation; Qwen1.5-MoE 143.8 of 1,772) and ~14 us a layer at batch 8 (Qwen1.5-MoE 335.1
us of a step, results/campaigns/h100-qwen-ablation) for contexts of at most 256 keys, while a layer's KV bytes at
batch 8 need ~4 us at the copy rate. ``attention_splits`` picks the split shape from the KV bucket alone (blocks of 32
keys, up to 16 splits), whatever the batch: at batch 8 that is 8 x 16 heads x 8 splits = 1,024 programs of one
32-key block each. This probe times ``decode_attention_with_prologue`` + its combine, the engine's decode path, for
OLMoE-1B-7B / Qwen1.5-MoE's attention (16 heads of 128, as many KV heads; OLMoE's q / k norms on), at batch 1 and 8
and two contexts, for each (BLOCK_N, SPLITS) of a grid beside the engine's choice. LAYERS layers of distinct KV caches
per CUDA graph (so L2 holds none of them), median of the replays. Each variant's output is checked against an FP32
softmax attention over the same keys (max |diff| / max |ref|); a variant that fails is recorded with ``ok`` false
and never chosen. Fractions are of the KV bytes read (keys pad .. slot of every row and head, K and V) at the 1 GiB
device copy rate of the same run.

Run on an H100 at 7879b65 (results/campaigns/h100-decode-attention): the engine's shape was the fastest or within
~7 % of it at <= 256 keys, batch 1 and 8; that run also timed a combine done by the split launch itself (the last
split of each head to arrive; RUNMAP_ATTN_COMBINE then, rows with ``combine`` in the record), slower at every case,
and removed.

``--device cpu`` runs the mechanics in the Triton interpreter on small shapes (no timing worth reading).
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from runmap.atomic import write_json

LAYERS = 16
NH, NKV, D = 16, 16, 128  # OLMoE-1B-7B and Qwen1.5-MoE-A2.7B alike
CASES = ((1, 256, 192), (8, 256, 192), (1, 1024, 900), (8, 1024, 900))  # (rows, KV bucket, keys attended per row)
GRID = tuple(itertools.product((32, 64), (1, 2, 4, 8, 16)))  # (BLOCK_N, SPLITS)


def reference(q, kc, vc, pad, slot):
    """FP32 attention of q (B, nh, 1, D) over keys pad[b] .. slot of kc / vc (B, nkv, S, D) -> (B, 1, nh * D)."""
    B, nh, _, d = q.shape
    rep = nh // kc.shape[1]
    out = torch.empty(B, nh, d, dtype=torch.float32, device=q.device)
    for b in range(B):
        k = kc[b, :, int(pad[b]):slot + 1].float().repeat_interleave(rep, 0)  # (nh, n, D)
        v = vc[b, :, int(pad[b]):slot + 1].float().repeat_interleave(rep, 0)
        s = (q[b].float() @ k.transpose(1, 2)) * d ** -0.5  # (nh, 1, n)
        out[b] = (torch.softmax(s, dim=-1) @ v)[:, 0]
    return out.reshape(B, 1, nh * d)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON record to write (rewritten after each case)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    import runmap.kernels.fused_ops as fo

    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    cases, layers = (CASES, LAYERS) if on_gpu else (((2, 64, 40),), 2)
    nh, nkv, d = (NH, NKV, D) if on_gpu else (2, 2, 32)
    copy = None
    if on_gpu:
        from runmap.bench.kernel_workload import copy_bandwidth, graph_us
        copy = copy_bandwidth(1 << 30)
    g = torch.Generator().manual_seed(0)
    chosen = fo.attention_splits
    rows = []
    for B, n_keys, keys in cases:
        slot = keys - 1
        qkv = [(torch.randn(B, 1, (nh + 2 * nkv) * d, generator=g) * 2).half().to(dev) for _ in range(layers)]
        qn = [(1 + 0.1 * torch.randn(nh * d, generator=g)).half().to(dev) for _ in range(layers)]
        kn = [(1 + 0.1 * torch.randn(nkv * d, generator=g)).half().to(dev) for _ in range(layers)]
        kc = [(torch.randn(B, nkv, n_keys, d, generator=g) * 3).half().to(dev) for _ in range(layers)]
        vc = [torch.randn(B, nkv, n_keys, d, generator=g).half().to(dev) for _ in range(layers)]
        pad = torch.zeros(B, dtype=torch.long, device=dev)
        positions = torch.full((B, 1), slot, dtype=torch.long, device=dev)
        slots = torch.tensor([slot], device=dev)
        inv_freq = (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)).to(dev)
        # the reference's q and new k / v: the three-launch path (its prologue is tested against torch elsewhere)
        refs = []
        for i in range(layers):
            q = fo.qk_norm_rope_kv(qkv[i], qn[i], kn[i], positions, slots, inv_freq, kc[i], vc[i], num_heads=nh,
                                   num_kv_heads=nkv, eps=1e-6)
            refs.append(reference(q, kc[i], vc[i], pad, slot))
        kv_bytes = B * nkv * keys * d * 2 * 2

        def run_all():
            return [fo.decode_attention_with_prologue(qkv[i], qn[i], kn[i], positions, slots, inv_freq, kc[i], vc[i],
                                                      pad, n_keys, num_heads=nh, num_kv_heads=nkv, eps=1e-6)
                    for i in range(layers)]

        default = chosen(n_keys)
        for label, (block_n, splits) in (("default", default),) + tuple(("grid", s) for s in GRID if s != default):
            fo.attention_splits = lambda n, s=(block_n, splits): s
            try:
                outs = run_all()
                err = max(float((o.float() - r).abs().max() / r.abs().max()) for o, r in zip(outs, refs))
                us = graph_us(run_all, layers) if on_gpu else None
            except Exception as exc:  # a shape the compiler refuses: recorded, not fatal
                rows.append({"rows": B, "n_keys": n_keys, "keys": keys, "variant": label, "block_n": block_n,
                             "splits": splits, "error": repr(exc)[:200]})
                continue
            finally:
                fo.attention_splits = chosen
            row = {"rows": B, "n_keys": n_keys, "keys": keys, "variant": label, "block_n": block_n, "splits": splits,
                   "rel_err": err, "ok": err <= 2e-3, "us": us}
            if us:
                row["fraction_of_copy"] = kv_bytes / us / 1e3 / copy["gbps"]
            rows.append(row)
            print(f"B={B} keys={keys:4d}/{n_keys:4d} {label:7s} BLOCK_N {block_n:3d} SPLITS {splits:2d}  err {err:.1e}  "
                  + (f"{us:6.2f} us a layer ({row['fraction_of_copy']:.2f} of copy for its KV bytes)" if us else ""),
                  flush=True)
        write_json(args.out, {"format": "decode-attention-probe-v1",
                              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "command": "python3 tools/explore/probe_decode_attention.py " + " ".join(argv or []),
                              "device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)",
                              "heads": {"nh": nh, "nkv": nkv, "d": d}, "layers": layers, "copy": copy, "rows": rows})


if __name__ == "__main__":
    main()
