"""Where a host-read decode step's time goes beyond its transfer bound, on a GPU: the wall time per decoded token
against the device time of the step's captured graph replayed alone (the same tables, so the same host reads), with
the engine's promotions at chosen margins (default: the engine's, 1 use, then an infinite one: none).

    PYTHONPATH=. python3 tools/explore/probe_host_read_gap.py --pack DIR [--resident 30,60] [--batch 1]
        [--margins default,inf] [--fresh]

DIR: an OLMoE pack (e.g. `runmap synth DIR --preset olmoe-1b-7b-0924 --direct-pack`); calibrated routing, contract
v2, a 32-token prompt and 128 new tokens per run, one untimed run after each engine is built, then 2 runs per margin;
the per-step figures come from the faster run (the other run's promotions in parentheses). The replays describe one
step (the last); "expected" is the faster run's mean step: the all-device replay plus its mean host reads per step at
the link rate the replays measured (or --link-gb-s). Prints one line per (resident, margin).
"""
import argparse
import time

import torch

from runmap.engine.engine import Engine


def replay_us(decoder, reps: int = 50) -> float:
    """Device time (us) of one replay of the decoder's longest captured step graph."""
    g, _ = decoder.graphs[max(decoder.graphs)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def host_pairs(decoder, ex) -> int:
    """Distinct (layer, expert) host reads of the decoder's last replayed step (its routed ids against the tables)."""
    routed = decoder.routed.reshape(decoder.routed.shape[0], -1).cpu().numpy()  # (L, B*k)
    tables = ex.hr_tables.cpu().numpy()  # (L, E)
    R = ex.cache.rows_per_layer
    return sum(len({int(e) for e in row if tables[layer, e] >= R}) for layer, row in enumerate(routed))


def replay_all_device_us(decoder, ex) -> float:
    """replay_us with every host entry of hr_tables pointing at device row 0 (restored after)."""
    saved = ex.hr_tables.clone()
    R = ex.cache.rows_per_layer
    ex.hr_tables.copy_(torch.where(saved >= R, torch.zeros_like(saved), saved))
    try:
        return replay_us(decoder)
    finally:
        ex.hr_tables.copy_(saved)
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--resident", default="30,60")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--margins", default="default,inf",
                    help="promotion margins, in order (default: the engine's, then inf = no promotion)")
    ap.add_argument("--link-gb-s", type=float, default=56.0,
                    help="the link rate for 'expected' where the replayed step has fewer than 3 host reads to time "
                         "(default 56: host rows read by the kernels on an H100, results/residency/host-read-gap-h100.log)")
    ap.add_argument("--fresh", action="store_true",
                    help="a new engine per margin (each starts from the same cache; default: one engine per residency, "
                         "so a later margin starts from the cache the earlier ones shaped)")
    args = ap.parse_args()
    prompt = list(range(100, 132))
    print("resident batch margin      decode tok/s (runs)   wall us/step  replay us  gap us  promoted/step (other run)"
          "  | all-device replay us  host reads (replayed step)  their us  link GB/s"
          "  | host reads/step (run)  expected us/step  wall - expected")

    def build(resident):
        return Engine.from_pack(args.pack, executor="grouped", device="cuda", resident=resident, max_batch=args.batch,
                                max_seq_len=192, expert_placement="host-read", cache_contract="v2", routing="calibrated")

    margins = args.margins.split(",")
    for resident in (int(r) for r in args.resident.split(",")):
        eng = None
        try:
            for i, label in enumerate(margins):
                if eng is None or args.fresh:
                    if eng is not None:
                        eng.close()
                        time.sleep(0.5)
                    eng = build(resident)
                    default_margin = eng.experts.placement.margin
                    # one untimed run: the engine's warm-up captured steps without this workload's routing, and a
                    # first run would capture its graph inside the timed decode
                    eng.run([prompt] * args.batch, max_new_tokens=16, ignore_eos=True)
                place, cache = eng.experts.placement, eng.experts.cache
                place.margin = default_margin if label == "default" else float(label)
                rates, promoted, reads = [], [], []
                for _ in range(2):
                    p0, r0 = cache.counters["promotions"], cache.counters["host_reads"]
                    run = eng.run([prompt] * args.batch, max_new_tokens=128, ignore_eos=True)
                    rates.append(run.decode_tok_s)
                    promoted.append(cache.counters["promotions"] - p0)
                    reads.append(cache.counters["host_reads"] - r0)  # prompt pass included (one of 128 passes)
                best = max(range(2), key=lambda i: rates[i])  # every per-step figure from the run the rate is from
                wall = 1e6 * args.batch / rates[best]
                dec = eng._host_read[args.batch]
                rep = replay_us(dec)
                n_host = host_pairs(dec, eng.experts)
                dev_only = replay_all_device_us(dec, eng.experts)
                host_us = rep - dev_only
                gbs = n_host * cache.row_bytes / host_us / 1e3 if host_us > 0 else float("nan")
                # the run's mean step at the link's rate measured above: all-device step + its mean host reads
                mean_reads = reads[best] / 128
                rate = gbs if n_host >= 3 and host_us > 0 else args.link_gb_s  # a few reads: too short to time
                expected = dev_only + mean_reads * cache.row_bytes / (rate * 1e3)
                print(f"{resident:8d} {args.batch:5d} {place.margin:<10g}  {rates[best]:9.1f} "
                      f"({', '.join(f'{r:.1f}' for r in rates)})  {wall:12.0f} {rep:10.0f} {wall - rep:7.0f}  "
                      f"{promoted[best] / 127:.2f} ({promoted[1 - best] / 127:.2f})  | {dev_only:10.0f} "
                      f"{n_host:15d} {host_us:9.0f} {gbs:9.1f}  | {mean_reads:9.2f} {expected:9.0f} "
                      f"{wall - expected:7.0f}", flush=True)
        finally:
            if eng is not None:
                eng.close()
        time.sleep(0.5)


if __name__ == "__main__":
    main()
