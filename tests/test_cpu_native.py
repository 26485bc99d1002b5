"""The cpu-native execution sites (kernels/cpu_native.c through kernels/cpu_native.py) against the FP32 reference.

* cpu-native-i16 (activations as int16 per block, integer dot products): within 5e-4 of the reference and really
  rounded (above the FP32 bound), the same shapes, grouping and thread-count checks as below;
* FP32 arithmetic: within 1e-5 (relative Frobenius) of the FP32 reference executor before the output's rounding,
  on fresh random experts, activations, routes and gate weights, over odd shapes (partial last blocks, blocks
  that are not a multiple of the vector width, tiny K), batch 1 and small batches, a token routed twice to one
  expert, every scratch and output buffer poisoned (NaN); Hypothesis over the shape space;
* the result does not depend on the thread count (bitwise);
* the site reads the host rows as they lie: no repacked copy, and a host byte that changes changes the output;
* a subset of the experts (a mixed placement) and one expert alone equal their share of the layer;
* the decode chain's array path (``moe_subset_arrays`` on the site's job thread, ``run_arrays``, ``assignments_arrays``)
  gives the torch path's values bit for bit, over random shapes and subsets, and refuses bad arrays in one line;
* bad inputs and a missing or failing compiler get one clear line; nothing half-built is left in the cache.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runmap.format.qpack import RowLayout
from runmap.kernels import check as kc
from runmap.kernels import cpu_native
from runmap.kernels.common import KernelInputError
from runmap.kernels.cpu_int4 import CpuExpertSite, CpuSiteError
from runmap.kernels.cpu_native import EXECUTOR_PRECISION, TOLERANCE, NativeBuildError, NativeLayer, assignments
from runmap.kernels.reference import reference_moe_f32
from runmap.residency.host_source import HostSource

CPU = torch.device("cpu")
# name: (hidden H, intermediate I, block B, experts E, top-k)
SHAPES = {
    "olmoe-like": (512, 256, 256, 8, 4),
    "partial-blocks": (288, 168, 128, 5, 3),  # H and I end in partial blocks
    "block-6": (64, 34, 6, 9, 4),  # 3-byte blocks: every block goes through the scalar tail
    "block-34": (130, 98, 34, 6, 2),  # 17-byte blocks: one vector step plus a tail; H % 4 == 2
    "qwen-like": (256, 384, 256, 5, 4),  # down K = 1.5 blocks
    "tiny-k": (2, 4, 2, 3, 2),  # one byte per row
}


@pytest.fixture(autouse=True)
def poison():
    undo = kc.poison_allocations()
    yield
    undo()


def _rows(layout: RowLayout, n: int, seed: int) -> torch.Tensor:
    """n fresh random qpacked experts, uint8 (n, row_bytes)."""
    g = torch.Generator().manual_seed(seed)
    h, i = layout.hidden_size, layout.intermediate_size
    return torch.stack([layout.pack_expert({"gate": torch.randn(i, h, generator=g) / math.sqrt(h),
                                            "up": torch.randn(i, h, generator=g) / math.sqrt(h),
                                            "down": torch.randn(h, i, generator=g) / math.sqrt(i)})
                        for _ in range(n)])


def _batch(h: int, e: int, k: int, m: int, seed: int, duplicate: bool = False):
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, h, generator=g) * 2).to(torch.float16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    if duplicate and k > 1:
        ids[0, 1] = ids[0, 0]  # token 0 routed twice to one expert
    w = torch.softmax(torch.randn(m, k, generator=g), dim=1)
    return x, ids, w


def _run(layout, rows, x, ids, w, threads=None, experts=None, precision="fp32"):
    order, start, tok, wts = assignments(ids, w, experts)
    return NativeLayer(layout, precision).run([rows[e].data_ptr() for e in order], start, tok, wts, x.float(),
                                              threads)


def _rel(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("executor", ["cpu-native", "cpu-native-i16"])
def test_matches_the_fp32_reference(name, m, executor):
    precision = EXECUTOR_PRECISION[executor]
    h, i, b, e, k = SHAPES[name]
    layout = RowLayout.build(h, i, b)
    seed = 100 * m + sum(map(ord, name))
    rows = _rows(layout, e, seed)
    x, ids, w = _batch(h, e, k, m, seed, duplicate=(m == 3))
    ref = reference_moe_f32(x, ids, w, rows, torch.arange(e, dtype=torch.int32), layout)
    y = _run(layout, rows, x, ids, w, precision=precision)
    assert y.dtype == torch.float32 and y.shape == (m, h) and torch.isfinite(y).all()
    assert _rel(y, ref) <= TOLERANCE[precision], f"{name} M={m}: {_rel(y, ref):.2e}"
    if precision == "i16" and h > 8:  # the activations really are rounded (else the fp32 bound would hold)
        assert _rel(y, ref) > TOLERANCE["fp32"]
    # the registry form: float16 output, rows where the table says (shuffled, a junk row 0)
    layout2, storage, table, resident = kc.make_layer(kc.ExpertShape(name, h, i, b, e, k), CPU, seed)
    x2, ids2, w2 = kc.make_batch(kc.ExpertShape(name, h, i, b, e, k), m, resident, CPU, seed)
    from runmap.kernels.executors import moe_experts

    y2 = moe_experts(executor, x2, ids2, w2, storage, table, layout2)
    ref2 = reference_moe_f32(x2, ids2, w2, storage, table, layout2)
    assert y2.dtype == torch.float16 and torch.isfinite(y2).all()
    assert _rel(y2, ref2) <= TOLERANCE["fp16-output"]


@settings(max_examples=20, deadline=None)
@given(half_h=st.integers(1, 90), half_i=st.integers(1, 70), half_b=st.integers(1, 140), e=st.integers(1, 6),
       m=st.integers(1, 5), precision=st.sampled_from(["fp32", "i16"]), data=st.data())
def test_any_shape_matches_the_fp32_reference(half_h, half_i, half_b, e, m, precision, data):
    h, i, b = 2 * half_h, 2 * half_i, 2 * half_b
    k = data.draw(st.integers(1, e))
    seed = data.draw(st.integers(0, 2**16))
    layout = RowLayout.build(h, i, b)
    rows = _rows(layout, e, seed)
    x, ids, w = _batch(h, e, k, m, seed)
    ref = reference_moe_f32(x, ids, w, rows, torch.arange(e, dtype=torch.int32), layout)
    y = _run(layout, rows, x, ids, w, precision=precision)
    # an all-zero reference (a tiny expert whose weights all quantize to 0) is compared absolutely
    assert float((y - ref).norm()) <= TOLERANCE[precision] * max(float(ref.norm()), 1e-3)


@pytest.mark.parametrize("precision", ["fp32", "i16"])
def test_the_result_does_not_depend_on_the_thread_count_or_the_token_grouping(precision):
    h, i, b, e, k = SHAPES["partial-blocks"]
    layout = RowLayout.build(h, i, b)
    rows = _rows(layout, e, 5)
    x, ids, w = _batch(h, e, k, 6, 5, duplicate=True)
    one = _run(layout, rows, x, ids, w, threads=1, precision=precision)
    for threads in (2, 3, 7):
        got = _run(layout, rows, x, ids, w, threads=threads, precision=precision)
        assert torch.equal(got.view(torch.int32), one.view(torch.int32))
    # tokens sharing an expert share each decoded weight (up to 4 at once): each token's result is its result alone
    for t in range(6):
        alone = _run(layout, rows, x[t:t + 1], ids[t:t + 1], w[t:t + 1], precision=precision)
        assert torch.equal(alone.view(torch.int32), one[t:t + 1].view(torch.int32))


# Builds with other work splits and schedules (kernels/cpu_native.c's compile-time options): the overlapped stages
# (one work list, a down item waiting only for its own expert), single-row and odd-sized items, static and dynamic
# hand-outs. Each must give the default build's values bit for bit at every thread count.
SCHEDULES = [("STAGE_OVERLAP=1",), ("STAGE_OVERLAP=1", "ROW_CHUNK=1", "DOWN_CHUNK=3"),
             ("STAGE_OVERLAP=0", "ROW_CHUNK=7", "DOWN_CHUNK=5", "ROW_SCHEDULE=static"),
             ("STAGE_OVERLAP=0", "ROW_CHUNK=1", "ROW_SCHEDULE=dynamic,1")]


@pytest.mark.parametrize("defines", SCHEDULES, ids=lambda d: ",".join(d))
@pytest.mark.parametrize("precision", ["fp32", "i16"])
def test_every_work_split_and_schedule_gives_the_default_bit_for_bit(defines, precision):
    for name, m in (("partial-blocks", 6), ("qwen-like", 1), ("tiny-k", 3), ("olmoe-like", 5)):
        h, i, b, e, k = SHAPES[name]
        layout = RowLayout.build(h, i, b)
        rows = _rows(layout, e, 41)
        x, ids, w = _batch(h, e, k, m, 41, duplicate=True)
        order, start, tok, wts = assignments(ids, w)
        ptrs = [rows[z].data_ptr() for z in order]
        default = NativeLayer(layout, precision).run(ptrs, start, tok, wts, x.float(), 2)
        other = NativeLayer(layout, precision, defines=defines)
        for threads in (1, 2, 5):
            got = other.run(ptrs, start, tok, wts, x.float(), threads)
            assert torch.equal(got.view(torch.int32), default.view(torch.int32)), f"{name} threads {threads}"


def test_an_unknown_build_option_or_value_is_one_line():
    layout = RowLayout.build(*SHAPES["tiny-k"][:3])
    with pytest.raises(CpuSiteError, match="build option 'FAST_MATH=1': one of ROW_CHUNK"):
        NativeLayer(layout, defines=("FAST_MATH=1",))
    for bad in ("ROW_CHUNK=0", "DOWN_CHUNK=-4", "STAGE_OVERLAP=2", "ROW_SCHEDULE=auto", "ROW_SCHEDULE=guided,0"):
        with pytest.raises(CpuSiteError, match="ROW_CHUNK and DOWN_CHUNK take a positive integer"):
            NativeLayer(layout, defines=(bad,))


@pytest.mark.parametrize("defines", [(), ("STAGE_OVERLAP=1",)], ids=["default", "overlap"])
def test_a_layout_with_no_intermediate_gives_zeros_and_returns(defines):
    layout = RowLayout.build(4, 0, 2)  # an accepted layout whose down rows read nothing: no gate/up item to wait for
    rows = torch.zeros(2, layout.row_bytes, dtype=torch.uint8)
    out = np.full((1, 4), np.nan, dtype=np.float32)
    NativeLayer(layout, "fp32", defines=defines).run_arrays([rows[0].data_ptr(), rows[1].data_ptr()], [0, 1, 2],
                                                            [0, 0], [0.5, 0.5], np.ones((1, 4), np.float16), out, 3)
    assert np.array_equal(out, np.zeros((1, 4), np.float32))


def test_large_tables_are_copied_checked_before_narrowing_and_refused_in_one_line():
    h, i, b, e, k = SHAPES["partial-blocks"]
    layout = RowLayout.build(h, i, b)
    rows = _rows(layout, e, 47)
    native = NativeLayer(layout)
    m = cpu_native.SMALL_TABLE // k + 3
    x, ids, w = _batch(h, e, k, m, 47)
    order, start, tok, wts = cpu_native.assignments_arrays(ids.numpy(), w.numpy())
    ptrs = [rows[z].data_ptr() for z in order]
    want = np.empty((m, h), np.float32)
    native.run_arrays(ptrs, start, tok, wts, x.numpy(), want)
    strided = np.repeat(np.asarray(tok, dtype=np.int32), 2)[::2]  # a strided view, as a caller might slice one
    got = np.full((m, h), np.nan, np.float32)
    native.run_arrays(ptrs, np.asarray(start, dtype=np.int64), strided, np.asarray(wts), x.numpy(), got)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    wrapped = np.asarray(tok, dtype=np.int64)
    wrapped[0] += 2 ** 32  # would wrap to a valid token in int32: refused instead
    with pytest.raises(KernelInputError, match="assignment table does not fit"):
        native.run_arrays(ptrs, start, wrapped, wts, x.numpy(), got)
    for bad_start, bad_tok in (([0.0] + start[1:], tok), (start, ["a"] * len(tok)), ([0, None] + start[2:], tok)):
        with pytest.raises(KernelInputError, match="integer starts and tokens"):
            native.run_arrays(ptrs, bad_start, bad_tok, wts, x.numpy(), got)
    with pytest.raises(KernelInputError, match="integer starts and tokens"):  # the small path too
        native.run_arrays(ptrs[:1], [0, None], [0], [1.0], x.numpy()[:1], got[:1])


def _host(name: str, layers: int, seed: int):
    h, i, b, e, _k = SHAPES[name]
    layout = RowLayout.build(h, i, b)
    rows = [_rows(layout, e, seed + l) for l in range(layers)]
    return HostSource.from_rows(rows, layout), rows, layout


def test_site_reads_the_host_rows_as_they_lie():
    h, i, b, e, k = SHAPES["olmoe-like"]
    host, rows, layout = _host("olmoe-like", layers=2, seed=21)
    site = CpuExpertSite(host, executor="cpu-native")
    site.prepare()
    assert site.repacks == 0 and site.nbytes == 0 and site.precision == "fp32"
    ident = torch.arange(e, dtype=torch.int32)
    for layer in range(2):
        x, ids, w = _batch(h, e, k, 4, layer)
        y = site.moe(layer, x, ids, w)
        ref = reference_moe_f32(x, ids, w, rows[layer], ident, layout)
        assert y.dtype == torch.float16 and _rel(y, ref) <= TOLERANCE["fp16-output"]
    assert site.layer_calls == 2 and site.describe()["executor"] == "cpu-native"
    assert not host.array.flags.writeable and host.rewrite_attempts == 0

    class WritableSource:  # the host source's interface over memory a test may write (the real one is read-only)
        num_layers, num_experts = 1, e

        def __init__(self):
            self.layout, self.rows = layout, rows[0].clone()

        def row_tensor(self, layer, expert):
            return self.rows[expert]

    # the site holds the rows' addresses, not a copy: a byte written into that memory shows in the output
    src = WritableSource()
    site = CpuExpertSite(src, executor="cpu-native")
    x, ids, w = _batch(h, e, k, 1, 9)
    before = site.moe(0, x, ids, w)
    mem = src.row_tensor(0, int(ids[0, 0]))
    off = layout.section("down.scale").offset
    saved = mem[off:off + 2].clone()
    try:
        mem[off:off + 2].view(torch.float16).mul_(2)  # the first down row's first scale, doubled
        assert not torch.equal(site.moe(0, x, ids, w), before)
    finally:
        mem[off:off + 2] = saved
    assert torch.equal(site.moe(0, x, ids, w), before)


def test_subset_and_one_expert_equal_their_share_of_the_layer():
    h, i, b, e, k = SHAPES["qwen-like"]
    host, rows, layout = _host("qwen-like", layers=1, seed=4)
    site = CpuExpertSite(host, executor="cpu-native")
    x, ids, w = _batch(h, e, k, 5, 4)
    part = sorted({int(v) for v in ids[:, 0]})
    sub = site.moe_subset(0, x, ids, w, part)
    masked = torch.where(torch.isin(ids, torch.tensor(part)), w, torch.zeros_like(w))  # other slots weigh nothing
    ref = reference_moe_f32(x, ids, masked, rows[0], torch.arange(e, dtype=torch.int32), layout)
    assert sub.dtype == torch.float32 and _rel(sub, ref) <= TOLERANCE["fp32"]
    assert torch.equal(site.moe_subset(0, x, ids, w, []), torch.zeros(5, h))
    one = site.expert_output(0, 2, x[:3])
    ref1 = reference_moe_f32(x[:3], torch.full((3, 1), 2), torch.ones(3, 1), rows[0],
                             torch.arange(e, dtype=torch.int32), layout)
    assert _rel(one, ref1) <= TOLERANCE["fp32"]


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(SHAPES)), m=st.integers(1, 4), precision=st.sampled_from(["fp32", "i16"]),
       data=st.data())
def test_the_array_path_equals_the_torch_path_bit_for_bit(name, m, precision, data):
    """moe_subset_arrays (numpy in, numpy out, no torch call, run on the site's job thread as the decode chain does)
    computes moe_subset's values exactly: same assignment order, same FP32 widening, same kernel; twice in a row on
    the same thread (its reused scratch) and for any subset of the routed experts, the empty one included."""
    h, i, b, e, k = SHAPES[name]
    seed = data.draw(st.integers(0, 2**16))
    host, rows, layout = _host(name, layers=1, seed=seed % 7)
    executor = "cpu-native" if precision == "fp32" else "cpu-native-i16"
    site = CpuExpertSite(host, executor=executor)
    try:
        x, ids, w = _batch(h, e, k, m, seed, duplicate=(m > 1))
        routed = sorted({int(v) for v in ids.reshape(-1)})
        part = data.draw(st.lists(st.sampled_from(routed), unique=True)) if routed else []
        want = site.moe_subset(0, x, ids, w, part)
        for _ in range(2):
            out = np.full((m, h), np.nan, dtype=np.float32)  # every element must be written
            site.submit(site.moe_subset_arrays, 0, x.numpy(), ids.numpy(), w.numpy(), part, out).result()
            assert torch.equal(torch.from_numpy(out), want)
            # as the decode chain: prepared on this thread, run on the job thread
            out = np.full((m, h), np.nan, dtype=np.float32)
            call = site.prepare_subset_arrays(0, x.numpy(), ids.numpy(), w.numpy(), part, out)
            site.submit(call).result()
            assert torch.equal(torch.from_numpy(out), want)
        order, start, tok, wts = assignments(ids, w, part)
        got = cpu_native.assignments_arrays(ids.numpy(), w.numpy(), part)
        assert got[0] == list(order) and list(got[1]) == [int(v) for v in start]
        assert list(got[2]) == [int(v) for v in tok] and list(got[3]) == [float(v) for v in wts]
    finally:
        site.close()


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(SHAPES)), m=st.integers(1, 5), precision=st.sampled_from(["fp32", "i16"]),
       data=st.data())
def test_a_masked_call_computes_the_pairs_its_keep_mask_leaves_it_as_the_subset_call(name, m, precision, data):
    """The one-graph two-site join's call (``bind_masked_call``), bound once to fixed arrays that are rewritten between
    calls: each call computes the experts of the pairs whose keep entry is 0, with the arrays' values at that call,
    bit for bit what ``moe_subset`` computes for those experts (the same assignment order, built in C); no such pair
    writes zeros. Every call counts as a layer call."""
    h, i, b, e, k = SHAPES[name]
    seed = data.draw(st.integers(0, 2**16))
    host, rows, layout = _host(name, layers=2, seed=seed % 5)
    site = CpuExpertSite(host, executor="cpu-native" if precision == "fp32" else "cpu-native-i16")
    try:
        x_a = np.zeros((m, h), dtype=np.float16)
        ids_a, w_a = np.zeros((m, k), dtype=np.int64), np.zeros((m, k), dtype=np.float32)
        keep_a = np.ones(m * k, dtype=np.int32)
        out = np.full((m, h), np.nan, dtype=np.float32)
        # both layers bound to the same arrays and one shared scratch, as a decoder's layers (joined one at a time)
        scratch = site.masked_scratch(m, k)
        threads = data.draw(st.integers(1, 3))
        bound = [site.bind_masked_call(layer, x_a, ids_a, keep_a, w_a, out, threads=threads, scratch=scratch)
                 for layer in range(2)]
        calls = site.layer_calls
        for rep in range(3):  # the same bindings, new values each time (as each step rewrites the pinned copies)
            layer = data.draw(st.integers(0, 1))
            x, ids, w = _batch(h, e, k, m, seed + rep, duplicate=(m > 1))
            routed = sorted({int(v) for v in ids.reshape(-1)})
            part = data.draw(st.lists(st.sampled_from(routed), unique=True))
            x_a[:], ids_a[:], w_a[:] = x.numpy(), ids.numpy(), w.numpy()
            keep_a[:] = [0 if v in part else 1 for v in ids.reshape(-1).tolist()]
            out.fill(np.nan)
            bound[layer]()
            assert torch.equal(torch.from_numpy(out.copy()), site.moe_subset(layer, x, ids, w, part))
        assert site.layer_calls == calls + 3 + 3  # three bound calls (and the three moe_subset references)
    finally:
        site.close()


def test_a_masked_call_refuses_bad_arrays_and_an_id_outside_the_layer():
    """Shapes, dtypes, contiguity and overlaps are refused in one line when the call is bound; an expert id outside
    the layer is refused when a pair left to the CPU names it (nothing written), and ignored in a pair the device
    keeps (the C code reads no row for it)."""
    h, i, b, e, k = SHAPES["olmoe-like"]
    host, rows, layout = _host("olmoe-like", layers=1, seed=3)
    site = CpuExpertSite(host, executor="cpu-native")
    m = 2
    x = np.ones((m, h), dtype=np.float16)
    ids, w = np.tile(np.arange(k, dtype=np.int64), (m, 1)), np.full((m, k), 0.25, dtype=np.float32)
    keep, out = np.ones(m * k, dtype=np.int32), np.zeros((m, h), dtype=np.float32)
    shared = np.zeros(m * h, dtype=np.float32)  # an output whose first half is the input
    try:
        bad = [(dict(x=x.astype(np.float32)), "x must be a C-contiguous float16"),
               (dict(topk_ids=ids.astype(np.int32)), "ids must be a C-contiguous int64"),
               (dict(keep=keep[:-1]), r"keep must be a C-contiguous int32 \(8,\)"),
               (dict(topk_weights=np.ones((m, 2 * k), np.float32)[:, ::2]), "weights must be a C-contiguous"),
               (dict(out=out[:, :-1]), "out must be a C-contiguous float32"),
               (dict(x=shared.view(np.float16)[: m * h].reshape(m, h), out=shared.reshape(m, h)),
                "out must be writable and overlap no input"),
               (dict(threads=0), "threads 0"), (dict(layer=1), r"layer 1 is not in \[0, 1\)"),
               (dict(scratch=site.masked_scratch(m + 1, k)), r"scratch for \(T, k, E\) = \(3, 4, 8\), the call has "
                                                             r"\(2, 4, 8\)")]
        for change, match in bad:
            kw = dict(layer=0, x=x, topk_ids=ids, keep=keep, topk_weights=w, out=out, threads=2) | change
            with pytest.raises(KernelInputError, match=match):
                site.bind_masked_call(**kw)
        call = site.bind_masked_call(0, x, ids, keep, w, out, threads=2)
        ids[1, 2] = e + 5  # kept by the device: never read here
        call()
        assert np.array_equal(out, np.zeros_like(out))  # no pair left to the CPU: zeros
        keep[1 * k + 2] = 0
        out.fill(7.0)
        with pytest.raises(KernelInputError, match="names an expert outside"):
            call()
        assert (out == 7.0).all()  # nothing written
        ids[1, 2] = -1
        with pytest.raises(KernelInputError, match="names an expert outside"):
            call()
    finally:
        site.close()


def test_prepared_calls_in_flight_never_share_scratch():
    """Two calls prepared on one thread before either runs (the second larger, so the kept scratch would grow under
    the first) each compute their own values: the second takes fresh buffers while the first owns the kept ones."""
    h, i, b, e, k = SHAPES["olmoe-like"]
    host, rows, layout = _host("olmoe-like", layers=1, seed=8)
    site = CpuExpertSite(host, executor="cpu-native")
    try:
        calls, wants, outs = [], [], []
        for m, seed in ((2, 1), (5, 2), (3, 3)):
            x, ids, w = _batch(h, e, k, m, seed)
            wants.append(site.moe_subset(0, x, ids, w, range(e)))
            outs.append(np.full((m, h), np.nan, dtype=np.float32))
            calls.append(site.prepare_subset_arrays(0, x.numpy(), ids.numpy(), w.numpy(), range(e), outs[-1]))
        for call in reversed(calls):  # the last prepared runs first
            site.submit(call).result()
        for out, want in zip(outs, wants):
            assert torch.equal(torch.from_numpy(out), want)
        x, ids, w = _batch(h, e, k, 4, 9)  # nothing pending now: the kept scratch is used (and grown) again
        out = np.full((4, h), np.nan, dtype=np.float32)
        site.moe_subset_arrays(0, x.numpy(), ids.numpy(), w.numpy(), range(e), out)
        assert torch.equal(torch.from_numpy(out), site.moe_subset(0, x, ids, w, range(e)))
    finally:
        site.close()


@pytest.mark.parametrize("precision", ["fp32", "i16"])
def test_the_array_path_takes_small_and_large_tables_alike(precision):
    """Up to cpu_native.SMALL_TABLE assignments the table goes to the kernel as ctypes arrays built in Python, above it
    through numpy: both give run()'s values bit for bit, FP16 activations widened by the kernel."""
    h, i, b, e, k = SHAPES["partial-blocks"]
    layout = RowLayout.build(h, i, b)
    rows = _rows(layout, e, 43)
    native = NativeLayer(layout, precision)
    for m in (1, 7, cpu_native.SMALL_TABLE // k + 5):  # the last one is past SMALL_TABLE
        x, ids, w = _batch(h, e, k, m, 43 + m, duplicate=True)
        order, start, tok, wts = assignments(ids, w)
        want = native.run([rows[z].data_ptr() for z in order], start, tok, wts, x.float())
        table = cpu_native.assignments_arrays(ids.numpy(), w.numpy())
        assert (len(table[2]) > cpu_native.SMALL_TABLE) == (m > 7)
        out = np.full((m, h), np.nan, dtype=np.float32)
        native.run_arrays([rows[z].data_ptr() for z in table[0]], *table[1:], x.numpy(), out)
        assert torch.equal(torch.from_numpy(out).view(torch.int32), want.view(torch.int32))
    with pytest.raises(KernelInputError, match="integer starts and tokens"):
        native.run_arrays([rows[0].data_ptr()], [0, 1], [0.5], [1.0], x.numpy()[:1], out[:1])


def test_a_prepared_call_dropped_unrun_gives_its_scratch_back():
    h, i, b, e, k = SHAPES["olmoe-like"]
    layout = RowLayout.build(h, i, b)
    rows = _rows(layout, e, 49)
    native = NativeLayer(layout)
    x, out = np.ones((1, h), np.float16), np.empty((1, h), np.float32)
    args = ([rows[0].data_ptr()], [0, 1], [0], [1.0], x, out)
    first = native.prepare_arrays(*args)
    kept = native._scratch.arrays[0]
    state = native._scratch.state
    assert state.count == 1
    fresh = native.prepare_arrays(*args)  # the first still owns the kept scratch: this one gets its own
    assert fresh._keep[1][0] is not kept
    del first, fresh
    import gc

    gc.collect()
    assert state.count == 0
    again = native.prepare_arrays(*args)
    assert again._keep[1][0] is kept  # back on the kept buffers
    again()
    assert state.count == 0 and np.isfinite(out).all()


def test_the_array_path_refuses_bad_arrays_in_one_line():
    h, i, b, e, k = SHAPES["olmoe-like"]
    host, rows, layout = _host("olmoe-like", layers=1, seed=3)
    site = CpuExpertSite(host, executor="cpu-native")
    x = np.zeros((2, h), dtype=np.float16)
    ids, w, out = np.array([[0, 1], [2, 3]]), np.ones((2, 2), dtype=np.float32), np.zeros((2, h), dtype=np.float32)
    with pytest.raises(KernelInputError, match=r"topk_ids\[1, 0\] = 8 is not an expert id"):
        site.moe_subset_arrays(0, x, np.array([[0, 1], [8, 1]]), w, [0], out)
    with pytest.raises(KernelInputError, match="layer 1 is not in"):
        site.moe_subset_arrays(1, x, ids, w, [0], out)
    with pytest.raises(KernelInputError, match="topk_weights: a float32"):
        site.moe_subset_arrays(0, x, ids, w.astype(np.float64), [0], out)
    with pytest.raises(KernelInputError, match="x: a float16"):
        site.moe_subset_arrays(0, x.astype(np.float32), ids, w, [0], out)
    with pytest.raises(KernelInputError, match="out must be a C-contiguous float32"):
        site.moe_subset_arrays(0, x, ids, w, [0], np.zeros((2, h), dtype=np.float64))
    with pytest.raises(KernelInputError, match="out has 1 rows for 2 tokens"):
        site.moe_subset_arrays(0, x, ids, w, [0], np.zeros((1, h), dtype=np.float32))
    frozen = np.zeros((2, h), dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(KernelInputError, match="writable array that does not overlap x"):
        site.moe_subset_arrays(0, x, ids, w, [0], frozen)
    x32 = np.zeros((2, h), dtype=np.float32)
    with pytest.raises(KernelInputError, match="writable array that does not overlap x"):
        NativeLayer(layout).run_arrays([rows[0][0].data_ptr()], [0, 1], [0], [1.0], x32, x32)
    calls = site.layer_calls
    with pytest.raises(KernelInputError):
        site.prepare_subset_arrays(0, x, ids, w, [0], np.zeros((1, h), dtype=np.float32))
    assert site.layer_calls == calls  # a refused call is not counted
    native = NativeLayer(layout)
    with pytest.raises(KernelInputError, match="assignment table does not fit"):
        native.run_arrays([rows[0][0].data_ptr()], [0, 2], [0, 5], [1.0, 1.0], x, out)
    with pytest.raises(CpuSiteError, match="needs a cpu-native executor"):
        CpuExpertSite(host, executor="cpu-int4").moe_subset_arrays(0, x, ids, w, [0], out)


def test_bad_inputs_get_one_clear_line():
    from runmap.kernels.executors import NotResidentError, moe_experts

    h, i, b, e, k = SHAPES["olmoe-like"]
    host, rows, layout = _host("olmoe-like", layers=1, seed=3)
    site = CpuExpertSite(host, executor="cpu-native")
    x = torch.randn(2, h).to(torch.float16)
    with pytest.raises(KernelInputError, match=r"topk_ids\[1, 0\] = 8 is not an expert id"):
        site.moe(0, x, torch.tensor([[0, 1], [8, 1]]), torch.ones(2, 2))
    with pytest.raises(KernelInputError, match="layer 1 is not in"):
        site.moe(1, x, torch.tensor([[0, 1], [2, 1]]), torch.ones(2, 2))
    table = torch.tensor([0, 1, -1, 3, 4, 5, 6, 7], dtype=torch.int32)
    with pytest.raises(NotResidentError, match="expert 2"):  # never substituted
        moe_experts("cpu-native", x, torch.tensor([[0, 2], [1, 3]]), torch.ones(2, 2), rows[0], table, layout)
    with pytest.raises(CpuSiteError, match="fp32 only"):
        CpuExpertSite(host, executor="cpu-native", precision="bf16")
    with pytest.raises(CpuSiteError, match="i16 only"):
        CpuExpertSite(host, executor="cpu-native-i16", precision="fp32")
    with pytest.raises(CpuSiteError, match="'fp32' or 'i16'"):
        NativeLayer(layout, "int8")
    with pytest.raises(CpuSiteError, match="one parallel region"):
        CpuExpertSite(host, executor="cpu-native", workers=2)
    with pytest.raises(CpuSiteError, match="one parallel region"):
        site.set_workers(4)
    with pytest.raises(CpuSiteError, match="expected one of"):
        CpuExpertSite(host, executor="cpu-fast")
    with pytest.raises(KernelInputError, match="config threads"):
        moe_experts("cpu-native", x, torch.tensor([[0, 1], [1, 3]]), torch.ones(2, 2), rows[0],
                    torch.arange(e, dtype=torch.int32), layout, config={"threads": 0})


def test_a_missing_or_failing_compiler_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNMAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(NativeBuildError, match="no C compiler 'no-such-compiler-here'"):
        cpu_native.build()
    fake = tmp_path / "bin" / "cc-that-fails"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'cpu_native.c:1: error: this compiler refuses' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(NativeBuildError, match="compiling cpu_native.c failed.*this compiler refuses"):
        cpu_native.build()
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []  # no half-written library
    # a real build lands in the cache whole, and a second call finds it
    monkeypatch.delenv("CC")
    lib = cpu_native.build()
    assert lib.is_file() and lib.parent.parent.parent == tmp_path / "cache" and cpu_native.build() == lib
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


# The instruction sets the kernel has paths for, built here with -march instead of -march=native (which compiles only
# this machine's): AVX-512 without VNNI (vpmaddwd), AVX2 + FMA + F16C, and the portable loops with the bitwise half
# conversion. Each is run only where this CPU can execute it.
ISAS = {"skylake-avx512": {"avx512f", "avx512bw"}, "x86-64-v3": {"avx2", "fma", "f16c"}, "x86-64": set()}


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="the -march names are x86-64's")
@pytest.mark.parametrize("march", list(ISAS))
@pytest.mark.parametrize("precision", ["fp32", "i16"])
def test_every_instruction_set_path_matches_the_reference(march, precision):
    if not ISAS[march] <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(ISAS[march] - _cpu_flags())} for -march={march}")
    for name in ("partial-blocks", "block-34", "tiny-k"):
        h, i, b, e, k = SHAPES[name]
        layout = RowLayout.build(h, i, b)
        rows = _rows(layout, e, 31)
        x, ids, w = _batch(h, e, k, 3, 31, duplicate=True)
        x[1, :2] = torch.tensor([6e-8, -3e-6], dtype=torch.float16)  # subnormal halves: the widening's slow path
        ref = reference_moe_f32(x, ids, w, rows, torch.arange(e, dtype=torch.int32), layout)
        order, start, tok, wts = assignments(ids, w)
        native = NativeLayer(layout, precision, march=march)
        y = native.run([rows[z].data_ptr() for z in order], start, tok, wts, x.float())
        assert torch.isfinite(y).all() and _rel(y, ref) <= TOLERANCE[precision], f"{march} {name}: {_rel(y, ref):.2e}"
        # the array path hands the kernel FP16 activations, widened by this build's half conversion: the same values
        table = cpu_native.assignments_arrays(ids.numpy(), w.numpy())
        out = np.full((x.shape[0], h), np.nan, dtype=np.float32)
        native.run_arrays([rows[z].data_ptr() for z in table[0]], *table[1:], x.numpy(), out)
        assert torch.equal(torch.from_numpy(out).view(torch.int32), y.view(torch.int32)), f"{march} {name}"


@pytest.mark.parametrize("precision", ["fp32", "i16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_gives_a_non_finite_output_never_a_finite_one(precision, bad):
    h, i, b, e, k = SHAPES["olmoe-like"]
    layout = RowLayout.build(h, i, b)
    rows = _rows(layout, e, 8)
    x, ids, w = _batch(h, e, k, 2, 8)
    x = x.float()
    x[0, 5] = bad
    order, start, tok, wts = assignments(ids, w)
    y = NativeLayer(layout, precision).run([rows[z].data_ptr() for z in order], start, tok, wts, x)
    assert not torch.isfinite(y[0]).any()  # every output of the broken token is NaN / inf
    assert torch.isfinite(y[1]).all()  # the other token is untouched


def test_the_kernel_refuses_what_it_cannot_index_or_sum():
    with pytest.raises(CpuSiteError, match="blocks of at most 4096"):
        NativeLayer(RowLayout.build(8192, 64, 8192), "i16")
    layout = RowLayout.build(64, 32, 32)
    rows = _rows(layout, 2, 0)
    nl = NativeLayer(layout)
    ptrs = [rows[0].data_ptr(), rows[1].data_ptr()]
    x = torch.randn(2, 64)
    with pytest.raises(KernelInputError, match="assignment table"):
        nl.run(ptrs, [0, 1, 2], [0, 2], [1.0, 1.0], x)  # token 2 of 2
    with pytest.raises(KernelInputError, match="assignment table"):
        nl.run(ptrs, [0, 2], [0, 1], [1.0, 1.0], x)  # a start entry short
    with pytest.raises(KernelInputError, match="x: dtype float16"):
        nl.run(ptrs, [0, 1, 2], [0, 1], [1.0, 1.0], x.half())
    with pytest.raises(KernelInputError, match="threads"):
        nl.run(ptrs, [0, 1, 2], [0, 1], [1.0, 1.0], x, threads=0)
