"""What a host-read promotion costs a decode step on a GPU, and why (issue 24 item 8).

The gap probe (probe_host_read_gap.py; results/residency/host-read-gap-h100.log) found promotions nearly free at OLMoE
30 of 64 batch 1 and costly at 60 of 64 batch 8 (2,257 tok/s with them, 2,829 without: 717 us a step more at ~1
promotion a step), far above a row's bytes over the link (~57 us). This probe looks for the cause in one engine:

* the host time of each ``CachedExperts.promote_pending`` call and of the rest of ``HostReadDecoder.run``, split by
  whether the call promoted (wrapped with perf_counter);
* the CUDA runtime calls made during the run (torch.profiler, CPU side): synchronizations (stream, event, device),
  allocations (cudaMalloc / cudaFree / cudaHostAlloc), copies, with their counts and host time: a promotion that
  makes a device-wide synchronization or an allocator call shows here;
* the device's idle time: gaps longer than 5 us between consecutive device activities (CUPTI, kernels inside graph
  replays included, all streams merged), their count, sum and largest.

    PYTHONPATH=. python3 tools/explore/probe_promotion_cost.py --pack DIR [--resident 60] [--batch 8] [--tokens 96]

DIR: an OLMoE pack (`runmap synth DIR --preset olmoe-1b-7b-0924 --direct-pack`); calibrated routing, contract v2,
placement host-read (lfu-decay, margin 1 use: the defaults). One warm run first, then the profiled one. Prints a short
report; writes nothing.
"""
import argparse
import statistics
import time

import torch

from runmap.engine.engine import Engine

RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMalloc", "cudaFree",
                 "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaHostRegister", "cudaMemcpyAsync",
                 "cudaStreamWaitEvent", "cudaEventRecord", "cudaEventQuery", "cudaGraphLaunch", "cudaMemcpy")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--resident", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only to rehearse the probe "
                    "(TRITON_INTERPRET=1, a tiny pack, contract v1: no runtime calls or device spans there)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    eng = Engine.from_pack(args.pack, executor="grouped", device=args.device, resident=args.resident,
                           max_batch=args.batch, max_seq_len=192, expert_placement="host-read",
                           cache_contract="v2" if cuda else "v1",
                           routing="calibrated")
    try:
        ex, cache = eng.experts, eng.experts.cache
        prompt = list(range(100, 132))
        eng.run([prompt] * args.batch, max_new_tokens=args.tokens, ignore_eos=True)  # warm: graphs captured

        promote_us, promoted_calls = [], []
        step_us = []
        real_promote = ex.promote_pending

        def timed_promote():
            t0 = time.perf_counter()
            n = real_promote()
            promote_us.append((time.perf_counter() - t0) * 1e6)
            promoted_calls.append(n)
            return n

        ex.promote_pending = timed_promote
        dec = eng._host_read[args.batch]
        real_run = dec.run

        def timed_run(*a, **kw):
            t0 = time.perf_counter()
            out = real_run(*a, **kw)
            step_us.append((time.perf_counter() - t0) * 1e6)
            return out

        dec.run = timed_run
        from torch.profiler import ProfilerActivity, profile
        p0 = cache.counters["promotions"]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            run = eng.run([prompt] * args.batch, max_new_tokens=args.tokens, ignore_eos=True)
        ex.promote_pending, dec.run = real_promote, real_run
        promotions = cache.counters["promotions"] - p0
        print(f"resident {args.resident}/{cache.num_experts}, batch {args.batch}, {args.tokens} tokens: decode "
              f"{run.decode_tok_s:.1f} tok/s under the profiler (its overhead included), {promotions} promotions")

        # host time of the decoder's run and of promote_pending, by whether the step promoted
        def stats(xs):
            return f"n {len(xs):4d}  median {statistics.median(xs):8.1f}  mean {statistics.fmean(xs):8.1f}  " \
                   f"max {max(xs):8.1f} us" if xs else "n    0"
        with_p = [u for u, n in zip(promote_us, promoted_calls) if n]
        without_p = [u for u, n in zip(promote_us, promoted_calls) if not n]
        print("promote_pending, promoting  ", stats(with_p))
        print("promote_pending, not        ", stats(without_p))
        print("HostReadDecoder.run (whole) ", stats(step_us))

        # CUDA runtime calls on the host
        print(f"{'runtime call':24s} {'count':>7s} {'host us total':>14s}")
        for ev in prof.key_averages():
            # by prefix: some CUPTI versions report versioned names (cudaLaunchKernelExC_v11060 and the like)
            if ev.key.startswith(RUNTIME_CALLS):
                print(f"{ev.key:24s} {ev.count:7d} {ev.cpu_time_total:14.0f}")

        # device idle gaps between consecutive kernels / copies (all streams merged: an upper bound on the compute
        # stream's idle time, copies on the transfer stream fill gaps too)
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
        gaps, end = [], None
        for s, e in spans:
            if end is not None and s - end > 5:
                gaps.append(s - end)
            end = e if end is None else max(end, e)
        total = (spans[-1][1] - spans[0][0]) if spans else 0
        print(f"device busy span {total:.0f} us; idle gaps > 5 us: {len(gaps)}, {sum(gaps):.0f} us "
              f"({sum(gaps) / max(total, 1):.2f} of the span); largest {sorted(gaps)[-5:] if gaps else []}")
    finally:
        eng.close()


if __name__ == "__main__":
    main()
