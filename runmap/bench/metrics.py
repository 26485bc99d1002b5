"""Measurement helpers of the benchmark campaign: measured values with a status, repeat statistics,
the byte floor of a decode step, the same-run device copy bandwidth, and the run environment.

A measured value is always a dict with a status, the shape of ``common.schema.json#/$defs/observation``:
``{"status": "OBSERVED", "value": V}`` (V from instrumentation), or ``{"status": "UNKNOWN" | "UNSUPPORTED",
"reason": ...}`` without a value (not instrumented in this run / the platform cannot provide it). A zero is
only ever written as an OBSERVED zero. This module imports no
jsonschema/snakemake: it runs on the GPU machine too.
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from runmap.arch.config import ModelConfig
from runmap.provenance import package_version
from runmap.format.qpack import DEFAULT_BLOCK_SIZE, RowLayout

OBSERVED, UNKNOWN, UNSUPPORTED = "OBSERVED", "UNKNOWN", "UNSUPPORTED"
STATUSES = (OBSERVED, UNKNOWN, UNSUPPORTED)
from runmap.resources import SOURCE_ROOT


def observed(value) -> dict:
    if value is None:
        raise ValueError("observed(None): use unknown() or unsupported() for a value that was not measured")
    return {"status": OBSERVED, "value": value}


def unknown(reason: str) -> dict:
    return {"status": UNKNOWN, "reason": reason}


def unsupported(reason: str) -> dict:
    return {"status": UNSUPPORTED, "reason": reason}


def is_observed(m) -> bool:
    return isinstance(m, dict) and m.get("status") == OBSERVED and m.get("value") is not None


def ratio(num: dict, den: dict, what: str) -> dict:
    """num/den of two measured values; UNKNOWN (with the reason) unless both are OBSERVED and den > 0."""
    if not is_observed(num) or not is_observed(den):
        bad = num if not is_observed(num) else den
        status = bad.get("status", UNKNOWN) if isinstance(bad, dict) else UNKNOWN
        reason = f"{what}: an operand is {status}"
        return unsupported(reason) if status == UNSUPPORTED else unknown(reason)
    if den["value"] <= 0:
        return unknown(f"{what}: denominator is {den['value']}")
    return observed(num["value"] / den["value"])


def repeat_stats(values: list[float]) -> dict:
    """Median, min and max of the timed repeats (values in run order are kept)."""
    if not values:
        raise ValueError("repeat_stats: no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


# ---- byte floor -------------------------------------------------------------------------------------

EXPERT_FORMATS = ("int4", "fp16", "bf16")


def expert_bytes(cfg: ModelConfig, expert_format: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one routed expert (gate, up, down) as the executor reads them."""
    if expert_format == "int4":
        return RowLayout.build(cfg.hidden_size, cfg.moe_intermediate_size, block_size).row_bytes
    if expert_format in ("fp16", "bf16"):
        return 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    raise ValueError(f"unknown expert format {expert_format!r}; known: {EXPERT_FORMATS}")


