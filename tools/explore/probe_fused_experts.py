"""GPU probe (not a test, not the official record): a decode MoE layer's routed experts in ONE launch against the
grouped executor's two (gate/up, then down) plus its slot sum.

The question (issue 18 item 2; docs/kernels.md, "What bounds a decode expert launch"): an OLMoE batch-1 layer's
grouped launches take ~20 us for 24 MB of weights, so a launch boundary, not the bytes, bounds them. Here each program
owns one expert and one slice of BI intermediate columns: it computes h = fp16(silu(x Wg^T) * (x Wu^T)) for its BI
columns (the gate/up rows it alone reads), then at once that slice's contribution to the down projection,
h[:, slice] Wd[:, slice]^T for every hidden row, times the pair's gate weight, into its own fp32 partial
part[pair, slice, :]. No program waits for another; a second launch sums the k x (I / BI) partials of each token in a
fixed order (deterministic, no atomics). Down's weights are read as BI / 2-byte pieces of each hidden row (the pack's
row layout); BI divides the quantization block, so each piece has one scale.

Full residency, decode form (pairs matched by comparing ids, as the grouped executor's decode form), no shared
expert, no host rows: a probe of the structure, checked against the FP32 reference before it is timed.

    PYTHONPATH=. python3 tools/explore/probe_fused_experts.py --out $OUT/fused-experts.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from runmap.kernels import common
from runmap.kernels.core import chain_wait, dot_tiles, expert_row, nibbles_f16, nibbles_f16_asm, prefetch_l2, silu_mul
from runmap.kernels.grouped import _chunk_pairs, _match_group


@triton.jit
def _fused_experts_kernel(x_ptr, ids_ptr, wts_ptr, row_table_ptr, w_ptr, s_ptr, part_ptr, P, n_experts, n_rows,
                          row_bytes, stride_xm, gate_w, gate_s, up_w, up_s, down_w, down_s,
                          H: tl.constexpr, I: tl.constexpr, NB_H: tl.constexpr, NB_I: tl.constexpr,
                          QBLOCK: tl.constexpr, TOPK: tl.constexpr, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                          BI: tl.constexpr, BLOCK_K: tl.constexpr, BN_D: tl.constexpr, DEQ_ASM: tl.constexpr,
                          PREFETCH_DOWN: tl.constexpr, CHAINED: tl.constexpr = False):
    """part[p, j, :] = w[p] * (fp16(silu(x Wg^T) * (x Wu^T))[:, jBI:(j+1)BI] @ Wd[:, jBI:(j+1)BI]^T) for the pairs p
    of the expert whose first pair is program_id(0); j = program_id(1). part: fp32 (P, I / BI, H).
    PREFETCH_DOWN: ask L2 for this program's down pieces (one per hidden row) before the gate/up loop."""
    chain_wait(CHAINED)
    pid0 = tl.program_id(0)
    j = tl.program_id(1)
    NJ: tl.constexpr = I // BI
    HALF_I: tl.constexpr = BI // 2
    expert, match, rank, count, owner = _match_group(ids_ptr, pid0, P, P_PAD)
    if owner:
        w_row, s_row, ok = expert_row(expert, row_table_ptr, w_ptr, s_ptr, n_experts, n_rows, row_bytes)
        offs_i = j * BI + tl.arange(0, BI)  # (BI,) intermediate columns of this slice
        i_mask = offs_i < I
        offs_jb = j * HALF_I + tl.arange(0, HALF_I)  # (BI/2,) byte columns of each down row
        if PREFETCH_DOWN:
            prefetch_l2(w_row + down_w + tl.arange(0, H) * (I // 2) + j * HALF_I)
        for c0 in range(0, P_PAD, BLOCK_M):
            if c0 < count:
                pairs, lane_ok = _chunk_pairs(match, rank, count, c0, P_PAD, BLOCK_M)  # (BM,)
                x_rows = x_ptr + (pairs // TOPK).to(tl.int64) * stride_xm
                acc_g = tl.zeros((BLOCK_M, BI), tl.float32)
                acc_u = tl.zeros((BLOCK_M, BI), tl.float32)
                acc_g, acc_u = dot_tiles(acc_g, acc_u, x_rows, lane_ok & ok, w_row + gate_w, s_row + gate_s,
                                         w_row + up_w, s_row + up_s, offs_i, i_mask, H, NB_H, BLOCK_K, QBLOCK, True,
                                         True, DEQ_ASM, 0)
                h = silu_mul(acc_g, acc_u).to(tl.float16)  # (BM, BI), the grouped executor's fp16 rounding
                h_even, h_odd = tl.split(tl.reshape(h, (BLOCK_M, HALF_I, 2)))  # (BM, BI/2) each
                gw = tl.load(wts_ptr + pairs, mask=lane_ok, other=0.0)  # (BM,) fp32
                out_rows = part_ptr + (pairs.to(tl.int64) * NJ + j) * H  # (BM,)
                for n0 in range(0, H, BN_D):
                    offs_n = n0 + tl.arange(0, BN_D)  # (BN_D,) hidden rows
                    wd = tl.load(w_row + down_w + offs_n[None, :] * (I // 2) + offs_jb[:, None])  # (BI/2, BN_D)
                    lo, hi = nibbles_f16_asm(wd) if DEQ_ASM else nibbles_f16(wd)
                    s = tl.load(s_row + down_s + offs_n * NB_I + (j * BI) // QBLOCK).to(tl.float32)  # (BN_D,)
                    acc = tl.dot(h_even, lo) + tl.dot(h_odd, hi)  # (BM, BN_D) fp32
                    out = acc * s[None, :] * gw[:, None]
                    out = tl.where(ok, out, float("nan"))
                    tl.store(out_rows[:, None] + offs_n[None, :], out, mask=lane_ok[:, None])


@triton.jit
def _sum_parts_kernel(part_ptr, y_ptr, H: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                      CHAINED: tl.constexpr = False):
    """y[t, n] = fp16(sum over the k x NJ partials of token t, in order)."""
    chain_wait(CHAINED)
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    base = part_ptr + t.to(tl.int64) * PARTS * H
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for q in range(PARTS):
        acc += tl.load(base + q * H + offs_n)
    tl.store(y_ptr + t.to(tl.int64) * H + offs_n, acc.to(tl.float16))


def fused_experts(x, ids, wts, storage, row_table, layout, cfg: dict) -> torch.Tensor:
    """fp16 (T, H) routed-expert output of one decode layer in the fused form (full residency, T*k <= 128)."""
    t, k = ids.shape
    hdim, inter, qb = layout.hidden_size, layout.intermediate_size, layout.block_size
    bi = cfg["BI"]
    assert qb % bi == 0 and inter % bi == 0 and hdim % cfg["BN_D"] == 0, (qb, inter, bi, cfg)
    g, u, d = (common.proj_sections(layout, p) for p in ("gate", "up", "down"))
    nj = inter // bi
    part = torch.empty((t * k, nj, hdim), dtype=torch.float32, device=x.device)
    p = t * k
    deq = not common.interpreting(x.device)
    common.launch(_fused_experts_kernel[(p, nj)], x, ids, wts, row_table, storage, storage.view(torch.float16), part,
                  p, row_table.numel(), storage.shape[0], layout.row_bytes, x.stride(0),
                  g.w_off, g.s_off, u.w_off, u.s_off, d.w_off, d.s_off,
                  H=hdim, I=inter, NB_H=g.nb, NB_I=d.nb, QBLOCK=qb, TOPK=k, P_PAD=common.next_pow2(p),
                  BLOCK_M=16, BI=bi, BLOCK_K=cfg["BLOCK_K"], BN_D=cfg["BN_D"], DEQ_ASM=deq,
                  PREFETCH_DOWN=bool(cfg.get("PREFETCH_DOWN")) and deq, **common.launch_opts(cfg),
                  **common.chained(x.device))
    y = torch.empty((t, hdim), dtype=torch.float16, device=x.device)
    bn = min(1024, hdim)
    common.launch(_sum_parts_kernel[(t, hdim // bn)], part, y, H=hdim, PARTS=k * nj, BLOCK_N=bn,
                  **common.chained(x.device))
    return y


FUSED_CONFIGS = [
    {"BI": 64, "BLOCK_K": 256, "BN_D": 128, "num_warps": 4, "num_stages": 3},
    {"BI": 64, "BLOCK_K": 256, "BN_D": 256, "num_warps": 4, "num_stages": 3},
    {"BI": 32, "BLOCK_K": 256, "BN_D": 256, "num_warps": 4, "num_stages": 3},
    {"BI": 32, "BLOCK_K": 256, "BN_D": 512, "num_warps": 4, "num_stages": 3},
    {"BI": 64, "BLOCK_K": 256, "BN_D": 256, "num_warps": 8, "num_stages": 3},
    {"BI": 128, "BLOCK_K": 256, "BN_D": 128, "num_warps": 8, "num_stages": 3},
    {"BI": 32, "BLOCK_K": 128, "BN_D": 256, "num_warps": 4, "num_stages": 4},
    {"BI": 64, "BLOCK_K": 256, "BN_D": 256, "num_warps": 4, "num_stages": 3, "PREFETCH_DOWN": True},
    {"BI": 32, "BLOCK_K": 256, "BN_D": 256, "num_warps": 4, "num_stages": 3, "PREFETCH_DOWN": True},
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON written here")
    ap.add_argument("--tokens", default="1,8", help="decode batch sizes (default 1,8)")
    args = ap.parse_args()
    from runmap.bench.kernel_workload import MODELS, LAYERS, copy_bandwidth, graph_us, model_layers, random_batches
    from runmap.kernels.executors import moe_experts
    from runmap.kernels.reference import reference_moe_f32
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth(1 << 30)
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    rows = []
    for model, spec in MODELS.items():
        layout, layers, table = model_layers(spec, gen)
        for tokens in [int(v) for v in args.tokens.split(",")]:
            batches = random_batches(LAYERS, tokens, spec["hidden"], spec["experts"], spec["top_k"], gen)
            union = sum(int(torch.unique(b[1]).numel()) for b in batches) / LAYERS
            floor_us = union * layout.row_bytes / (copy["gbps"] * 1e3)
            ref = reference_moe_f32(*batches[0], layers[0], table, layout)
            variants = [("grouped", None)] + [("fused", c) for c in FUSED_CONFIGS]
            for name, cfg in variants:
                def layer(b, st, name=name, cfg=cfg):
                    if name == "grouped":
                        return moe_experts("grouped", *b, st, table, layout, validate=False)
                    return fused_experts(*b, st, table, layout, cfg)
                try:
                    y = layer(batches[0], layers[0])
                    err = float((y.float() - ref).norm() / ref.norm())
                    us = graph_us(lambda: [layer(b, st) for b, st in zip(batches, layers)], LAYERS) \
                        if err <= 2e-3 else None
                except Exception as exc:  # a config the compiler rejects: say so, go on
                    print(f"{model} T={tokens} {name} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)
                    continue
                row = {"model": model, "tokens": tokens, "variant": name, "config": cfg, "rel_err": err, "us": us,
                       "union_experts": union, "floor_us": floor_us,
                       "fraction_of_copy": None if us is None else floor_us / us}
                rows.append(row)
                print(f"{model:12s} T={tokens} {name:8s} {json.dumps(cfg) if cfg else '':78s} err {err:.1e} "
                      f"{'WRONG' if us is None else f'{us:7.2f} us  {floor_us / us:.2f} of copy'}", flush=True)
    Path(args.out).write_text(json.dumps({"copy": copy, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
