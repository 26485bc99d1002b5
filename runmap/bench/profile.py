"""Where the time of one configuration goes: a per-kernel breakdown of one prefill and one decode step.

``profile_config(engine, prompts, decode_len, device)`` runs two more requests of the configuration under
torch.profiler, after its timed runs (run parameter ``profile: true``):

  A: the prompts with max_new_tokens=1      -> the prefill (its forward and the first token's sampling)
  B: the prompts with max_new_tokens=decode_len -> the prefill and decode_len - 1 decode steps

The prefill breakdown is A; the decode step's is (B - A) / (decode_len - 1), name by name. The bench drives
engines only through ``run`` (no hook inside a step), so a step is isolated by this difference rather than by
markers; averaging over the configuration's own decode length keeps the prefill's run-to-run noise, which
the subtraction leaves behind, small per step. A name whose difference comes out negative (noise of a
kernel both requests run) counts 0 and is counted in ``clamped``.

Time source: on CUDA the device time of every kernel, memcpy and memset (CUPTI, kernels inside CUDA-graph
replays included) and ``launches`` the device executions; ``host_launch_calls`` counts the host's launch
API calls (a CUDA-graph replay is one call for many kernels). On the CPU there are no kernels: the CPU ops'
self time (no op counted twice through its children) and their call counts.
"""
from __future__ import annotations

import torch

HOST_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                     "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def _totals(prof, device: torch.device) -> tuple[dict[str, tuple[float, int]], int]:
    """name -> (time in us, executions) from one profile; and the host launch calls (CUDA; 0 on the CPU)."""
    from torch.autograd import DeviceType

    rows: dict[str, tuple[float, int]] = {}
    host_calls = 0
    for ev in prof.key_averages():
        name = ev.key
        if name.startswith("["):  # profiler bookkeeping ([memory] and the like), no work of the model
            continue
        if device.type == "cuda":
            if ev.device_type == DeviceType.CPU:
                if name in HOST_LAUNCH_CALLS:
                    host_calls += ev.count
                continue
            t = float(ev.self_device_time_total)
        else:
            if ev.device_type != DeviceType.CPU:
                continue
            t = float(ev.self_cpu_time_total)
        if t > 0 or ev.count:
            old = rows.get(name, (0.0, 0))
            rows[name] = (old[0] + t, old[1] + ev.count)
    return rows, host_calls


def _phase(rows: dict[str, tuple[float, float]], top: int) -> dict:
    total = sum(t for t, _ in rows.values())
    ranked = sorted(rows.items(), key=lambda kv: (-kv[1][0], kv[0]))
    head, tail = ranked[:top], ranked[top:]

    def share(t):
        return t / total if total > 0 else 0.0

    return {
        "total_device_us": total,
        "launches": sum(n for _, n in rows.values()),
        "top": [{"name": k, "device_us": t, "share": share(t), "launches": n} for k, (t, n) in head],
        "other": {"names": len(tail), "device_us": sum(t for _, (t, _) in tail),
                  "share": share(sum(t for _, (t, _) in tail)), "launches": sum(n for _, (_, n) in tail)},
    }


def _profiled(engine, prompts, max_new_tokens: int, device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=acts) as prof:
        engine.run(prompts, max_new_tokens=max_new_tokens, ignore_eos=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return _totals(prof, device)


def profile_config(engine, prompts: list[list[int]], decode_len: int, device: torch.device, top: int = 12) -> dict:
    """The record's ``profile`` (schemas/bench-record.schema.json): top-``top`` names of one prefill and of
    one decode step by time, with their share of the phase's total, the rest summed in ``other``."""
    device = torch.device(device)
    a, host_a = _profiled(engine, prompts, 1, device)
    out = {
        "method": "torch.profiler over two extra requests after the timed runs: prefill = a request of 1 new "
                  "token; decode step = (a request of decode_len new tokens - the prefill request) / "
                  "(decode_len - 1), per name (negative differences count 0, see clamped)",
        "time_source": ("CUDA device time of kernels, memcpy and memset (CUPTI)" if device.type == "cuda"
                        else "CPU ops' self time (no kernels on the CPU)"),
        "device": device.type,
        "top_n": top,
        "batch": len(prompts),
        "prompt_len": len(prompts[0]),
        "prefill": {**_phase(a, top), "host_launch_calls": host_a if device.type == "cuda" else None},
    }
    steps = decode_len - 1
    if steps < 1:
        out["decode_step"] = {"status": "UNSUPPORTED", "reason": "decode_len 1: the configuration has no decode step"}
        return out
    b, host_b = _profiled(engine, prompts, decode_len, device)
    diff: dict[str, tuple[float, float]] = {}
    clamped = 0
    for name in set(a) | set(b):
        tb, nb = b.get(name, (0.0, 0))
        ta, na = a.get(name, (0.0, 0))
        dt, dn = (tb - ta) / steps, (nb - na) / steps
        if dt < 0 or dn < 0:
            clamped += 1
        dt, dn = max(dt, 0.0), max(dn, 0.0)
        if dt > 0 or dn > 0:
            diff[name] = (dt, dn)
    out["decode_step"] = {**_phase(diff, top), "steps_averaged": steps, "clamped": clamped,
                          "host_launch_calls": (host_b - host_a) / steps if device.type == "cuda" else None}
    return out
