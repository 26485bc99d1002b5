"""The logic of ``runmap check-kernels``: every executor over expert shapes x token counts, each case
against the FP32 reference on fresh random inputs, with every wrapper-allocated buffer poisoned (NaN).

Importing this module does not import the kernels (Triton's interpreter switch must be set first; see
``runmap.cli.check_kernels``) and never imports jsonschema (it runs on the GPU machine as a source tree).
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from runmap.provenance import device_name, library_versions
from runmap.format.qpack import RowLayout

TOLERANCE = 2e-3  # relative Frobenius error ||y - ref|| / ||ref||
from runmap.kernels.registry import EXECUTOR_NAMES as EXECUTORS, EXECUTORS as REGISTRY


def tolerance(executor: str) -> float:
    """The bound a case is held to: TOLERANCE for the device executors (FP16 intermediates); a CPU site states
    its own (runmap.kernels.cpu_int4.TOLERANCE: bfloat16 arithmetic in torch's CPU int4 kernel; cpu-native's
    FP32 kernel is held to TOLERANCE like the device executors, far above its ~1e-6)."""
    from runmap.kernels.cpu_native import EXECUTOR_PRECISION

    if executor in EXECUTOR_PRECISION:
        return TOLERANCE
    if REGISTRY[executor].site == "cpu":
        from runmap.kernels.cpu_int4 import TOLERANCE as CPU_SITE_TOLERANCE

        return CPU_SITE_TOLERANCE["bf16"]
    return TOLERANCE


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    name: str
    hidden: int
    intermediate: int
    block_size: int
    experts: int
    top_k: int

    def to_dict(self) -> dict:
        layout = RowLayout.build(self.hidden, self.intermediate, self.block_size)
        return {"hidden": self.hidden, "intermediate": self.intermediate, "block_size": self.block_size,
                "experts": self.experts, "top_k": self.top_k, "row_bytes": layout.row_bytes}


SHAPES = {
    "tiny": (
        ExpertShape("small-b256", 256, 320, 256, 8, 4),  # down K=320: partial last block
        ExpertShape("small-b64", 256, 192, 64, 6, 2),
        # the new families' block structure at interpreter size: Qwen3-MoE narrow experts, K = 3 blocks (768 / 256),
        # top-8 of 12 (the interpreter's cost grows with the routed pairs); Mixtral few wide experts, top-2,
        # I / H = 3.5 in whole blocks (14336 / 256 = 56)
        ExpertShape("small-qwen3-moe", 128, 192, 64, 12, 8),
        ExpertShape("small-mixtral", 128, 448, 64, 8, 2),
    ),
    "full": (
        ExpertShape("olmoe", 2048, 1024, 256, 64, 8),
        ExpertShape("qwen1.5-moe", 2048, 1408, 256, 60, 4),  # down K=1408 = 5.5 blocks
        ExpertShape("qwen3-moe", 2048, 768, 256, 128, 8),  # Qwen3-30B-A3B: whole blocks, no partial one
        ExpertShape("mixtral", 4096, 14336, 256, 8, 2),  # Mixtral-8x7B: 14336 x 4096, whole blocks
    ),
}
# on CUDA the last three reach the grouped executor's decoded-weights mode at top-8 / 4 / 2 (DEQUANT_MIN_PAIRS)
M_DEFAULT = {"cpu": (1, 3, 17, 64), "cuda": (1, 2, 3, 8, 17, 64, 300, 4100, 8200, 16400)}


def make_layer(shape: ExpertShape, device: torch.device, seed: int):
    """Random experts in a storage with a spare junk row and 3/4 of the experts resident (shuffled rows).
    Returns (layout, storage uint8 (R, row_bytes), row_table int32 (E,), resident ids int64)."""
    gen = torch.Generator(device=device).manual_seed(seed)  # generate on the device: fast at full shapes
    h, i = shape.hidden, shape.intermediate
    layout = RowLayout.build(h, i, shape.block_size)
    n_res = max(shape.top_k, math.ceil(shape.experts * 0.75))
    resident = torch.randperm(shape.experts, generator=gen, device=device)[:n_res]
    rows = [torch.randint(0, 256, (layout.row_bytes,), dtype=torch.uint8, generator=gen, device=device)]  # junk row 0
    for _ in range(n_res):
        rows.append(layout.pack_expert({
            "gate": torch.randn(i, h, generator=gen, device=device) / math.sqrt(h),
            "up": torch.randn(i, h, generator=gen, device=device) / math.sqrt(h),
            "down": torch.randn(h, i, generator=gen, device=device) / math.sqrt(i),
        }))
    storage = torch.stack(rows).to(device)  # (R, row_bytes)
    row_table = torch.full((shape.experts,), -1, dtype=torch.int32, device=device)
    row_table[resident] = (torch.randperm(n_res, generator=gen, device=device) + 1).to(torch.int32)
    return layout, storage, row_table, resident


def make_batch(shape: ExpertShape, m: int, resident: torch.Tensor, device: torch.device, seed: int):
    """x fp16 (M, H), topk_ids int64 (M, k) distinct per token and repeated across tokens, weights fp32 (M, k)."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    k = shape.top_k
    x = torch.randn(m, shape.hidden, generator=gen, device=device).to(torch.float16)
    ids = torch.stack([resident[torch.randperm(resident.numel(), generator=gen, device=device)[:k]] for _ in range(m)])
    weights = torch.softmax(torch.randn(m, k, generator=gen, device=device), dim=1)
    return x.to(device), ids.to(device).contiguous(), weights.to(device).contiguous()


def poison_allocations():
    """Make runmap.kernels.common.empty return NaN-filled buffers; returns a function that undoes it."""
    from runmap.kernels import common

    real = common.empty

    def poisoned(shape, dtype, device):
        t = real(shape, dtype, device)
        t.fill_(float("nan") if dtype.is_floating_point else 0x7F)
        return t

    common.empty = poisoned
    return lambda: setattr(common, "empty", real)


def run_case(executor: str, shape: ExpertShape, m: int, device: torch.device, seed: int) -> dict:
    from runmap.kernels.executors import moe_experts
    from runmap.kernels.reference import reference_moe_f32

    layout, storage, row_table, resident = make_layer(shape, device, seed)
    x, ids, w = make_batch(shape, m, resident, device, seed)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)  # (M, H) fp32
    tol = tolerance(executor)
    t0 = time.perf_counter()
    try:
        y = moe_experts(executor, x, ids, w, storage, row_table, layout)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # recorded as a failed case, with the message
        return {"executor": executor, "shape": shape.name, "m": m, "top_k": shape.top_k, "error": None,
                "tolerance": tol, "pass": False, "finite": False, "seconds": time.perf_counter() - t0,
                "message": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]}
    seconds = time.perf_counter() - t0
    finite = bool(torch.isfinite(y).all())
    err = float((y.float() - ref).norm() / ref.norm()) if finite else None
    ok = finite and err is not None and err <= tol
    return {"executor": executor, "shape": shape.name, "m": m, "top_k": shape.top_k, "error": err,
            "tolerance": tol, "pass": ok, "finite": finite, "seconds": round(seconds, 4)}


def versions() -> dict:
    return library_versions("triton", "numpy")


def device_info(device: torch.device, interpreter: bool) -> dict:
    return {"type": device.type, "name": device_name(device), "triton_interpreter": interpreter}
