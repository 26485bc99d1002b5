"""The words GEMV exists to issue fewer instructions per weight byte than the blocks GEMV, and the inline-PTX
nibble decoding to shrink the tensor-core loop: check both claims on the code compiled for sm_90 (Triton
compiles for a GPU target without a GPU: tools/explore/sass_stats.py). Runs the script in a subprocess
without TRITON_INTERPRET, which the other tests set."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "explore" / "sass_stats.py"


@pytest.fixture(scope="module")
def table():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # runmap from this checkout even where it is not installed (a bare copy of the tree)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def row(table, launch, family, bn, sub, nw):
    (r,) = [r for r in table if (r["launch"], r["family"], r["BLOCK_N"], r["SUB"], r["num_warps"]) ==
            (launch, family, bn, sub, nw)]
    return r


@pytest.mark.parametrize("launch, tile", [("gate_up", (16, 2, 8)), ("gate_up", (32, 2, 4)), ("down", (8, 2, 8)),
                                          ("down", (16, 2, 2))])
def test_words_loop_issues_fewer_instructions_per_byte_than_blocks(table, launch, tile):
    words, blocks = row(table, launch, "words", *tile), row(table, launch, "blocks", *tile)
    assert words["per_byte"] < 0.85 * blocks["per_byte"], (words["per_byte"], blocks["per_byte"])


def test_words_decodes_a_nibble_with_one_logic_instruction(table):
    """Mask-and-or fuses into one LOP3 only because the exponent constant is a run-time register."""
    r = row(table, "gate_up", "words", 16, 2, 8)
    nibbles_per_thread = 2 * r["bytes_per_thread"]
    assert r["opcodes"]["LOP3"] <= nibbles_per_thread, r["opcodes"]


@pytest.mark.parametrize("tile", [(32, 16, 4), (64, 64, 4)])
def test_inline_ptx_decoding_cuts_the_tensor_core_loop(table, tile):
    """kernels/core.py nibbles_f16_asm: 2.5 instructions per byte for the decode instead of Triton's
    PRMT-heavy packing of 16-bit values; the whole gate/up loop must shrink by at least a quarter."""
    asm, plain = row(table, "gate_up", "dot-asm", *tile), row(table, "gate_up", "dot", *tile)
    assert asm["per_byte"] < 0.75 * plain["per_byte"], (asm["per_byte"], plain["per_byte"])
    assert asm["opcodes"].get("HFMA2", 0) > 0, asm["opcodes"]  # the high-nibble fma.rn.f16x2 is really there


def test_script_refuses_the_interpreter():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1"), timeout=120)
    assert out.returncode != 0 and "unset TRITON_INTERPRET" in out.stderr
