"""Can the CPU site and the host-read site serve absent experts at the same time, each at its own rate? The GPU's
kernels reading expert rows over the link and the CPU's kernel reading other rows both read host memory; if neither
slows the other, a decode step that gives part of each layer's misses to the CPU (not built: `auto` picks one site
per engine) serves its missed bytes at about the sum of the two rates.

    PYTHONPATH=. python3 tools/explore/probe_two_sites.py --pack DIR [--seconds 2] [--cpu-experts 2,4,8]

DIR: a pack at real dimensions (e.g. `runmap synth DIR --preset olmoe-1b-7b-0924 --direct-pack`). The engine is built
with placement host-read at top_k resident experts (contract v2: the host source registered and mapped), on a GPU.

Three measurements, each over about --seconds of work, every call on experts no earlier call of that side read
(cycling over every layer's experts, so neither side is served from a cache: the GPU's L2, the CPU's last level):

  gpu alone: the grouped executor computing one token's top_k experts, every one read from the mapped host rows
      (the call `CachedExperts.measure_host_read_gb_s` times), calls queued back to back, timed by CUDA events;
  cpu alone: the CPU site (cpu-native, on its job thread, the team one thread smaller than the cores, as in the
      decode chain) computing m experts for one token per call, back to back, for each m of --cpu-experts;
  both: the two loops at once (the CPU on its job thread, started 50 ms first and stopped when the GPU's calls are
      done; the GPU's calls queued from this thread), each side's rate over its own span (the CPU's includes those
      edges, so the sum of the two rates is off by a few per cent at most).

GB/s are of expert bytes (qpacked rows) read. Prints a table and, with --json, writes the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np
import torch

from runmap.engine.engine import Engine


class GpuReads:
    """One token's top_k experts per call, all read from the mapped host rows, distinct experts call after call."""

    def __init__(self, ex, top_k: int, num_layers: int):
        from runmap.engine.engine import host_to_device
        from runmap.residency.transport import mapped_rows

        c = ex.cache
        self.ex, self.k, self.L, self.E = ex, top_k, num_layers, c.num_experts
        dev = c.device
        self.host = [mapped_rows(c.host, layer, dev) for layer in range(num_layers)]  # uint8 (E, row_bytes) each
        self.table = host_to_device(c.rows_per_layer + np.arange(self.E, dtype=np.int32), dev)  # every entry a host row
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(1, ex.layout.hidden_size, generator=gen).to(device=dev, dtype=torch.float16)  # (1, H)
        self.gw = torch.full((1, top_k), 1.0 / top_k, dtype=torch.float32, device=dev)  # (1, k)
        per_layer = self.E // top_k  # calls per layer before its experts repeat
        self.ids = [torch.tensor([[(i * top_k + j) % self.E for j in range(top_k)]], dtype=torch.int64, device=dev)
                    for i in range(per_layer)]
        self.calls = 0
        self.row_bytes = c.row_bytes

    def call(self) -> None:
        i = self.calls
        layer, j = (i // len(self.ids)) % self.L, i % len(self.ids)
        self.ex.moe(self.ex.executor, self.x, self.ids[j], self.gw, self.ex.storage[layer], self.table,
                    self.ex.layout, validate=False, host_rows=self.host[layer])
        self.calls += 1

    def run(self, n: int) -> tuple[float, float, float]:
        """n calls queued back to back -> (GB/s, device seconds, host seconds to queue them): where queueing takes
        about as long as the device span, the launches (not the reads) bound the rate."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # the device busy while the first launches queue
        t0 = time.perf_counter()
        start.record()
        for _ in range(n):
            self.call()
        queued = time.perf_counter() - t0
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        return n * self.k * self.row_bytes / seconds / 1e9, seconds, queued


class CpuReads:
    """The CPU site on m experts of one token per call (cpu-native), on the site's job thread."""

    def __init__(self, site, layout, top_k: int, num_layers: int, num_experts: int, row_bytes: int):
        self.site, self.L, self.E, self.row_bytes = site, num_layers, num_experts, row_bytes
        self.threads = max(1, (os.cpu_count() or 2) - 1)  # as the decode chain: the main thread keeps a core
        rng = np.random.default_rng(2)
        self.x = rng.standard_normal((1, layout.hidden_size)).astype(np.float16)  # (1, H)
        self.out = np.zeros((1, layout.hidden_size), dtype=np.float32)  # (1, H)
        self.calls = 0
        self.offset = num_experts // 2  # the other half of each layer's experts from the GPU side's first ones

    def _args(self, m: int):
        i = self.calls
        per_layer = self.E // m
        layer, j = (i // per_layer) % self.L, i % per_layer
        experts = [(self.offset + j * m + t) % self.E for t in range(m)]
        ids = np.array([experts], dtype=np.int64)  # (1, m)
        gw = np.full((1, m), 1.0 / m, dtype=np.float32)  # (1, m)
        return layer, ids, gw, experts

    def run(self, m: int, seconds: float, stop: threading.Event | None = None) -> tuple[float, float, int, float]:
        """Calls of m experts back to back for ``seconds`` (or until ``stop``) on the job thread -> (GB/s, seconds,
        calls, wall start)."""
        def loop():
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds and not (stop is not None and stop.is_set()):
                layer, ids, gw, experts = self._args(m)
                self.site.prepare_subset_arrays(layer, self.x, ids, gw, experts, self.out, self.threads)()
                self.calls += 1
                n += 1
            return n, time.perf_counter() - t0, t0
        n, s, t0 = self.site.submit(loop).result()
        return n * m * self.row_bytes / s / 1e9, s, n, t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--seconds", type=float, default=2.0, help="work per measurement (default 2)")
    ap.add_argument("--cpu-experts", default="2,4,8", help="experts per CPU call, comma-separated (default 2,4,8)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_two_sites: needs a GPU (the host-read site reads over the link)")
    sizes = [int(v) for v in args.cpu_experts.split(",")]

    from runmap.format.packfile import PackReader

    reader = PackReader(args.pack, verify=False)  # the engine verifies it
    cfg = reader.config
    reader.close()
    eng = Engine.from_pack(args.pack, executor="grouped", resident=cfg.top_k, device="cuda", max_batch=1,
                           max_seq_len=64, cache_contract="v2", expert_placement="host-read")
    ex = eng.experts
    L, E, k, row_bytes = cfg.num_layers, cfg.num_experts, cfg.top_k, ex.cache.row_bytes
    gpu = GpuReads(ex, k, L)
    cpu = CpuReads(ex.site(), ex.layout, k, L, E, row_bytes)
    print(f"{cfg.arch}: {L} layers x {E} experts, top-{k}, expert row {row_bytes / 1e6:.2f} MB; "
          f"{torch.cuda.get_device_name()}, {os.cpu_count()} cores, CPU team {cpu.threads} threads", flush=True)

    # warm: compilation, the mapping's first touch, the C kernel's team
    gpu.run(4)
    cpu.run(sizes[0], 0.2)
    # calls of the GPU side for about --seconds
    g_rate, g_s, _ = gpu.run(8)
    n_gpu = max(8, int(args.seconds / (g_s / 8)))
    out = {"device": torch.cuda.get_device_name(), "cores": os.cpu_count(), "cpu_threads": cpu.threads,
           "arch": cfg.arch, "row_bytes": row_bytes, "top_k": k, "gpu_calls": n_gpu, "rows": []}

    g_rate, g_s, g_q = gpu.run(n_gpu)
    print(f"gpu alone: {g_rate:6.1f} GB/s ({n_gpu} calls of {k} experts, {g_s:.2f} s on the device, queued in "
          f"{g_q:.2f} s)", flush=True)
    out["gpu_alone_gb_s"], out["gpu_alone_s"], out["gpu_alone_queued_s"] = g_rate, g_s, g_q
    print(f"{'cpu experts/call':>16} {'cpu alone':>10} {'cpu both':>9} {'gpu both':>9} {'sum both':>9} "
          f"{'sum alone':>9}  (GB/s)  gpu both: device s / queued s", flush=True)
    for m in sizes:
        c_rate, c_s, c_n, _ = cpu.run(m, args.seconds)
        # both at once: the CPU loop on its job thread, started first; the GPU's calls queued from this thread
        stop = threading.Event()
        result: dict = {}

        def cpu_side():
            result["cpu"] = cpu.run(m, 10 * args.seconds, stop)
        t = threading.Thread(target=cpu_side)
        t.start()
        time.sleep(0.05)
        gb_rate, gb_s, gb_q = gpu.run(n_gpu)
        stop.set()
        t.join()
        cb_rate, cb_s, cb_n, _ = result["cpu"]
        row = {"cpu_experts_per_call": m, "cpu_alone_gb_s": c_rate, "cpu_alone_calls": c_n,
               "cpu_both_gb_s": cb_rate, "cpu_both_calls": cb_n, "cpu_both_s": cb_s,
               "gpu_both_gb_s": gb_rate, "gpu_both_s": gb_s, "gpu_both_queued_s": gb_q}
        out["rows"].append(row)
        print(f"{m:>16} {c_rate:>10.1f} {cb_rate:>9.1f} {gb_rate:>9.1f} {cb_rate + gb_rate:>9.1f} "
              f"{c_rate + g_rate:>9.1f}  {gb_s:.2f} / {gb_q:.2f}", flush=True)
    eng.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
