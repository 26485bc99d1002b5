"""The executors: one registry of every W4A16 arithmetic path, read by the CLI's choices, the engine, the
kernel check, the campaign checks and the architecture test (which proves it agrees with
``specs/architecture.yaml`` and ``schemas/common.schema.json#/$defs/executor``).

Importing this module imports neither torch nor Triton, so ``runmap --help`` can list the choices.
"""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Executor:
    """One named arithmetic path for the routed experts of a layer.

    name: the recorded name (telemetry, bench records, CLI ``--executor``).
    description: one line for ``--help`` and docs.
    graph_safe: with ``validate=False`` it neither synchronizes with the host nor allocates by data, so
        a full-residency decode step that uses it can be captured in a CUDA graph.
    load: returns the implementation, ``f(x, topk_ids, topk_weights, storage, row_table, layout, config)``
        (imported on first use: the kernels pull in Triton, whose backend is chosen at CLI start).
    site: where the arithmetic runs and what it reads. "device": the engine's device, from the expert rows
        the cache holds there. "cpu": the host CPU, from the immutable host source
        (runmap.kernels.cpu_int4.CpuExpertSite; its registry form takes CPU storage only).
    """

    name: str
    description: str
    graph_safe: bool
    load: Callable[[], Callable]
    site: str = "device"


def _reference():
    from runmap.kernels.reference import reference_moe

    return lambda x, ids, w, storage, table, layout, config=None: reference_moe(x, ids, w, storage, table, layout)


def _scalar():
    from runmap.kernels.executors import scalar_moe

    return scalar_moe


def _grouped():
    from runmap.kernels.grouped import grouped_moe

    return grouped_moe


def _cpu_int4():
    from runmap.kernels.cpu_int4 import cpu_int4_moe

    return cpu_int4_moe


def _cpu_native():
    from runmap.kernels.cpu_native import cpu_native_moe

    return cpu_native_moe


def _cpu_native_i16():
    from runmap.kernels.cpu_native import cpu_native_i16_moe

    return cpu_native_i16_moe


def _topk_fused():
    from runmap.kernels.topk_fused import topk_fused_moe

    return topk_fused_moe


EXECUTORS: dict[str, Executor] = {e.name: e for e in (
    Executor("reference", "dequantize to FP32 in torch, then matmul (tests and checks)", False, _reference),
    Executor("scalar", "one W4A16 launch per (distinct routed expert, projection)", False, _scalar),
    Executor("grouped", "one launch per projection over every (token, expert) pair of a layer", True, _grouped),
    Executor("topk-fused", "decode: gate+up+SiLU*up for all top-k experts in one launch, down + weighted sum "
             "in a second", True, _topk_fused),
    Executor("cpu-int4", "CPU site: torch's CPU int4 matmul over the host source, repacked once per expert "
             "(bf16 arithmetic)", False, _cpu_int4, site="cpu"),
    Executor("cpu-native", "CPU site: a C kernel (built on first use) reading the host rows as they lie, FP32 "
             "arithmetic, all experts of a layer in one parallel region", False, _cpu_native, site="cpu"),
    Executor("cpu-native-i16", "CPU site: cpu-native with the activations as int16 per block and integer dot "
             "products (faster, ~1e-4 relative)", False, _cpu_native_i16, site="cpu"),
)}
EXECUTOR_NAMES: tuple[str, ...] = tuple(EXECUTORS)
GRAPH_SAFE_EXECUTORS: tuple[str, ...] = tuple(n for n, e in EXECUTORS.items() if e.graph_safe)
CPU_SITE_EXECUTORS: tuple[str, ...] = tuple(n for n, e in EXECUTORS.items() if e.site == "cpu")


def executor_help() -> str:
    """The executors as one --help paragraph."""
    return "; ".join(f"{e.name}: {e.description}" for e in EXECUTORS.values())
