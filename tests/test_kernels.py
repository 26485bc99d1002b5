"""W4A16 executors against the FP32 reference (kernels/reference.py).

CPU (CI): Triton interpreter, small expert shapes. GPU: RUNMAP_TEST_DEVICE=cuda adds the full OLMoE and
Qwen1.5-MoE expert shapes and every M for every executor, plus no-sync and CUDA-graph checks.
Every case draws fresh random weights, activations, routing (repeated experts across tokens) and gate
weights; every buffer the wrappers allocate is poisoned with NaN (see ``poison``), so an element a kernel
forgets to write shows up as NaN in the output.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runmap.kernels import common
from runmap.kernels.executors import EXECUTORS, NotResidentError, moe_experts
from runmap.kernels.reference import reference_moe_f32
from runmap.format.qpack import RowLayout

TOL = 2e-3  # relative Frobenius error against the FP32 reference
ON_GPU = not (__import__("os").environ.get("RUNMAP_TEST_DEVICE", "cpu") == "cpu")
# The CPU sites (cpu-int4) compute in bfloat16 at their own tolerance: tests/test_cpu_experts.py checks them.
KERNEL_EXECUTORS = [e for e in EXECUTORS if e != "reference" and EXECUTORS[e].site == "device"]
CPU_SITES = [e for e in EXECUTORS if EXECUTORS[e].site == "cpu"]
M_ALL = (1, 2, 3, 8, 17, 64, 300)

# name: (hidden H, intermediate I, block B, experts E, top-k)
SMALL = {
    "small-b256": (256, 320, 256, 8, 4),  # down K=320: partial last block
    "small-b64": (256, 192, 64, 6, 2),
    "odd-b128": (288, 160, 128, 5, 3),  # H and I both end in a partial block; N not a tile multiple
    "small-b96": (256, 192, 96, 6, 2),  # block not a power of two: per-element scale path
}
FULL = {
    "olmoe": (2048, 1024, 256, 64, 8),
    "qwen": (2048, 1408, 256, 60, 4),  # down K=1408 = 5.5 blocks
}


def _cases():
    """(shape, M, executor) triples. The interpreter pays per program, so the CPU set is a subset."""
    if ON_GPU:
        return [(s, m, e) for s in [*SMALL, *FULL] for m in M_ALL for e in KERNEL_EXECUTORS]
    # topk-fused is the decode path (one program per (token, expert) pair): M <= 17 on the CPU.
    cases = [("small-b256", m, e) for m in M_ALL for e in KERNEL_EXECUTORS if not (e == "topk-fused" and m > 17)]
    cases += [("small-b64", m, e) for m in (1, 17, 300) for e in KERNEL_EXECUTORS if not (e == "topk-fused" and m > 17)]
    cases += [("odd-b128", 3, "grouped"), ("odd-b128", 3, "topk-fused"), ("odd-b128", 64, "grouped")]
    cases += [("small-b96", 3, e) for e in KERNEL_EXECUTORS]
    return cases


@pytest.fixture
def device(test_device):
    return torch.device(test_device)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Every wrapper-allocated buffer starts as NaN (floats) / 0x7F (ints) instead of whatever was there."""
    real = common.empty
    calls = []

    def poisoned(shape, dtype, device):
        t = real(shape, dtype, device)
        t.fill_(float("nan") if dtype.is_floating_point else 0x7F)
        calls.append(dtype)
        return t

    monkeypatch.setattr(common, "empty", poisoned)
    return calls


def make_layer(shape, device, seed, resident_fraction=0.75):
    """Random experts packed into a storage with fewer rows than experts (partial residency) plus a spare
    row of random bytes; returns (layout, storage, row_table, resident ids)."""
    h, i, b, e, _k = shape
    gen = torch.Generator(device=device).manual_seed(seed)  # generate on the device: fast at full shapes
    layout = RowLayout.build(h, i, b)
    n_res = max(2, math.ceil(e * resident_fraction))
    resident = torch.randperm(e, generator=gen, device=device)[:n_res]
    rows = []
    for _ in range(n_res):
        scale = 0.5 + torch.rand(1, generator=gen, device=device).item()
        w = {"gate": torch.randn(i, h, generator=gen, device=device) * scale / math.sqrt(h),
             "up": torch.randn(i, h, generator=gen, device=device) / math.sqrt(h),
             "down": torch.randn(h, i, generator=gen, device=device) / math.sqrt(i)}
        rows.append(layout.pack_expert(w))
    junk = torch.randint(0, 256, (layout.row_bytes,), dtype=torch.uint8, generator=gen, device=device)  # never referenced
    storage = torch.stack([junk, *rows])  # (R, row_bytes), row 0 is junk
    perm = torch.randperm(n_res, generator=gen, device=device) + 1  # physical rows in shuffled order
    row_table = torch.full((e,), -1, dtype=torch.int32, device=device)
    row_table[resident] = perm.to(torch.int32)
    return layout, storage, row_table, resident


def make_batch(shape, m, resident, device, seed, ids_dtype=torch.int64):
    """Activations, routing among resident experts (distinct per token, repeated across tokens), weights."""
    h, _i, _b, _e, k = shape
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    k = min(k, resident.numel())
    x = (torch.randn(m, h, generator=gen, device=device) * (0.5 + torch.rand(m, 1, generator=gen, device=device))).to(torch.float16)
    ids = torch.stack([resident[torch.randperm(resident.numel(), generator=gen, device=device)[:k]] for _ in range(m)])
    weights = torch.softmax(torch.randn(m, k, generator=gen, device=device), dim=1)
    return x.to(device), ids.to(device, ids_dtype).contiguous(), weights.to(device).contiguous()


def rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape_name,m,executor", _cases())
def test_executor_matches_reference(shape_name, m, executor, device, poison):
    shape = {**SMALL, **FULL}[shape_name]
    seed = hash((shape_name, m, executor)) % 10_000
    layout, storage, row_table, resident = make_layer(shape, device, seed)
    x, ids, w = make_batch(shape, m, resident, device, seed, torch.int32 if m % 2 else torch.int64)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    assert ref.norm() > 0
    poison.clear()
    y = moe_experts(executor, x, ids, w, storage, row_table, layout)
    assert y.dtype == torch.float16 and y.shape == x.shape
    if executor != "scalar":
        assert poison, "the wrapper allocated nothing through runmap.kernels.common.empty: the poison hook is not effective"
    assert torch.isfinite(y).all(), "an output element was never written (NaN poison leaked)"
    err = rel_err(y, ref)
    assert err <= TOL, f"{executor} {shape_name} M={m}: relative error {err:.2e} > {TOL}"


def test_poison_hook_catches_an_unwritten_output(device, poison):
    """The poison must be visible: a buffer the kernels do not write comes back NaN."""
    buf = common.empty((4, 4), torch.float16, device)
    assert torch.isnan(buf).all()


@pytest.mark.parametrize("executor", ["grouped", "topk-fused"])
def test_deterministic_and_independent_of_physical_rows(executor, device):
    """Same inputs -> identical bits; moving experts to other physical rows (another residency layout)
    changes nothing, so the kernels read exactly the row the table names."""
    shape = SMALL["small-b256"]
    layout, storage, row_table, resident = make_layer(shape, device, 7)
    x, ids, w = make_batch(shape, 5, resident, device, 7)
    y1 = moe_experts(executor, x, ids, w, storage, row_table, layout)
    y2 = moe_experts(executor, x, ids, w, storage, row_table, layout)
    assert torch.equal(y1, y2)
    perm = torch.randperm(storage.shape[0], generator=torch.Generator().manual_seed(3)).to(device)
    moved = storage[perm].contiguous()  # new row r holds old row perm[r]
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=device)
    table2 = torch.where(row_table >= 0, inverse[row_table.clamp(min=0).long()].to(torch.int32), row_table)
    y3 = moe_experts(executor, x, ids, w, moved, table2, layout)
    assert torch.equal(y1, y3)


