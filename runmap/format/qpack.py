"""The qpack format: symmetric INT4 routed-expert weights with one FP16 scale per block of K values.

Quantization rule (recorded verbatim in every manifest, see ``QUANT_RULE``):

* A weight W has shape (N_out, K_in). Each row is cut along K into blocks of ``block_size`` values
  (256 by default); the last block of a row may be partial when K % block_size != 0.
* Per (row, block) scale ``s`` = the smallest FP16 value >= max|w| / 7 (rounded *up*, so that
  |w / s| <= 7 holds for the stored scale and subnormal scales never collapse to zero).
  An all-zero block has s = 0 and q = 0.
* q = clamp(round_half_even(w / s), -7, 7). Dequantized value: q * s. Hence |w - q*s| <= s/2.
* Storage: q + 8 as an unsigned nibble (1..15; 0 never occurs). Two nibbles per byte along K:
  byte j of a row holds k = 2j in the LOW nibble and k = 2j+1 in the HIGH nibble. K must be even.

One expert is one contiguous row of bytes holding gate, up and down (weights then scales for each),
each section starting at a multiple of ``SECTION_ALIGN`` bytes. ``RowLayout`` describes it.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

QMIN, QMAX = -7, 7
NIBBLE_OFFSET = 8
DEFAULT_BLOCK_SIZE = 256
SECTION_ALIGN = 128  # bytes; keeps every section aligned for vectorized GPU loads
FP16_MAX = 65504.0

QUANT_RULE = {
    "name": "symmetric-int4-absmax-v1",
    "scale": "smallest fp16 >= max(|w|)/7 per (row, block); 0 for an all-zero block",
    "quantize": "q = clamp(round_half_even(w / s), -7, 7); q = 0 where s == 0",
    "dequantize": "w_hat = q * s (computed in fp32)",
    "int_range": [QMIN, QMAX],
    "storage": "unsigned nibble q + 8; byte j of a row holds k=2j (low nibble) and k=2j+1 (high nibble)",
    "nibble_offset": NIBBLE_OFFSET,
    "nibble_order": "low-first",
    "scale_dtype": "float16",
    "accumulate_error_bound": "|w - w_hat| <= s/2 per element",
}

PROJECTIONS = ("gate", "up", "down")


class QPackError(ValueError):
    """A qpack tensor, scale or layout is malformed. The message names what."""


def num_blocks(k: int, block_size: int) -> int:
    return -(-k // block_size)


def _fp16_scale_round_up(amax: torch.Tensor) -> torch.Tensor:
    """Smallest FP16 >= amax / 7, elementwise. amax: float32 (...,) >= 0. Returns float16 (...,)."""
    target = amax.to(torch.float64) / QMAX  # float64 so the comparison below is exact
    s = target.to(torch.float16)
    too_small = s.to(torch.float64) < target
    s = torch.where(too_small, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    return s


def quantize(w: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, name: str = "weight"):
    """Quantize one weight matrix.

    Args:
        w: float tensor (N, K), any float dtype, any device; K even.
        block_size: values per scale block along K (positive, even).
        name: used in error messages.
    Returns:
        packed: uint8 (N, K // 2) on w.device — nibbles as described in the module docstring.
        scales: float16 (N, ceil(K / block_size)).
    """
    if w.dim() != 2:
        raise QPackError(f"{name}: expected a 2-D weight (N_out, K_in), got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % 2 or block_size <= 0 or block_size % 2:
        raise QPackError(f"{name}: K={k} and block_size={block_size} must both be even and positive")
    w32 = w.to(torch.float32)
    if not torch.isfinite(w32).all():
        raise QPackError(f"{name}: contains NaN or Inf")
    nb = num_blocks(k, block_size)
    pad = nb * block_size - k
    wp = torch.nn.functional.pad(w32, (0, pad)).view(n, nb, block_size)  # (N, nb, B), zero padded
    amax = wp.abs().amax(dim=2)  # (N, nb)
    if (amax / QMAX > FP16_MAX).any():
        raise QPackError(f"{name}: a block's max |w| / 7 exceeds the FP16 range; its scale cannot be stored")
    scales = _fp16_scale_round_up(amax)  # (N, nb) fp16
    s32 = scales.to(torch.float32).unsqueeze(2)  # (N, nb, 1)
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    q = torch.round(wp / safe).clamp_(QMIN, QMAX)
    q = torch.where(s32 > 0, q, torch.zeros_like(q))
    q = q.view(n, nb * block_size)[:, :k].to(torch.int16) + NIBBLE_OFFSET  # (N, K) in 1..15
    lo, hi = q[:, 0::2], q[:, 1::2]  # (N, K/2) each
    packed = (lo | (hi << 4)).to(torch.uint8)
    return packed.contiguous(), scales.contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (N, K/2) -> int8 (N, K) signed values q in [-8, 7] (valid packs use [-7, 7])."""
    p = packed.to(torch.int16)
    lo = (p & 0xF) - NIBBLE_OFFSET
    hi = (p >> 4) - NIBBLE_OFFSET
    return torch.stack((lo, hi), dim=2).reshape(packed.shape[0], -1).to(torch.int8)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, k: int, block_size: int = DEFAULT_BLOCK_SIZE):
    """Inverse of ``quantize``. packed uint8 (N, K/2), scales fp16 (N, nb). Returns float32 (N, K)."""
    n = packed.shape[0]
    nb = num_blocks(k, block_size)
    if packed.shape != (n, k // 2) or scales.shape != (n, nb):
        raise QPackError(
            f"dequantize: packed {tuple(packed.shape)} / scales {tuple(scales.shape)} do not match "
            f"N={n}, K={k}, block_size={block_size} (expected ({n}, {k // 2}) and ({n}, {nb}))"
        )
    q = unpack_nibbles(packed).to(torch.float32)  # (N, K)
    s = scales.to(torch.float32).repeat_interleave(block_size, dim=1)[:, :k]  # (N, K)
    return q * s


@dataclasses.dataclass(frozen=True)
class Section:
    """One tensor inside an expert row: ``proj`` in gate/up/down, ``kind`` in weight/scale."""

    name: str  # e.g. "gate.weight", "down.scale"
    dtype: str  # "uint8" (packed nibbles) or "float16" (scales)
    shape: tuple[int, int]
    offset: int  # bytes from the start of the row
    nbytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes}


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Byte layout of one qpacked expert row for hidden size H and expert intermediate size I.

    gate, up: W (I, H) -> weight uint8 (I, H/2), scale fp16 (I, ceil(H/B))
    down:     W (H, I) -> weight uint8 (H, I/2), scale fp16 (H, ceil(I/B))
    """

    hidden_size: int
    intermediate_size: int
    block_size: int
    sections: tuple[Section, ...]
    row_bytes: int

    @classmethod
    def build(cls, hidden_size: int, intermediate_size: int, block_size: int = DEFAULT_BLOCK_SIZE):
        h, i, b = hidden_size, intermediate_size, block_size
        if h % 2 or i % 2 or b <= 0 or b % 2:
            raise QPackError(f"row layout: hidden={h}, intermediate={i}, block_size={b} must be even and positive")
        sections, off = [], 0
        for proj, (n, k) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            for kind, dtype, shape, nbytes in (
                ("weight", "uint8", (n, k // 2), n * k // 2),
                ("scale", "float16", (n, num_blocks(k, b)), n * num_blocks(k, b) * 2),
            ):
                off = _align(off, SECTION_ALIGN)
                sections.append(Section(f"{proj}.{kind}", dtype, shape, off, nbytes))
                off += nbytes
        return cls(h, i, b, tuple(sections), _align(off, SECTION_ALIGN))

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise QPackError(f"row layout has no section {name!r}")

    def proj_dims(self, proj: str) -> tuple[int, int]:
        """(N_out, K_in) of a projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {"gate": (i, h), "up": (i, h), "down": (h, i)}[proj]

    def to_dict(self) -> dict:
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "block_size": self.block_size,
            "row_bytes": self.row_bytes,
            "section_align": SECTION_ALIGN,
            "nibble_order": "low-first",
            "sections": [s.to_dict() for s in self.sections],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RowLayout":
        built = cls.build(d["hidden_size"], d["intermediate_size"], d["block_size"])
        want = built.to_dict()
        if d.get("row_bytes") != want["row_bytes"] or d.get("sections") != want["sections"]:
            raise QPackError(
                "manifest row layout does not match the layout this version writes for "
                f"hidden={d['hidden_size']}, intermediate={d['intermediate_size']}, block={d['block_size']}"
            )
        return built

    # --- views and (de)serialization of one row -------------------------------------------------
    def view(self, row: torch.Tensor, name: str) -> torch.Tensor:
        """A typed view of one section of a uint8 (row_bytes,) tensor (no copy)."""
        s = self.section(name)
        raw = row[s.offset : s.offset + s.nbytes]
        if s.dtype == "float16":
            raw = raw.view(torch.float16)
        return raw.view(*s.shape)

    def pack_expert(self, weights: dict[str, torch.Tensor], name: str = "expert") -> torch.Tensor:
        """weights: {"gate": (I, H), "up": (I, H), "down": (H, I)} float tensors.
        Returns uint8 (row_bytes,) on the weights' device, padding bytes zero."""
        dev = weights["gate"].device
        row = torch.zeros(self.row_bytes, dtype=torch.uint8, device=dev)
        for proj in PROJECTIONS:
            w = weights[proj]
            if tuple(w.shape) != self.proj_dims(proj):
                raise QPackError(f"{name}.{proj}: shape {tuple(w.shape)}, expected {self.proj_dims(proj)}")
            packed, scales = quantize(w, self.block_size, name=f"{name}.{proj}")
            self.view(row, f"{proj}.weight").copy_(packed)
            self.view(row, f"{proj}.scale").copy_(scales)
        return row

    def dequantize_expert(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 (row_bytes,) -> {"gate": (I, H), "up": (I, H), "down": (H, I)} float32."""
        if row.dtype != torch.uint8 or row.dim() != 1 or row.numel() != self.row_bytes:
            raise QPackError(f"expert row: expected uint8 ({self.row_bytes},), got {row.dtype} {tuple(row.shape)}")
        out = {}
        for proj in PROJECTIONS:
            n, k = self.proj_dims(proj)
            out[proj] = dequantize(self.view(row, f"{proj}.weight"), self.view(row, f"{proj}.scale"), k, self.block_size)
        return out


def dequantize_rows(rows: torch.Tensor, layout: RowLayout, experts: Iterable[int] | None = None):
    """rows uint8 (E, row_bytes) -> list of per-expert dicts of float32 weights (see dequantize_expert)."""
    ids = range(rows.shape[0]) if experts is None else experts
    return [layout.dequantize_expert(rows[e]) for e in ids]
