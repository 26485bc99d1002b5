"""Options several subcommands share, defined once so that their names, checks and help agree."""
from __future__ import annotations

from runmap.engine.budget import size_argument
from runmap.engine.placement import PLACEMENTS
from runmap.kernels.registry import CPU_SITE_EXECUTORS
from runmap.residency.contracts import CONTRACT_NAMES
# the argparse value types, defined below the engine (runmap.ifeval uses them too), named here for every command
from runmap.argtypes import checked_text, even_block_size, float_in, int_at_least  # noqa: F401


def preset_argument(text: str) -> str:
    """argparse ``type=``: the name of a model preset (runmap/arch/presets)."""
    import argparse

    from runmap.arch.config import preset_names

    names = preset_names()
    if text not in names:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; choose one of {', '.join(names)}")
    return text


def add_residency_arguments(p) -> None:
    """``--resident N | --gpu-budget SIZE`` (mutually exclusive): how many experts per layer stay on the GPU; and how
    the others are reached: ``--prefill-chunk``, ``--expert-placement``, ``--cache-contract``, ``--cpu-executor``,
    ``--prefetch``."""
    res = p.add_mutually_exclusive_group()
    res.add_argument("--resident", type=int_at_least(1), default=None, metavar="N",
                     help="routed experts per layer on the device (default: all = full residency)")
    res.add_argument("--gpu-budget", type=size_argument, default=None, metavar="SIZE",
                     help="instead of --resident: plan the GPU memory (non-routed weights, KV cache, workspaces, spare "
                          "rows), keep as many experts per layer as fit SIZE (e.g. 8GiB) and cap torch's allocator at "
                          "SIZE; the plan is printed. A budget below the minimum is refused")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=None, metavar="N",
                   help="prompt tokens per row per prefill pass (default: 8,192 under full residency, 1,024 with "
                        "--gpu-budget or partial residency); lower it to bound the activation memory of long prompts "
                        "on a GPU with little room beside the experts. The output changes by rounding only (longer passes may "
                        "multiply in other kernel modes)")
    p.add_argument("--expert-placement", choices=PLACEMENTS, default="gpu",
                   help="where a routed expert that is not resident on the GPU is computed (partial residency): gpu = "
                        "copied into a spare row first (default), cpu = computed on the host CPU from the host copy, "
                        "nothing transferred, auto = host-read (below) where it is possible unless the CPU site measures "
                        "1.25x faster at startup than both the GPU's reads of host memory and the copy (never under an emulated "
                        "link), and also two-site's step (below) at the decode batch sizes from 4 (--two-site-min-batch "
                        "sets another minimum; serve's --max-batch bounds the batch) where it measures faster than "
                        "host-read's in use, else at each layer call, for its absent experts, whichever the "
                        "rates measured at startup and then in use (host->device copy, CPU expert) and the routes' reuse "
                        "say is cheaper (the CPU's rate learned apart for decode steps and prompt passes), auto-split = auto "
                        "dividing each call's absent experts between the CPU and the link so that both work at once "
                        "(opt-in: not yet shown faster in decode), host-read = decode steps read absent experts "
                        "straight from the host copy over the link inside one CUDA graph (no transfer, no host round "
                        "trip), the most used experts promoted into device rows while the next step runs (grouped executor; on a "
                        "GPU needs --cache-contract v2), two-site = host-read's reads plus the CPU site in the same "
                        "step: each layer's absent experts divided between the two by their measured rates (the "
                        "one-graph step on a GPU; same needs as host-read; on H100s it paid at batch 8 with many "
                        "misses, and at batch 1 it won on some hosts and lost on others, docs/engine.md); the plan is "
                        "printed. The route "
                        "never changes, only "
                        "where each routed expert runs. "
                        "Decode steps that may use the CPU run the CUDA-graph segment chain with a CPU part per layer "
                        "(docs/engine.md)")

    p.add_argument("--host-read-spares", type=int_at_least(1), default=None, metavar="N",
                   help="partial residency with --expert-placement host-read, two-site or auto (where it becomes one "
                        "of them): keep N spare rows per layer for promotions and make the other spare rows (one miss "
                        "group's, top_k x batch by default) resident experts, in the same GPU memory: those placements "
                        "read absent experts over the link and never fill a miss group (default: 1 with --gpu-budget, "
                        "none lent with --resident; a miss group's size or more lends none)")

    p.add_argument("--two-site-min-batch", type=int_at_least(1), default=None, metavar="B",
                   help="--expert-placement auto with both sites: the smallest decode batch whose steps may run as "
                        "two-site steps where they measure faster than host-read's (default 4, or "
                        "RUNMAP_TWO_SITE_MIN_BATCH); smaller batches always run host-read's step")

    p.add_argument("--cache-contract", choices=CONTRACT_NAMES, default="v1",
                   help="partial residency: v1 (default): host source -> pinned staging -> GPU; v2: the host source "
                        "pinned once and copied straight into spare rows, which --expert-placement host-read needs on "
                        "a GPU (docs/cache-contract.md)")

    p.add_argument("--cpu-executor", choices=CPU_SITE_EXECUTORS, default="cpu-native",
                   help="the CPU site's kernel for --expert-placement cpu/auto: cpu-native (default) = a C kernel "
                        "compiled on first use for this CPU ($CC, default cc; cached under $RUNMAP_CACHE_DIR or "
                        "~/.cache/runmap), FP32, reading the host rows as they lie; cpu-native-i16 = the same kernel "
                        "with int16 activations and integer dot products (faster per core, ~1e-4 relative); "
                        "cpu-int4 = torch's int4 matmul over copies repacked at startup, bfloat16 arithmetic, needs "
                        "no compiler")

    p.add_argument("--prefetch", action="store_true",
                   help="partial residency: while a layer computes, move the experts predicted for the next layer "
                        "(a miss transaction with no lease; a wrong guess costs bandwidth, never a result): with the "
                        "checkpoint's own routing, the next layer's router on this layer's input; under --routing "
                        "calibrated or trace, the workload's own prediction from each stream's past (docs/engine.md). "
                        "Off by default; needs the default --expert-placement gpu")