def _sorted_slots_model(ids: list[int], n_experts: int, block_m: int) -> list[int]:
    """Plain-Python model of grouped.sort_pairs: runs of pair indices per expert (invalid ids last), each
    padded with -1 to a multiple of block_m, then -1 up to the worst-case size."""
    runs = [[p for p, e in enumerate(ids) if e == x] for x in range(n_experts)]
    runs.append([p for p, e in enumerate(ids) if not 0 <= e < n_experts])
    out = []
    for run in runs:
        out += run + [-1] * (-len(run) % block_m)
    size = -(-(len(ids) + min(n_experts + 1, len(ids)) * (block_m - 1)) // block_m) * block_m
    return out + [-1] * (size - len(out))


@settings(max_examples=25, deadline=None)
@given(data=st.data(), n_experts=st.integers(1, 70), block_m=st.sampled_from([16, 64, 128]),
       ids_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_sort_pairs_matches_a_counting_sort_model(data, n_experts, block_m, ids_dtype):
    """The prefill grouping (three Triton launches) equals the model slot for slot: stable within a run,
    invalid ids in their own last run, every slot written (its buffers are poisoned)."""
    from runmap.kernels.grouped import sort_pairs
    n = data.draw(st.integers(1, 700), label="pairs")
    ids = data.draw(st.lists(st.integers(-3, n_experts + 2), min_size=n, max_size=n), label="ids")
    dev = torch.device("cuda" if ON_GPU else "cpu")
    got = sort_pairs(torch.tensor(ids, dtype=ids_dtype, device=dev), n_experts, block_m)
    assert got.dtype == torch.int32
    assert got.cpu().tolist() == _sorted_slots_model(ids, n_experts, block_m)


@pytest.mark.parametrize("n_pairs,n_experts,block_m", [(9000, 64, 64), (4097, 60, 128), (20011, 8, 16)])
def test_sort_pairs_of_long_passes_matches_the_model(n_pairs, n_experts, block_m):
    """Passes long enough that the histogram scan runs over several blocks of chunks (and, 64 experts at 9,000
    pairs, several hundred placing programs): still the model slot for slot, invalid ids included."""
    from runmap.kernels.grouped import sort_pairs
    gen = torch.Generator().manual_seed(n_pairs)
    ids = torch.randint(-2, n_experts + 2, (n_pairs,), generator=gen)
    dev = torch.device("cuda" if ON_GPU else "cpu")
    got = sort_pairs(ids.to(torch.int32).to(dev), n_experts, block_m)
    assert got.cpu().tolist() == _sorted_slots_model(ids.tolist(), n_experts, block_m)


@settings(max_examples=4 if not ON_GPU else 8)  # each new shape compiles new kernels on the GPU
@given(h_blocks=st.integers(1, 3), i_half=st.integers(4, 12), b=st.sampled_from([32, 64, 128]),
       m=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_property_grouped_and_fused_agree_with_reference(h_blocks, i_half, b, m, seed):
    """Any even shape (partial blocks included): grouped (decode path) and topk-fused stay within TOL."""
    dev = torch.device("cuda" if ON_GPU else "cpu")
    shape = (h_blocks * 64 + 32, i_half * 16, b, 5, 2)
    layout, storage, row_table, resident = make_layer(shape, dev, seed)
    x, ids, w = make_batch(shape, m, resident, dev, seed)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    for executor in ("grouped", "topk-fused"):
        y = moe_experts(executor, x, ids, w, storage, row_table, layout)
        assert rel_err(y, ref) <= TOL, executor


@pytest.mark.parametrize("config", [
    {"KERNEL": "tiles", "BLOCK_N": 16, "BLOCK_K": 512, "DOWN_BLOCK_N": 8, "DOWN_BLOCK_K": 1024},  # tiles spanning several scale blocks
    {"KERNEL": "tiles", "BLOCK_N": 64, "BLOCK_K": 32, "DOWN_BLOCK_N": 16, "DOWN_BLOCK_K": 64},  # tiles inside one scale block
    {"KERNEL": "blocks", "BLOCK_N": 16, "SUB": 3, "DOWN_BLOCK_N": 8, "DOWN_SUB": 2},  # SUB not dividing NB
    {"KERNEL": "blocks", "BLOCK_N": 8, "SUB": 1, "DOWN_BLOCK_N": 32, "DOWN_SUB": 4},
    {"KERNEL": "words", "BLOCK_N": 16, "SUB": 3, "DOWN_BLOCK_N": 8, "DOWN_SUB": 2},  # SUB not dividing NB
    {"KERNEL": "words", "BLOCK_N": 64, "SUB": 1, "DOWN_BLOCK_N": 16, "DOWN_SUB": 4},
])
@pytest.mark.parametrize("shape_name", ["small-b64", "odd-b128"])
# the CPU run: each kernel's first config on small-b64, its second on odd-b128 (conftest.py, sweep)
@pytest.mark.sweep(lambda p: (p["shape_name"] == "small-b64") != (p["config"]["BLOCK_N"] == 16))
def test_topk_fused_tile_configs(shape_name, config, device):
    """The benchmark's tile sweep must not change results: other GEMV tilings stay within TOL."""
    shape = SMALL[shape_name]
    layout, storage, row_table, resident = make_layer(shape, device, 23)
    x, ids, w = make_batch(shape, 3, resident, device, 23)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    y = moe_experts("topk-fused", x, ids, w, storage, row_table, layout, config=config)
    assert torch.isfinite(y).all() and rel_err(y, ref) <= TOL


@pytest.mark.parametrize("m", [3, 300])  # decode (pairs matched in registers) and prefill (sorted runs)
@pytest.mark.parametrize("shape_name", ["small-b64", "odd-b128", "small-b96"])
def test_grouped_nibble_decoding_forms_agree(shape_name, m, device):
    """The grouped executor's inline-PTX nibble decoding (GPU) and Triton's (everywhere) both match the
    reference, on partial blocks, odd N and per-element scales; in the interpreter DEQ_ASM is refused with
    a clear error, never silently replaced."""
    shape = SMALL[shape_name]
    layout, storage, row_table, resident = make_layer(shape, device, 29)
    x, ids, w = make_batch(shape, m, resident, device, 29)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    plain = moe_experts("grouped", x, ids, w, storage, row_table, layout, config={"DEQ_ASM": False})
    assert torch.isfinite(plain).all() and rel_err(plain, ref) <= TOL
    if not ON_GPU:
        with pytest.raises(common.KernelInputError, match="DEQ_ASM"):
            moe_experts("grouped", x, ids, w, storage, row_table, layout, config={"DEQ_ASM": True})
        return
    asm = moe_experts("grouped", x, ids, w, storage, row_table, layout, config={"DEQ_ASM": True})
    assert torch.isfinite(asm).all() and rel_err(asm, ref) <= TOL
    assert rel_err(asm, plain.float()) <= 1e-3  # same decoded values; only accumulation order may differ


# decode (one pair, repeated experts) and prefill (sorted runs); on the GPU 600 tokens pass the narrow tiles' pair
# counts for every shape here, where the default preloads
@pytest.mark.parametrize("m", [1, 3, 300] + ([600] if ON_GPU else []))
@pytest.mark.parametrize("shape_name", ["small-b256", "small-b64", "odd-b128"])
# the CPU run: the preloaded path on partial last blocks (odd-b128, 300), the per-tile one on the two others (conftest.py)
@pytest.mark.sweep(lambda p: (p["shape_name"], p["m"]) not in {("odd-b128", 300), ("small-b256", 3), ("small-b64", 1)})
def test_grouped_scales_loaded_before_the_loop_give_the_same_values(shape_name, m, device):
    """Scales read once per program before the K loop (``core.dot_tiles`` SCALE_COLS) and scales read per K tile
    give bitwise the same output, on partial last blocks (odd-b128: NB 3, a masked fourth column; small-b256's down:
    K 320), blocks smaller than the tile sweep (small-b64) and K tiles smaller than a block (BLOCK_K 64 against
    small-b256's 256); the preloaded path is the one the default config takes for sorted passes (m = 300) past the
    narrow tiles' pair counts, the per-tile one for decode and for the narrow tiles."""
    from runmap.kernels import grouped

    shape = SMALL[shape_name]
    layout, storage, row_table, resident = make_layer(shape, device, 31)
    x, ids, w = make_batch(shape, m, resident, device, 31)
    cfg = grouped.default_config(m * shape[4], device)
    sorted_pass = m * shape[4] > grouped.DECODE_MAX_PAIRS
    for proj, bn, bk in (("gate", "BLOCK_N", "BLOCK_K"), ("down", "DOWN_BLOCK_N", "DOWN_BLOCK_K")):
        sec = common.proj_sections(layout, proj)
        k = common.pick_block_k(cfg[bk], layout.block_size)
        cols = grouped.scale_cols(cfg, cfg[bn], k, layout, sec.nb)
        # on the GPU a sorted pass of few pairs per expert takes the narrow tiles, measured without the preload
        preload = sorted_pass and (not ON_GPU or m * shape[4] > grouped.SMALL_SORTED_PAIRS[-1])
        assert (cols >= sec.nb) if preload else cols == 0, proj
        assert grouped.scale_cols(dict(cfg, PRELOAD_SCALES=True), cfg[bn], k, layout, sec.nb) >= sec.nb, proj
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    # the default tiles, then K tiles of 64 (several tiles per 256-value scale block: the pick must follow k0)
    for tiles in ({}, {"BLOCK_K": 64, "DOWN_BLOCK_K": 64}):
        pre = moe_experts("grouped", x, ids, w, storage, row_table, layout, config={"PRELOAD_SCALES": True, **tiles})
        per_tile = moe_experts("grouped", x, ids, w, storage, row_table, layout,
                               config={"PRELOAD_SCALES": False, **tiles})
        assert torch.isfinite(pre).all() and rel_err(pre, ref) <= TOL, tiles
        assert torch.equal(pre, per_tile), tiles


@pytest.mark.parametrize("m", [30, 100, 400, 900])  # small-b64 (top-2): 60 / 200 / 800 / 1,800 pairs: each narrow tile
@pytest.mark.sweep(lambda p: p["m"] in (100, 900))  # the CPU run: one pass of each narrow tile (conftest.py)
def test_grouped_narrow_tiles_of_small_sorted_passes_match_reference(m, device):
    """The GPU's tiles for sorted passes with few pairs per expert (BLOCK_M 16 and 32, ``SMALL_SORTED_PAIRS``) run
    the sorted runs padded to 16 / 32 rows and match the reference, poisoned buffers and all; in the interpreter with
    Triton's own nibble decoding (the inline PTX needs a GPU). Past the last bound the 64-row tile returns."""
    from unittest import mock

    from runmap.kernels import grouped

    shape = SMALL["small-b64"]
    pairs = m * shape[4]
    # the tiles the GPU takes; a patch of its own, so the autouse poison patch stays in place for the run below
    with mock.patch.object(common, "interpreting", lambda dev: False):
        cfg = grouped.default_config(pairs, torch.device("cuda"))
        assert grouped.default_config(grouped.SMALL_SORTED_PAIRS[-1] + 1, torch.device("cuda"))["BLOCK_M"] == 64
        # decode pair counts past DECODE_FORM_MAX_PAIRS ask for the sorted runs; up to it the decode form stays
        few, more = (grouped.default_config(n, torch.device("cuda")) for n in (grouped.DECODE_FORM_MAX_PAIRS,
                                                                                  grouped.DECODE_FORM_MAX_PAIRS + 1))
    assert not few.get("SORTED") and more["SORTED"] and more["BLOCK_M"] == 16
    bound = next(b for b in grouped.SMALL_SORTED_PAIRS if pairs <= b)
    assert cfg["BLOCK_M"] == (32 if bound == grouped.SMALL_SORTED_PAIRS[-1] else 16) and not cfg["PRELOAD_SCALES"]
    assert cfg.get("SORTED", False) == (pairs <= grouped.DECODE_MAX_PAIRS)  # the decode sizes ask for sorted runs
    if not ON_GPU:
        cfg = {key: v for key, v in cfg.items() if key not in ("num_warps", "num_stages")} | {"DEQ_ASM": False}
    layout, storage, row_table, resident = make_layer(shape, device, 37)
    x, ids, w = make_batch(shape, m, resident, device, 37)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    y = moe_experts("grouped", x, ids, w, storage, row_table, layout, config=cfg)
    assert torch.isfinite(y).all() and rel_err(y, ref) <= TOL


@pytest.mark.parametrize("m", [1, 3, 17])
def test_grouped_sorted_runs_forced_at_decode_sizes_match_reference(m, device, monkeypatch):
    """Config SORTED takes the sorted runs at a decode pair count (how the decode sizes are measured against the
    decode form); both forms match the reference on the same batch."""
    from runmap.kernels import grouped

    sorts = []
    real_sort = grouped.sort_pairs
    monkeypatch.setattr(grouped, "sort_pairs", lambda *a: sorts.append(a[0].numel()) or real_sort(*a))
    shape = SMALL["small-b256"]
    layout, storage, row_table, resident = make_layer(shape, device, 41)
    x, ids, w = make_batch(shape, m, resident, device, 41)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    tiles = {"BLOCK_M": 16} if ON_GPU else {}
    # SORTED False: the decode form even where the GPU's default asks for sorted runs (past DECODE_FORM_MAX_PAIRS)
    dec = moe_experts("grouped", x, ids, w, storage, row_table, layout, config={**tiles, "SORTED": False})
    assert sorts == []  # the decode form sorts nothing
    srt = moe_experts("grouped", x, ids, w, storage, row_table, layout, config={**tiles, "SORTED": True})
    assert sorts == [m * shape[4]]
    for y in (dec, srt):
        assert torch.isfinite(y).all() and rel_err(y, ref) <= TOL


def test_topk_fused_words_family_falls_back_when_unaligned(device, monkeypatch):
    """An activation whose rows are not 4-byte aligned cannot be read as 32-bit words: the "blocks" kernels
    run instead (same result within TOL); aligned inputs run the "words" kernels."""
    import runmap.kernels.topk_fused as tf

    shape = SMALL["small-b64"]
    layout, storage, row_table, resident = make_layer(shape, device, 29)
    x, ids, w = make_batch(shape, 3, resident, device, 29)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    chosen = []
    real = tf._family
    monkeypatch.setattr(tf, "_family", lambda *a: chosen.append(real(*a)) or chosen[-1])
    cfg = {"KERNEL": "words", "BLOCK_N": 16, "SUB": 1, "DOWN_BLOCK_N": 16, "DOWN_SUB": 1}
    y = moe_experts("topk-fused", x, ids, w, storage, row_table, layout, config=cfg)
    assert chosen == ["words", "words"] and rel_err(y, ref) <= TOL
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=device)[1:].view_as(x)  # 2-byte aligned only
    shifted.copy_(x)
    chosen.clear()
    y = moe_experts("topk-fused", shifted, ids, w, storage, row_table, layout, config=cfg)
    assert chosen == ["blocks", "words"] and rel_err(y, ref) <= TOL


def test_topk_fused_words_family_needs_every_weight_section_word_aligned(device):
    """Gate and up are both read as words: one section off a 4-byte boundary is enough to fall back."""
    import runmap.kernels.topk_fused as tf

    layout, storage, _table, _res = make_layer(SMALL["small-b64"], device, 31)
    x = torch.zeros(2, layout.hidden_size, dtype=torch.float16, device=device)
    k = layout.hidden_size
    assert tf._family("words", layout, k, (0, 4096), storage, x) == "words"
    assert tf._family("words", layout, k, (0, 4098), storage, x) == "blocks"
    assert tf._family("words", layout, k, (4098, 0), storage, x) == "blocks"
    assert tf._family("blocks", layout, k, (0, 4096), storage, x) == "blocks"


# ------------------------------------------------------------------------------------------ errors


@pytest.fixture
def small(device):
    shape = SMALL["small-b64"]
    layout, storage, row_table, resident = make_layer(shape, device, 11)
    x, ids, w = make_batch(shape, 3, resident, device, 11)
    return layout, storage, row_table, resident, x, ids, w


@pytest.mark.parametrize("executor", [*KERNEL_EXECUTORS, *CPU_SITES])
def test_errors_before_launch(executor, small):
    layout, storage, row_table, _res, x, ids, w = small
    with pytest.raises(ValueError, match=r"x: dtype float32"):
        moe_experts(executor, x.float(), ids, w, storage, row_table, layout)
    wide = torch.cat([x, x], dim=1)
    with pytest.raises(ValueError, match=r"x: not contiguous"):
        moe_experts(executor, wide[:, : x.shape[1]], ids, w, storage, row_table, layout)
    with pytest.raises(ValueError, match=r"storage: row_bytes"):
        moe_experts(executor, x, ids, w, storage[:, :-128].contiguous(), row_table, layout)
    with pytest.raises(ValueError, match=r"topk_weights: dtype float16"):
        moe_experts(executor, x, ids, w.half(), storage, row_table, layout)
    with pytest.raises(ValueError, match=r"row_table: dtype int64"):
        moe_experts(executor, x, ids, w, storage, row_table.long(), layout)
    with pytest.raises(ValueError, match=r"topk_ids: shape"):
        moe_experts(executor, x, ids[:-1], w[:-1], storage, row_table, layout)
    bad = ids.clone()
    bad[1, 0] = row_table.numel()
    with pytest.raises(ValueError, match=r"topk_ids\[1, 0\] = \d+ is not an expert id"):
        moe_experts(executor, x, bad, w, storage, row_table, layout)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_non_resident_expert_is_an_error_naming_it(executor, small):
    layout, storage, row_table, _res, x, ids, w = small
    e = int(ids[2, 1])
    table = row_table.clone()
    table[e] = -1
    with pytest.raises(NotResidentError, match=rf"expert {e} \(routed by token \d+, slot \d+\) is not resident"):
        moe_experts(executor, x, ids, w, storage, table, layout)


@pytest.mark.parametrize("executor", ["grouped", "topk-fused"])
def test_unvalidated_non_resident_expert_yields_nan_never_a_substitute(executor, small):
    """validate=False skips the host check; the kernels still never read another expert for a -1: the
    tokens routed to it come back NaN, the others stay correct."""
    layout, storage, row_table, _res, x, ids, w = small
    e = int(ids[0, 0])
    table = row_table.clone()
    table[e] = -1
    y = moe_experts(executor, x, ids, w, storage, table, layout, validate=False)
    hit = (ids == e).any(dim=1)  # (T,)
    assert torch.isnan(y[hit]).all()
    if (~hit).any():
        ref = reference_moe_f32(x[~hit], ids[~hit], w[~hit], storage, row_table, layout)
        assert rel_err(y[~hit], ref) <= TOL


def test_unknown_executor(small):
    layout, storage, row_table, _res, x, ids, w = small
    with pytest.raises(ValueError, match="executor"):
        moe_experts("fast", x, ids, w, storage, row_table, layout)


# ------------------------------------------------------------------------------------------ GPU only


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("executor", ["grouped", "topk-fused"])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_validate_false_never_syncs_and_captures_in_a_cuda_graph(executor, m):
    dev = torch.device("cuda")
    shape = FULL["olmoe"]
    layout, storage, row_table, resident = make_layer(shape, dev, 5, resident_fraction=1.0)
    x, ids, w = make_batch(shape, m, resident, dev, 5)
    y0 = moe_experts(executor, x, ids, w, storage, row_table, layout, validate=False)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_experts(executor, x, ids, w, storage, row_table, layout, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            y_graph = moe_experts(executor, x, ids, w, storage, row_table, layout, validate=False)
    torch.cuda.current_stream().wait_stream(stream)
    x2, ids2, w2 = make_batch(shape, m, resident, dev, 6)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    assert rel_err(y_graph, ref) <= TOL
    assert not torch.equal(y_graph, y0)


def test_a_launch_runs_without_torch_function_modes_and_calls_around_it_are_still_seen():
    """common.launch: the launcher's metadata reads skip an active TorchFunctionMode (the copy monitor's cost),
    while a torch call of the wrapper outside the launch still reaches the mode."""
    from torch.overrides import TorchFunctionMode

    calls = []

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    t = torch.arange(4.0)

    def fake_kernel(x, *, scale):  # stands in for jit_fn[grid]: reads metadata as Triton's launcher does
        return x.data_ptr(), x.dtype, x.stride(), scale

    with Counting():
        out = common.launch(fake_kernel, t, scale=2)
        assert calls == [] and out == (t.data_ptr(), torch.float32, (1,), 2)
        t.clone()
    assert "clone" in calls


def test_the_compile_log_counts_variants_and_keeps_an_earlier_hook():
    """CompileLog through Triton's own hook call (JITFunction._call_hook, as a compilation makes it): one count per
    variant, named with its argument types and constexpr values, the hook installed before it still called, and the
    variants after mark() kept apart (however many came before)."""
    import types

    from triton import knobs
    from triton.runtime.jit import JITFunction

    def scale_kernel(x_ptr, n, BLOCK):  # never compiled here: only its signature is used
        pass

    jf = JITFunction(scale_kernel)
    options = types.SimpleNamespace(num_warps=4, num_ctas=1, num_stages=3, enable_fp_fusion=True,
                                    launch_cooperative_grid=False, extern_libs=None)
    earlier = []
    saved = knobs.runtime.jit_post_compile_hook
    try:
        knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw["fn"])
        log = common.CompileLog().install()
        log.KEEP = 2
        assert knobs.runtime.jit_post_compile_hook == log._hook

        def compiled(block):
            jf._call_hook(knobs.runtime.jit_post_compile_hook, f"key{block}",
                          {"x_ptr": "*fp16", "n": "i32", "BLOCK": "constexpr"}, 0, {(2,): block}, options, [{}], False)
        for block in (16, 32, 64):
            compiled(block)
        assert log.count == 3 and len(earlier) == 3
        assert log.variants == ["scale_kernel(x_ptr: *fp16, n: i32, BLOCK=16)", "scale_kernel(x_ptr: *fp16, n: i32, BLOCK=32)"]
        log.mark()
        compiled(128)
        assert log.since_mark == ["scale_kernel(x_ptr: *fp16, n: i32, BLOCK=128)"] and log.count == 4
    finally:
        knobs.runtime.jit_post_compile_hook = saved


@pytest.mark.parametrize("m", [150, 300])  # sorted runs (P > DECODE_MAX_PAIRS)
@pytest.mark.parametrize("shape_name", ["small-b256", "small-b64", "odd-b128", "small-b96"])
# the CPU run: every shape once, two at each m (conftest.py, sweep)
@pytest.mark.sweep(lambda p: (p["m"] == 150) != (p["shape_name"] in ("small-b256", "odd-b128")))
def test_grouped_decoded_once_mode_matches_reference(shape_name, m, device, poison):
    """The large-pass mode (weights decoded to fp16 once per pass, then fp16 grouped GEMMs), forced on small
    shapes: within TOL of the FP32 reference on partial blocks, odd N and per-element scales, every buffer
    poisoned; and it is what the default config chooses from DEQUANT_MIN_PAIRS pairs on."""
    from runmap.kernels import grouped

    shape = SMALL[shape_name]
    layout, storage, row_table, resident = make_layer(shape, device, 31 + m)
    x, ids, w = make_batch(shape, m, resident, device, 31 + m)
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout)
    y = moe_experts("grouped", x, ids, w, storage, row_table, layout, config={"DEQUANT": True})
    assert torch.isfinite(y).all() and rel_err(y, ref) <= TOL
    assert grouped.default_config(grouped.DEQUANT_MIN_PAIRS, device)["DEQUANT"]
    assert not grouped.default_config(grouped.DEQUANT_MIN_PAIRS - 1, device)["DEQUANT"]


def test_decoded_sections_are_the_fp16_of_q_times_scale(device, poison):
    """dequantize_sections equals qpack's FP32 dequantization rounded to fp16, expert by expert through the row
    table; an expert without a resident row is not decoded (its slice keeps the poison)."""
    from runmap.kernels.grouped import dequantize_sections

    shape = SMALL["odd-b128"]
    layout, storage, row_table, resident = make_layer(shape, device, 41)
    got = dequantize_sections(storage, row_table, layout)
    for e in range(row_table.numel()):
        row = int(row_table[e])
        for proj in ("gate", "up", "down"):
            if row < 0:
                assert torch.isnan(got[proj][e]).all(), (e, proj)
                continue
            want = layout.dequantize_expert(storage[row])[proj]  # fp32 (N, K)
            assert torch.equal(got[proj][e].float(), want.to(torch.float16).float()), (e, proj)


def test_decoded_once_mode_gives_nan_rows_for_a_non_resident_expert(device):
    """validate=False (as inside a pass): a token routed to an expert without a row (its decoded slice never
    written) gets NaN, and so does one routed to an id outside [0, E); the others are finite."""
    shape = SMALL["small-b64"]
    layout, storage, row_table, resident = make_layer(shape, device, 43)
    x, ids, w = make_batch(shape, 150, resident, device, 43)
    absent = int((row_table < 0).nonzero()[0])
    ids = ids.clone()
    ids[7, 0] = absent
    ids[90, 1] = row_table.numel()  # not an expert id
    y = moe_experts("grouped", x, ids, w, storage, row_table, layout, validate=False, config={"DEQUANT": True})
    assert torch.isnan(y[7]).all() and torch.isnan(y[90]).all()
    assert torch.isfinite(torch.cat([y[:7], y[8:90], y[91:]])).all()


def test_chained_launch_keywords(monkeypatch):
    """Programmatic dependent launch only where it exists and is wanted: a CUDA device of compute capability 9.0 or
    later, RUNMAP_PDL not 0, not the interpreter; everywhere else the kernels get CHAINED=False and no launch_pdl. The
    decision is kept until reset_chained."""
    from runmap.kernels import common as kc

    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(kc.PDL_ENV, raising=False)
    cuda = torch.device("cuda", 0)
    kc.reset_chained()
    try:
        assert kc.chained(torch.device("cpu")) == {"CHAINED": False}
        assert kc.chained(cuda) == {"CHAINED": True, "launch_pdl": True}
        monkeypatch.setenv(kc.PDL_ENV, "0")
        assert kc.chained(cuda) == {"CHAINED": True, "launch_pdl": True}  # decided at the first launch
        kc.reset_chained()
        assert kc.chained(cuda) == {"CHAINED": False}
        monkeypatch.setenv(kc.PDL_ENV, "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        kc.reset_chained()
        assert kc.chained(cuda) == {"CHAINED": False}
        monkeypatch.delenv("TRITON_INTERPRET")
        capability["value"] = (8, 0)  # Ampere: no griddepcontrol
        kc.reset_chained()
        assert kc.chained(cuda) == {"CHAINED": False}
    finally:
        kc.reset_chained()


def test_chained_kernels_write_nothing_before_their_wait():
    """The chain's rule as the source states it (the interpreter never runs a kernel chained, so no test run can see
    a race): every Triton kernel with a CHAINED parameter calls chain_wait(CHAINED) exactly once, in its own body and
    not under a condition; before that call it stores nothing and calls, besides tl.*, only helpers that store
    nothing either (docs/kernels.md, "The decode chain")."""
    import ast
    import inspect

    import runmap.kernels.core as core
    import runmap.kernels.fused_ops as fused_ops
    import runmap.kernels.gemv_words as gemv_words
    import runmap.kernels.grouped as grouped

    modules = (core, fused_ops, gemv_words, grouped)
    functions = {fn.name: fn for m in modules for fn in ast.parse(inspect.getsource(m)).body
                 if isinstance(fn, ast.FunctionDef)}

    def calls(node):
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                f = sub.func
                yield (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")), isinstance(f, ast.Name)

    def stores(name):
        return "store" in name or "atomic" in name

    read_ahead_helpers = {"_preload_first_block", "resolve_row", "expert_site_row", "prefetch_l2", "_split_keys"}
    for helper in read_ahead_helpers:  # and what they call in turn
        assert not any(stores(n) for n, _ in calls(functions[helper])), helper
    chained = [fn for fn in functions.values() if "CHAINED" in [a.arg for a in fn.args.args] and fn.name != "chain_wait"]
    assert len(chained) >= 13, [fn.name for fn in chained]
    for fn in chained:
        assert sum(n == "chain_wait" for n, _ in calls(fn)) == 1, f"{fn.name}: chain_wait not called exactly once"
        top = [i for i, st in enumerate(fn.body) if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
               and getattr(st.value.func, "id", "") == "chain_wait"]
        assert len(top) == 1, f"{fn.name}: chain_wait must be a statement of the kernel's own body"
        for st in fn.body[:top[0]]:
            for name, bare in calls(st):
                assert not stores(name), f"{fn.name}: {name} before chain_wait"
                assert not bare or name in read_ahead_helpers, f"{fn.name}: helper {name} before chain_wait"


# (shape name, shared expert's intermediate Is, tiles): odd Is (a partial last K chunk of the shared down); small tiles
# (several column tiles in both launches, so the pairs' programs are remapped across columns, and the shared K loops
# run past their first chunk), which the interpreter's default tiles (one column tile, one chunk) would not exercise
SMALL_TILES = {"BLOCK_N": 32, "DOWN_BLOCK_N": 64, "SHARED_BLOCK_K": 64, "SHARED_DOWN_BLOCK_K": 16}
SHARED_CASES = [("small-b256", 40, None), ("odd-b128", 600, None), ("small-b64", 513, None),
                ("odd-b128", 600, SMALL_TILES), ("small-b256", 40, dict(SMALL_TILES, SHARED_DOWN_BLOCK_N=2))] + \
    ([("qwen", 5632, None)] if ON_GPU else [])


@pytest.mark.parametrize("shape_name,s_inter,tiles", SHARED_CASES)
def test_grouped_with_a_riding_shared_expert_equals_the_two_paths(shape_name, s_inter, tiles, device, poison):
    """grouped_moe(shared=) of one token (the shared expert's programs in the routed launches, its gated output added
    by the k-slot sum) against the routed launches followed by fused_ops.shared_expert_one_row (what it replaces)
    and against an FP32 reference of the whole MoE block; every buffer poisoned."""
    from runmap.kernels.fused_ops import shared_expert_one_row
    from runmap.kernels.grouped import SharedExpert

    shape = {**SMALL, **FULL}[shape_name]
    seed = hash(("shared", shape_name, s_inter)) % 10_000
    layout, storage, row_table, resident = make_layer(shape, device, seed)
    x, ids, w = make_batch(shape, 1, resident, device, seed)
    hid = layout.hidden_size
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    gug = (torch.randn(2 * s_inter + 1, hid, generator=gen, device=device) / math.sqrt(hid)).half()
    down = (torch.randn(hid, s_inter, generator=gen, device=device) / math.sqrt(s_inter)).half()
    poison.clear()
    y = moe_experts("grouped", x, ids, w, storage, row_table, layout, shared=SharedExpert(x, gug, down), config=tiles)
    assert poison and y.shape == x.shape and y.dtype == torch.float16 and torch.isfinite(y).all()
    two = shared_expert_one_row(x, gug, down, moe_experts("grouped", x, ids, w, storage, row_table, layout,
                                                          config=tiles))
    # the same roundings; the sums in another order (other tiles; on a GPU a product and a sum may be contracted)
    diff = (y.float() - two.float()).abs().max().item()
    assert diff <= 2e-3 * two.float().abs().max().item(), diff
    xf = x.float()
    gu = xf @ gug.float().t()  # (1, 2 Is + 1)
    shared32 = torch.sigmoid(gu[:, -1:]) * ((torch.nn.functional.silu(gu[:, :s_inter]) * gu[:, s_inter:-1])
                                            @ down.float().t())
    ref = reference_moe_f32(x, ids, w, storage, row_table, layout) + shared32
    assert rel_err(y, ref) <= 4 * TOL, rel_err(y, ref)


def test_a_riding_shared_expert_is_refused_where_it_cannot_ride(device):
    from runmap.kernels.grouped import SharedExpert

    shape = SMALL["small-b64"]
    layout, storage, row_table, resident = make_layer(shape, device, 5)
    x, ids, w = make_batch(shape, 2, resident, device, 5)
    hid = layout.hidden_size
    gug, down = torch.zeros(2 * 8 + 1, hid, dtype=torch.float16, device=device), \
        torch.zeros(hid, 8, dtype=torch.float16, device=device)
    with pytest.raises(common.KernelInputError, match="one token"):  # two tokens
        moe_experts("grouped", x, ids, w, storage, row_table, layout, shared=SharedExpert(x[:1], gug, down))
    x1, ids1, w1 = x[:1], ids[:1].contiguous(), w[:1].contiguous()
    with pytest.raises(common.KernelInputError, match="topk-fused"):  # another executor
        moe_experts("topk-fused", x1, ids1, w1, storage, row_table, layout, shared=SharedExpert(x1, gug, down))
    with pytest.raises(common.KernelInputError, match="2 \\* Is \\+ 1"):  # gate | up | gate row: 2 Is + 1 rows
        moe_experts("grouped", x1, ids1, w1, storage, row_table, layout,
                    shared=SharedExpert(x1, torch.zeros(18, hid, dtype=torch.float16, device=device),
                                        torch.zeros(hid, 9, dtype=torch.float16, device=device)))


@pytest.mark.parametrize("shape,want,ok", [((2, 3), (2, None), True), ((2, 3, 1), (2, None), False),
                                           ((6,), (None, 3), False), ((2, 3), (2, 4), False), ((1,), (1,), True)])
def test_check_tensor_compares_rank_and_every_dimension(shape, want, ok):
    """A ``shape=`` check names every dimension: a tensor with more or fewer dimensions fails it even where the
    dimensions it has agree (zip alone would stop at the shorter one)."""
    t = torch.zeros(shape)
    if ok:
        common.check_tensor("t", t, shape=want)
    else:
        with pytest.raises(common.KernelInputError, match="^t: "):
            common.check_tensor("t", t, shape=want)
