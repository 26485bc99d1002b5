"""GPU probe (not a test): how fast can one decode layer's expert bytes be read at all, in one launch or two?

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/explore/probe_read_floor.py --out $OUT/read-floor.json
    (committed: results/kernels/explore/h200-read-floor.json, schema kernel-explore)

For each model and T in {1, 8}, 16 layers of distinct weights routed as in the kernel benchmark
(``runmap.bench.kernel_workload``), each timed as one CUDA graph of the 16 layers (per-layer time, the lower
median of two passes):
* ``read-two-launches``: a Triton kernel that only reads the weight bytes the topk-fused launches read (the
  gate+up rows of every (token, slot) pair, then the down rows), in two launches per layer, each program reading
  8 chunks of 4 KiB and storing their xor; ``read-one-launch``: the same chunks in one launch per layer (the
  floor of a one-launch layer). Bytes = the chunks read (per pair: experts repeated across tokens count again);
* ``copy-same-bytes``: ``dst.copy_(src)`` moving that many bytes (read + write) per layer;
* ``layer-topk-fused`` / ``decode-grouped``: the executors' default launches; bytes = the distinct experts' rows
  (the benchmark's measure), checked against the FP32 reference (``checks``);
* ``empty_launch_pair_us``: two launches of a kernel that does nothing, per layer (the fixed launch cost in a
  graph).
Fractions are of the 1 GiB device copy measured in the same run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runmap.atomic import write_json
from runmap.bench.kernel_workload import LAYERS, MODELS, graph_us, model_layers, probe_start, random_batches
from runmap.kernels import common
from runmap.kernels.executors import moe_experts
from runmap.kernels.reference import reference_moe_f32

CHUNK = 4096  # bytes per chunk
CHUNKS_PER_PROGRAM = 8


@triton.jit
def _touch_kernel(base_ptr, offs_ptr, out_ptr, CPP: tl.constexpr, WORDS: tl.constexpr):
    """Program i: xor of the int32 words of its CPP chunks (byte offsets offs[i, :]) -> out[i]."""
    pid = tl.program_id(0)
    acc = tl.zeros((WORDS,), tl.int32)
    for c in tl.static_range(CPP):
        off = tl.load(offs_ptr + pid * CPP + c)
        acc ^= tl.load((base_ptr + off).to(tl.pointer_type(tl.int32)) + tl.arange(0, WORDS))
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _empty_kernel(out_ptr):
    pass


def chunk_offsets(ids: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 (programs, 8) byte offsets of the gate+up chunks and of the down chunks of one layer's routing."""
    gu, dn = [], []
    for name, out in (("gate", gu), ("up", gu), ("down", dn)):
        s = common.proj_sections(layout, name)
        nbytes = s.n * s.k // 2
        for e in ids.flatten().tolist():
            out.extend(e * layout.row_bytes + s.w_off + c for c in range(0, nbytes - CHUNK + 1, CHUNK))
    def table(v):
        v = v[: len(v) - len(v) % CHUNKS_PER_PROGRAM]
        return torch.tensor(v, dtype=torch.int64, device="cuda").view(-1, CHUNKS_PER_PROGRAM)
    return table(gu), table(dn)


def main() -> None:
    out_path, gen, copy = probe_start(__doc__)
    rows, checks = [], []
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    empty_out = torch.empty(1, device="cuda")
    empty_us = graph_us(lambda: [(_empty_kernel[(1,)](empty_out), _empty_kernel[(1,)](empty_out))
                                 for _ in range(LAYERS)], LAYERS)
    for model, spec in MODELS.items():
        hdim, e, k = spec["hidden"], spec["experts"], spec["top_k"]
        layout, layers, table = model_layers(spec, gen)
        for tokens in (1, 8):
            batches = random_batches(LAYERS, tokens, hdim, e, k, gen)
            offs = [chunk_offsets(b[1], layout) for b in batches]
            both = [torch.cat(o) for o in offs]
            outs = [torch.empty(t.shape[0], dtype=torch.int32, device="cuda") for t in both]
            nbytes = both[0].numel() * CHUNK  # the same chunk count every layer (k distinct experts per token)

            def read2():
                for (gu, dn), st, out in zip(offs, layers, outs):
                    _touch_kernel[(gu.shape[0],)](st, gu, out, CPP=CHUNKS_PER_PROGRAM, WORDS=CHUNK // 4, num_warps=8)
                    _touch_kernel[(dn.shape[0],)](st, dn, out, CPP=CHUNKS_PER_PROGRAM, WORDS=CHUNK // 4, num_warps=8)

            def read1():
                for o, st, out in zip(both, layers, outs):
                    _touch_kernel[(o.shape[0],)](st, o, out, CPP=CHUNKS_PER_PROGRAM, WORDS=CHUNK // 4, num_warps=8)

            srcs = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
            dsts = [torch.empty_like(s) for s in srcs]

            def copy_same():
                for s, d in zip(srcs, dsts):
                    d.copy_(s)

            def executor(name):
                def step():
                    for (x, ids, w), st in zip(batches, layers):
                        moe_experts(name, x, ids, w, st, table, layout, validate=False)
                return step

            expert_bytes = sum(int(torch.unique(b[1]).numel()) for b in batches) * layout.row_bytes / LAYERS
            for name in ("topk-fused", "grouped"):
                y = moe_experts(name, *batches[0], layers[0], table, layout, validate=False)
                ref = reference_moe_f32(*batches[0], layers[0], table, layout)
                checks.append({"model": model, "tokens": tokens, "config": {"executor": name, "default": True},
                               "rel_err": float((y.float() - ref).norm() / ref.norm())})
            for kind, fn, moved in (("read-two-launches", read2, nbytes), ("read-one-launch", read1, nbytes),
                                    ("copy-same-bytes", copy_same, nbytes),
                                    ("layer-topk-fused", executor("topk-fused"), expert_bytes),
                                    ("decode-grouped", executor("grouped"), expert_bytes)):
                passes = [graph_us(fn, LAYERS) for _ in range(2)]
                us = min(passes)
                gbps = moved / us / 1e3
                rows.append({"model": model, "tokens": tokens, "kind": kind, "us": us, "passes_us": passes,
                             "bytes": moved, "gbps": gbps, "fraction": gbps / copy["gbps"]})
        layers.clear()
        torch.cuda.empty_cache()
    write_json(out_path, {"copy": copy, "empty_launch_pair_us": empty_us, "rows": rows, "checks": checks})
    print(f"two empty launches: {empty_us:.2f} us")
    for r in rows:
        print(f"{r['model']:12s} T={r['tokens']:<2d} {r['kind']:18s} {r['us']:7.2f} us {r['bytes'] / 1e6:6.1f} MB "
              f"{r['gbps']:6.0f} GB/s {r['fraction']:.2f} of copy")

if __name__ == "__main__":
    main()
