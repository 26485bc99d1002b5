"""The inline-PTX nibble decoder (runmap.kernels.core.nibbles_f16_asm) runs only on a GPU; its bit tricks are
checked here on the CPU by executing the PTX text itself with a small emulator of the five instructions it
uses. Every byte value in every position of the packed 32-bit word must decode to q = nibble - 8, with
output element i (of pack 4) belonging to input byte i, low nibbles in the first output and high nibbles in
the second, as Triton's pack = 4 elementwise contract requires."""
from __future__ import annotations

import re

import numpy as np
import pytest

from runmap.kernels.core import _NIBBLES_F16X2_PTX

PTX = getattr(_NIBBLES_F16X2_PTX, "value", _NIBBLES_F16X2_PTX)


def _halves(word: int) -> np.ndarray:
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)


def _word(h: np.ndarray) -> int:
    lo, hi = h.astype(np.float16).view(np.uint16)
    return int(lo) | int(hi) << 16


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        s = sel >> (4 * i) & 0xF
        assert s < 8, "sign-replicating selectors are not emulated"
        out |= pool[s] << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (a >> bit & 1) << 2 | (b >> bit & 1) << 1 | (c >> bit & 1)
        out |= (lut >> idx & 1) << bit
    return out


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    regs = dict(inputs)

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            regs[d] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "lop3.b32":
            regs[d] = _lop3(val(src[0]), val(src[1]), val(src[2]), val(src[3]))
        elif op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "sub.rn.f16x2":
            regs[d] = _word(_halves(val(src[0])).astype(np.float32) - _halves(val(src[1])).astype(np.float32))
        elif op == "fma.rn.f16x2":
            a, b, c = (_halves(val(s)).astype(np.float64) for s in src)
            regs[d] = _word(a * b + c)  # one rounding, as fma
        else:
            raise AssertionError(f"instruction {op!r} is not emulated")
    return regs


def test_ptx_uses_only_emulated_instructions():
    ops = {ln.strip().split()[0] for ln in PTX.splitlines() if ln.strip() and ln.strip() not in "{}"}
    assert ops <= {".reg", "prmt.b32", "lop3.b32", "mov.b32", "sub.rn.f16x2", "fma.rn.f16x2"}, ops


@pytest.mark.parametrize("position", range(4))
def test_every_byte_decodes_to_its_two_signed_nibbles(position):
    rng = np.random.default_rng(position)
    for byte in range(256):
        others = rng.integers(0, 256, size=4)
        others[position] = byte
        word = int(sum(int(b) << (8 * i) for i, b in enumerate(others)))
        out = run_ptx(PTX, {"$4": word})
        lo = np.concatenate([_halves(out["$0"]), _halves(out["$1"])])  # elements 0..3
        hi = np.concatenate([_halves(out["$2"]), _halves(out["$3"])])
        want_lo = np.array([(b & 15) - 8 for b in others], dtype=np.float16)
        want_hi = np.array([(b >> 4) - 8 for b in others], dtype=np.float16)
        np.testing.assert_array_equal(lo, want_lo)
        np.testing.assert_array_equal(hi, want_hi)


def test_emulator_catches_a_wrong_selector():
    broken = re.sub(r"0x4140", "0x4041", PTX)  # swaps bytes 0 and 1 of the low output
    out = run_ptx(broken, {"$4": 0x00000021})
    assert not np.array_equal(_halves(out["$0"]), np.array([1 - 8, 0 - 8], dtype=np.float16))
