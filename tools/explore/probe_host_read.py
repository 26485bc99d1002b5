"""Can the GPU compute an absent expert straight from the registered host source, and how fast? (issue 24 item 8:
partial residency at batch 1 runs at ~0.49 of its transfer bound because the host waits for every miss
transaction's copies before it publishes and launches the next segment.)

Contract v2 already registers the whole host source as pinned memory. Registered memory is also mapped into the
device's address space, so a kernel can read an absent expert's row over the link itself, with no copy, no
transaction and no host round trip: the idea of a "host-read site" beside the CPU site. This probe measures what
such a site would cost, with the project's own grouped W4A16 executor unchanged:

1. one layer of OLMoE-shaped experts (64, 2048 x 1024, block 256) built by ``runmap.kernels.check.make_layer``, in
   device memory and copied into page-aligned host memory registered with cudaHostRegister (portable, mapped,
   read-only); the host copy is wrapped as a CUDA tensor through ``__cuda_array_interface__`` (its pointer is the
   host pointer: unified addressing), so the executor reads the host bytes as if they were a storage;
2. correctness: the executor over the host-mapped storage against the same executor over device storage
   (bit-identical expected: same kernel, same bytes) and against the FP32 reference;
3. timing (CUDA graphs of one executor call, each replay timed alone after a 256 MB write evicts L2, median of 5
   rounds of 20 replays): m = 1 / 2 / 4 / 8
   distinct experts of one token read (a) from device memory, (b) from host memory through the mapping; (c) m rows
   copied by DMA from the registered source into device rows (what a miss transaction moves) followed by (a);
   batch 8 with a union of ~20 experts the same three ways. Expert bytes per second of (b) and (c), and the same
   run's pinned copy rate of 256 MB.

    PYTHONPATH=. python3 tools/explore/probe_host_read.py --out $OUT/host-read.json       (a CUDA machine)
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/explore/probe_host_read.py --device cpu --shape tiny   (plumbing only)

On the CPU (the interpreter) there is no mapping to measure: the host storage is used as is, to check the plumbing.
"""
from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from runmap.residency.transport import HOST_REGISTER_FLAGS, MappedArray


def host_copy(storage: torch.Tensor, register: bool):
    """storage uint8 (R, row_bytes) -> (page-aligned host numpy copy, its mmap, registered?)."""
    rows, row_bytes = storage.shape
    buf = mmap.mmap(-1, rows * row_bytes)  # anonymous, page-aligned
    arr = np.frombuffer(buf, dtype=np.uint8).reshape(rows, row_bytes)
    arr[:] = storage.cpu().numpy()
    if register:
        err = torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, HOST_REGISTER_FLAGS)
        code = int(getattr(err, "value", err))
        if code != 0:
            sys.exit(f"probe_host_read: cudaHostRegister of {arr.nbytes} bytes failed (error {code})")
    return arr, buf