def nonrouted_bytes_per_step(cfg: ModelConfig, batch: int) -> int:
    """16-bit bytes every decode step reads outside the routed experts: every non-routed tensor the
    family's adapter names (attention, norms, router, shared expert, dense MLPs, final norm, lm_head),
    except that the embedding table is gathered, not streamed: `batch` rows of it. A tied lm_head reads
    the whole table once."""
    layers = [cfg.adapter.layer_tensors(cfg, l) for l in range(cfg.num_layers)]
    elems = sum(math.prod(shape) for named in (*layers, cfg.adapter.tail_tensors(cfg)) for _, shape in named.values())
    elems += batch * cfg.hidden_size  # the embedding rows of this step's tokens
    if cfg.tie_word_embeddings:
        elems += cfg.vocab_size * cfg.hidden_size
    return 2 * elems


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected size of the batch union per layer if each row picks top_k distinct experts uniformly:
    E * (1 - (1 - k/E)^B). Exactly top_k at batch 1."""
    if batch == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def byte_floor(cfg: ModelConfig, expert_format: str, batch: int, copy_bw: dict,
               block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
    """Lower bound on decode step time from bytes alone: (expert bytes of the batch union + 16-bit
    non-routed bytes) / the device copy bandwidth measured in the same run. KV-cache reads are left out
    (as in docs/architecture.md, the byte floor), so the floor is optimistic at long contexts."""
    union = expected_distinct_experts(cfg.num_experts, cfg.top_k, batch)
    eb = expert_bytes(cfg, expert_format, block_size)
    experts_step = int(round(union * cfg.num_layers * eb))
    nonrouted = nonrouted_bytes_per_step(cfg, batch)
    total = experts_step + nonrouted
    out = {
        "expert_format": expert_format,
        "expert_bytes": eb,
        "expected_union_per_layer": union,
        "expert_bytes_per_step": experts_step,
        "nonrouted_bytes_per_step": nonrouted,
        "bytes_per_step": total,
        "copy_bandwidth_gb_s": copy_bw,
        "method": "bytes_per_step = expected batch-union experts (uniform routing) x layers x expert bytes "
                  "+ fp16 non-routed weights; floor tok/s = batch / (bytes_per_step / same-run device copy GB/s)",
    }
    if is_observed(copy_bw):
        step_s = total / (copy_bw["value"] * 1e9)
        out["floor_step_s"] = observed(step_s)
        out["floor_decode_tok_s"] = observed(batch / step_s)
    else:
        out["floor_step_s"] = dict(copy_bw)
        out["floor_decode_tok_s"] = dict(copy_bw)
    return out


# ---- device ---------------------------------------------------------------------------------------

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"campaign asks for device {name!r} but torch.cuda.is_available() is False")
    return dev


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 5) -> dict:
    """Device copy bandwidth, counting read + write (2 x nbytes per copy), best of `iters`; in GB/s.
    On the CPU this is the host memcpy rate, which bounds a CPU run the same way."""
    try:
        n = nbytes if device.type == "cuda" else min(nbytes, 256 << 20)
        src = torch.empty(n, dtype=torch.uint8, device=device)
        src.random_(0, 255)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(iters):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        del src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {**observed(2 * n / best / 1e9), "unit": "GB/s",
                "source": f"best of {iters} device copies of {n} bytes, counting read + write"}
    except RuntimeError as e:  # out of memory on a busy device: say so instead of guessing
        return unknown(f"copy bandwidth measurement failed: {e}")


def h2d_bandwidth(device: torch.device, nbytes: int = 256 << 20, iters: int = 5) -> dict:
    """Pinned host -> device copy rate in GB/s (best of ``iters`` copies of ``nbytes``): the link a miss
    crosses, measured in the same run as the records that divide by it. UNSUPPORTED on the CPU."""
    if device.type != "cuda":
        return unsupported("a CPU run has no host -> device link")
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src.random_(0, 255)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)
        best = float("inf")
        for _ in range(iters):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        del src, dst
        torch.cuda.empty_cache()
        return {**observed(nbytes / best / 1e9), "unit": "GB/s",
                "source": f"best of {iters} pinned host->device copies of {nbytes} bytes"}
    except RuntimeError as e:
        return unknown(f"host->device bandwidth measurement failed: {e}")


class PeakMemory:
    """Peak allocated/reserved device memory over a region. On the CPU the figures are UNSUPPORTED
    (torch keeps no allocator statistics for host memory), never zero."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict:
        if self.device.type != "cuda":
            why = f"device {self.device.type}: torch has no allocator statistics for it"
            return {"peak_allocated_bytes": unsupported(why), "peak_reserved_bytes": unsupported(why)}
        sync(self.device)
        return {
            "peak_allocated_bytes": observed(int(torch.cuda.max_memory_allocated(self.device))),
            "peak_reserved_bytes": observed(int(torch.cuda.max_memory_reserved(self.device))),
        }


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "host": platform.node(), "cpu_count": os.cpu_count(),
            "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, total_memory_bytes=int(p.total_memory),
                    capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count)
    else:
        info["name"] = info["cpu"]
    return info


def software_info() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "safetensors": package_version("safetensors"),
        "runmap": package_version("horizon-runmap"),
        "platform": platform.platform(),
    }


def git_info() -> dict:
    """HEAD commit and dirty flag; RUNMAP_GIT_COMMIT overrides (the GPU machine gets no .git)."""
    env = os.environ.get("RUNMAP_GIT_COMMIT")
    if env:
        return {"commit": env, "dirty": None, "source": "RUNMAP_GIT_COMMIT"}
    if SOURCE_ROOT is None:  # installed from a wheel: no checkout to ask
        return {"commit": None, "dirty": None, "source": "unavailable"}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=SOURCE_ROOT, capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=SOURCE_ROOT,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip() != ""
        return {"commit": commit, "dirty": dirty, "source": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "source": "unavailable"}


@dataclasses.dataclass
class Stopwatch:
    device: torch.device
    t0: float = 0.0

    def __enter__(self):
        sync(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self.t0
        return False