def placement_line(eng) -> str | None:
    """One line describing an engine's expert placement (None for the default, gpu)."""
    line = _placement_line(eng)
    lent = getattr(getattr(eng.experts, "cache", None), "lent_rows", 0)
    if line is not None and lent:
        c = eng.experts.cache
        how = "the default under --gpu-budget" if c.lent_by_default else \
            f"--host-read-spares {c.spares}"
        line += f"; {lent} spare rows per layer lent to residency ({how}): {c.resident} resident + {c.spares} spare"
    return line


def _placement_line(eng) -> str | None:
    pl = getattr(eng.experts, "placement", None)
    if pl is None:
        return None
    d = pl.describe()
    if d["mode"] == "cpu":
        return "expert placement cpu: absent experts are computed on the CPU from the host source (no transfers)"
    if d["mode"] == "host-read":
        chosen = f" (chosen by {d['requested']}: {d['why']})" if "requested" in d else (
            f" (the GPU reads host memory here at {d['host_read_gb_s']:.1f} GB/s)" if d.get("host_read_gb_s") else "")
        return (f"expert placement host-read{chosen}: decode steps read absent experts from the host source over the link; "
                f"beside the next step a host-read expert is promoted when the {eng.experts.cache.policy.name} policy values "
                f"it {d['promotion_margin']:g} above the coldest resident (half-life {d['half_life_tokens']:g} steps "
                f"under lfu-decay)")
    if d["mode"] == "two-site":
        def rate(v):
            return "unmeasured" if v is None else f"{v:.3g} GB/s"
        share = (f"a fixed share {d['fixed_share']:g}" if d["fixed_share"] is not None else
                 f"~{d['cpu_share']:.2f} of them (CPU site {rate(d['cpu_gb_s'])}, the GPU's host reads "
                 f"{rate(d['host_read_gb_s'])}; 1/2 where either is unmeasured)")
        if "steps" in d:  # auto with both sites (runmap.engine.placement.StepChooser)
            m = d["steps"]["min_batch"]
            where = "at every batch size" if m == 1 else f"at {m} rows or more"
            return (f"expert placement auto: host-read, and from batch {m} the two-site step "
                    f"where it measures faster ({d['why']}): decode steps read absent experts over the link; {where} "
                    f"both steps are probed and the faster runs, the two-site step "
                    f"giving the CPU site {share}; the hottest promoted beside the steps "
                    f"({eng.experts.cache.policy.name} policy, margin {d['promotion_margin']:g})")
        return (f"expert placement two-site: in each decode step every layer's absent experts are divided, the CPU "
                f"site computing {share} while the GPU reads the rest over the link; the hottest promoted after each "
                f"step ({eng.experts.cache.policy.name} policy, margin {d['promotion_margin']:g})")
    c = d["costs"]
    # (3 significant digits: a tiny test pack's rows measure well below 0.1 GB/s; on the CPU device the "transfer" is
    # a copy within host memory, no link)
    link = " (CPU device: a copy in host memory, no link)" if eng.device.type == "cpu" else ""
    head = (f"expert placement {d['mode']}: host->device {c['h2d_gb_s']:.3g} GB/s{link}, CPU site "
            f"{c['cpu_gb_s']:.3g} GB/s per expert ({c['row_bytes']} B rows): ")
    if d.get("split"):
        return head + (f"each layer call's absent experts divided, the CPU taking ~{d['cpu_share']:.2f} of them while "
                       f"the link moves the rest (more to the link when the hit rate is above "
                       f"{d['transfer_if_hit_rate_above']:.2f})")
    rule = (f"transfer a miss when the hit rate is above {d['transfer_if_hit_rate_above']:.2f}, else compute it on "
            "the CPU")
    if d.get("decode_steps") and eng.use_segments:  # auto: decode steps by measured step times (decode_steps)
        return head + (f"{rule} in prompt passes; each decode batch size probes steps that move every miss and steps "
                       "that compute every miss on the CPU, then runs the faster (probed again every "
                       f"{d['decode_steps']['revisit_steps']} steps)")
    return head + rule