def probe_arguments(doc: str) -> argparse.ArgumentParser:
    """The arguments the host-read probes share: --device, --shape, --seed, --out."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (measures) or cpu (the interpreter: plumbing only)")
    ap.add_argument("--shape", default="olmoe", help="an ExpertShape name of runmap.kernels.check.SHAPES "
                                                     "(olmoe; tiny: small-b256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    return ap


def parse_probe(ap: argparse.ArgumentParser, argv, name: str):
    """-> (arguments, torch device); exits with one line where CUDA is asked for and absent."""
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{name}: no CUDA device; use --device cpu with TRITON_INTERPRET=1 for the plumbing")
    return args, dev


def mapped_layer(shape_arg: str, dev: torch.device, seed: int):
    """One layer of experts of the ExpertShape named ``shape_arg`` (runmap.kernels.check.SHAPES; "tiny": small-b256)
    built on ``dev``, and a copy of its storage in page-aligned host memory, registered and mapped on a GPU ->
    (shape, layout, storage uint8 (R, row_bytes), row table int32 (E,), resident ids (3/4 of E), the host copy as
    numpy, its mmap, host_storage: the host copy as a tensor the executor reads as a storage)."""
    from runmap.kernels.check import SHAPES, make_layer

    shapes = {s.name: s for group in SHAPES.values() for s in group}
    shape = shapes["small-b256" if shape_arg == "tiny" else shape_arg]
    layout, storage, table, resident = make_layer(shape, dev, seed)
    arr, buf = host_copy(storage, register=dev.type == "cuda")
    if dev.type == "cuda":
        host_storage = torch.as_tensor(MappedArray(arr.ctypes.data, *arr.shape), device=dev)
        # a view, not a copy; that the host pointer is also the device's is unified addressing (every 64-bit Linux
        # CUDA device since Fermi): a kernel reading it reads host memory over the link
        assert host_storage.data_ptr() == arr.ctypes.data
    else:  # the interpreter: no mapping, the host copy itself (plumbing only)
        host_storage = torch.from_numpy(arr)
    return shape, layout, storage, table, resident, arr, buf, host_storage


def graph_of(fn):
    """A CUDA graph of one call of fn (runmap's capture_graph: warmed up on a side stream first), or None when
    capture fails (then the call is timed eagerly)."""
    from runmap.engine.engine import capture_graph

    try:
        return capture_graph(fn, torch.device("cuda"), None)[0]
    except Exception as exc:  # noqa: BLE001 - a probe: report and time eagerly instead
        print(f"  capture failed ({type(exc).__name__}: {exc}); timing eagerly")
        return None


_L2_FLUSH = None


def device_us(fn, rounds: int = 5, reps: int = 20) -> float:
    """Median over rounds of the mean device time of one call, each call timed alone (CUDA events) after a write of
    256 MB that evicts the H200's 50 MB L2: the m experts' bytes must come from where they lie (device or host
    memory), not from a cache a previous replay filled."""
    global _L2_FLUSH
    if _L2_FLUSH is None:
        _L2_FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    g = graph_of(fn)
    run = g.replay if g is not None else fn
    out = []
    for _ in range(rounds):
        total = 0.0
        for _ in range(reps):
            _L2_FLUSH.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            total += a.elapsed_time(b)
        out.append(1e3 * total / reps)
    return round(statistics.median(out), 2)


def finish_probe(dev: torch.device, arr, result: dict, ok: bool, out: Path | None) -> int:
    """Unregister the host copy (on a GPU), write ``result`` with its verdict to ``out`` (when given), print the
    verdict; the process's exit status."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)
    result["pass"] = ok
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print("correctness:", "passed" if ok else "FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = probe_arguments(__doc__)
    ap.add_argument("--executor", default="grouped")
    args, dev = parse_probe(ap, argv, "probe_host_read")

    from runmap.kernels.executors import moe_experts
    from runmap.kernels.reference import reference_moe_f32

    shape, layout, storage, table, resident, arr, _buf, host_storage = mapped_layer(args.shape, dev, args.seed)
    row_bytes = layout.row_bytes
    k = shape.top_k
    resident = resident.cpu()
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 7)
    result = {"shape": shape.to_dict(), "executor": args.executor, "device": str(dev), "cases": []}
    if dev.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(dev)
        from runmap.bench.metrics import h2d_bandwidth

        result["link_gb_s"] = round(h2d_bandwidth(dev)["value"], 2)  # the records' same-run pinned copy rate
        print(f"{result['device_name']}: pinned H2D {result['link_gb_s']} GB/s; expert row {row_bytes} B")

    def batch(t: int, m: int):
        """t tokens over a union of m experts (each token k of them when m >= k, else m), fresh random inputs."""
        m = min(m, resident.numel())  # a small shape's resident experts (3/4 of E) bound the union
        union = resident[torch.randperm(resident.numel(), generator=gen)[:m]]
        kk = min(k, m)
        ids = torch.stack([union[torch.randperm(m, generator=gen)[:kk]] for _ in range(t)])
        x = torch.randn(t, layout.hidden_size, generator=gen).to(torch.float16)
        w = torch.softmax(torch.randn(t, kk, generator=gen), dim=1)
        return x.to(dev), ids.to(dev).contiguous(), w.to(dev).contiguous(), union

    cases = [(1, 1), (1, 2), (1, 4), (1, 8), (8, 20)] if dev.type == "cuda" else [(1, 2), (3, 5)]
    for t, m in cases:
        x, ids, w, union = batch(t, m)
        m = union.numel()
        y_dev = moe_experts(args.executor, x, ids, w, storage, table, layout, validate=False)
        y_host = moe_experts(args.executor, x, ids, w, host_storage, table, layout, validate=False)
        ref = reference_moe_f32(x, ids, w, storage, table, layout)
        err = float((y_host.float() - ref).norm() / ref.norm())
        same = bool(torch.equal(y_host, y_dev))
        case = {"tokens": t, "experts": m, "bytes": m * row_bytes, "host_equals_device": same,
                "rel_error_vs_fp32": round(err, 6), "pass": same and err <= 2e-3}
        if dev.type == "cuda":
            rows = torch.as_tensor(table.cpu()[union].long())
            dst = torch.empty(m, row_bytes, dtype=torch.uint8, device=dev)
            src_cpu = [torch.from_numpy(arr[int(r)]) for r in rows]  # the same bytes as host tensors (DMA source)

            def copy_then_compute():
                for j in range(m):
                    dst[j].copy_(src_cpu[j], non_blocking=True)  # (row_bytes,) registered host -> device, DMA
                moe_experts(args.executor, x, ids, w, storage, table, layout, validate=False)

            def copy_only():
                for j in range(m):
                    dst[j].copy_(src_cpu[j], non_blocking=True)

            case["device_us"] = device_us(lambda: moe_experts(args.executor, x, ids, w, storage, table, layout,
                                                              validate=False))
            case["host_read_us"] = device_us(lambda: moe_experts(args.executor, x, ids, w, host_storage, table,
                                                                 layout, validate=False))
            case["copy_us"] = device_us(copy_only)
            case["copy_then_compute_us"] = device_us(copy_then_compute)
            case["host_read_gb_s"] = round(m * row_bytes / case["host_read_us"] / 1e3, 2)
            # faster than the link would mean the reads did not cross it (a cache): then the figure means nothing
            case["host_read_above_link"] = case["host_read_gb_s"] > result["link_gb_s"]
            case["copy_gb_s"] = round(m * row_bytes / case["copy_us"] / 1e3, 2)
            case["host_read_vs_copy_then_compute"] = round(case["copy_then_compute_us"] / case["host_read_us"], 3)
        result["cases"].append(case)
        print(" ".join(f"{k_}={v}" for k_, v in case.items()))
    return finish_probe(dev, arr, result, all(c["pass"] for c in result["cases"]), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
