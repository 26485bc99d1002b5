"""Which tiles let the grouped executor read absent experts over the link fastest? (issue 24 item 8: the host-read
rows at batch 8 ran at 0.39-0.55 of their transfer bound on H100s whose kernels read host memory at 19 GB/s for
batch 8's union of 20 experts against 31-33 GB/s for batch 1's 8 and a 48-52 GB/s copy engine,
results/campaigns/h100-host-read-38af465.)

A guess worth measuring before changing the executor: a tile's weight read is BLOCK_N rows of BLOCK_K / 2
contiguous bytes each. Batch 8's sorted-run tiles (``grouped.default_config``: BLOCK_K 128) read 64 bytes per row and
tile, half a 128-byte line, where batch 1's decode tiles (BLOCK_K 256) read 128; over the link every read is a
request of its own, so shorter ones may move fewer bytes per second. The tiles were tuned on device memory, where
that matters less.

One layer of OLMoE-shaped experts (``runmap.kernels.check.make_layer``), copied into registered host memory and read
through its mapping (as tools/explore/probe_host_read.py does): for each case (tokens, union of experts) and each tile
config, the executor's device time reading the experts from host memory and from device memory (CUDA graph of one
call, L2 flushed before each replay, median of 5 rounds of 20), the host-read GB/s of the experts' bytes, and
correctness (host-read output equal to the device-memory output of the same config, and within 2e-3 of the FP32
reference). Writes --out as JSON, prints a table.

    PYTHONPATH=. python3 tools/explore/probe_host_read_tiles.py --out $OUT/host-read-tiles.json        (a CUDA machine)
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/explore/probe_host_read_tiles.py --device cpu --shape tiny  (plumbing)
"""
from __future__ import annotations

import torch

# tools/explore/probe_host_read.py (this folder is the script's first import path)
from probe_host_read import device_us, finish_probe, mapped_layer, parse_probe, probe_arguments

# (name, config overrides of grouped.default_config) per case; "default" keeps the executor's own
CONFIGS_B1 = [
    ("default", {}),
    ("bn64", {"BLOCK_N": 64, "DOWN_BLOCK_N": 64}),
    ("bn16", {"BLOCK_N": 16, "DOWN_BLOCK_N": 16}),
    ("stages4", {"num_stages": 4}),
    ("warps2", {"num_warps": 2}),
]
CONFIGS_B8 = [
    ("default", {}),
    ("bk256", {"BLOCK_K": 256, "DOWN_BLOCK_K": 256, "num_stages": 3}),
    ("bk256-s4", {"BLOCK_K": 256, "DOWN_BLOCK_K": 256, "num_stages": 4}),
    ("bn32-bk256", {"BLOCK_N": 32, "DOWN_BLOCK_N": 32, "BLOCK_K": 256, "DOWN_BLOCK_K": 256, "num_stages": 3}),
    ("bn128-bk256", {"BLOCK_N": 128, "DOWN_BLOCK_N": 128, "BLOCK_K": 256, "DOWN_BLOCK_K": 256, "num_stages": 3}),
    ("decode-form-bk256", {"SORTED": False, "BLOCK_N": 64, "DOWN_BLOCK_N": 64, "BLOCK_K": 256, "DOWN_BLOCK_K": 256,
                           "num_stages": 3}),
]
CASES = [(1, 8, CONFIGS_B1), (8, 20, CONFIGS_B8)]


def main(argv=None) -> int:
    args, dev = parse_probe(probe_arguments(__doc__), argv, "probe_host_read_tiles")

    from runmap.kernels.executors import moe_experts
    from runmap.kernels.reference import reference_moe_f32

    shape, layout, storage, table, resident, arr, _buf, host_storage = mapped_layer(args.shape, dev, args.seed)
    k = shape.top_k
    resident = resident.cpu()
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 11)
    result = {"shape": shape.to_dict(), "executor": "grouped", "device": str(dev), "rows": []}
    if dev.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(dev)
        from runmap.bench.metrics import h2d_bandwidth

        result["link_gb_s"] = round(h2d_bandwidth(dev)["value"], 2)
        print(f"{result['device_name']}: pinned H2D {result['link_gb_s']} GB/s; expert row {layout.row_bytes} B")
    print(f"{'tokens':>6} {'experts':>7} {'config':<18} {'host us':>8} {'GB/s':>6} {'device us':>9} {'pass':>5}")
    for t, m, configs in CASES:
        m = min(m, resident.numel())
        union = resident[torch.randperm(resident.numel(), generator=gen)[:m]]
        kk = min(k, m)
        ids = torch.stack([union[torch.randperm(m, generator=gen)[:kk]] for _ in range(t)]).to(dev)  # (t, kk)
        x = torch.randn(t, layout.hidden_size, generator=gen).to(torch.float16).to(dev)  # (t, H)
        w = torch.softmax(torch.randn(t, kk, generator=gen), dim=1).to(dev)  # (t, kk)
        ref = reference_moe_f32(x, ids, w, storage, table, layout)
        for name, over in configs:
            row = {"tokens": t, "experts": m, "config": name, "overrides": over}
            try:
                y_dev = moe_experts("grouped", x, ids, w, storage, table, layout, validate=False, config=over)
                y_host = moe_experts("grouped", x, ids, w, host_storage, table, layout, validate=False, config=over)
            except Exception as exc:  # noqa: BLE001 - a probe: a config the kernels refuse is a row that says so
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"{t:>6} {m:>7} {name:<18} refused: {row['error'][:80]}")
                result["rows"].append(row)
                continue
            err = float((y_host.float() - ref).norm() / ref.norm())
            row.update(host_equals_device=bool(torch.equal(y_host, y_dev)), rel_error_vs_fp32=round(err, 6))
            row["pass"] = row["host_equals_device"] and err <= 2e-3
            if dev.type == "cuda":
                row["host_read_us"] = device_us(lambda: moe_experts("grouped", x, ids, w, host_storage, table, layout,
                                                                    validate=False, config=over))
                row["device_us"] = device_us(lambda: moe_experts("grouped", x, ids, w, storage, table, layout,
                                                                 validate=False, config=over))
                row["host_read_gb_s"] = round(m * layout.row_bytes / row["host_read_us"] / 1e3, 2)
            result["rows"].append(row)
            print(f"{t:>6} {m:>7} {name:<18} {row.get('host_read_us', float('nan')):>8} "
                  f"{row.get('host_read_gb_s', float('nan')):>6} {row.get('device_us', float('nan')):>9} "
                  f"{str(row['pass']):>5}")
    ok = all(r.get("pass", False) for r in result["rows"] if "error" not in r)
    return finish_probe(dev, arr, result, ok, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
