"""The cpu-int4 execution site (kernels/cpu_int4.py) against the FP32 reference executor.

* the repack represents qpack's blocks exactly: in FP32 mode, the identity matrix as activations returns
  the qpack dequantization bit for bit, partial last blocks and padded N / K included;
* the bf16 runtime path is within its stated tolerance of the FP32 reference on fresh random experts,
  activations, routes and gate weights, over odd shapes, with every allocation poisoned (NaN);
* the site repacks each expert once, from the host source only, and records the memory the copies hold;
* the engine with executor="cpu-int4" gives the reference executor's teacher-forced logits at every
  position within the engine tolerance, for tiny-olmoe and tiny-qwen2-moe;
* concurrent experts (``CpuExpertSite(workers=...)``): the output is bitwise the one-worker output on fresh
  random inputs (odd shapes, batch 1 and small batches, more workers than experts, Hypothesis over worker
  counts); the experts really run on the workers, with their own torch thread count, leaving the caller's and
  the default alone; an error in a worker reaches the caller as the serial site's error after the call's
  running terms finished, and the workers stay usable; repacks of distinct experts overlap, one expert is
  repacked once.
"""
from __future__ import annotations

import math

import pytest
import torch

from runmap.format.qpack import RowLayout
from runmap.kernels import check as kc
from runmap.kernels import cpu_int4
from runmap.kernels.common import KernelInputError
from runmap.kernels.cpu_int4 import TOLERANCE, CpuExpertSite, CpuSiteError, cpu_int4_moe, repack_expert
from runmap.kernels.reference import reference_moe_f32
from runmap.residency.host_source import HostSource

CPU = torch.device("cpu")
# name: (hidden H, intermediate I, block B, experts E, top-k). Each exercises a different repack case.
SHAPES = {
    "b256-partial": (256, 320, 256, 8, 4),  # down K=320: 1.25 blocks -> groups of 64
    "b64": (256, 192, 64, 6, 2),  # block 64: groups of 64
    "b128-odd": (288, 168, 128, 5, 3),  # H=288 and I=168 end in partial blocks; N=2I=336 and I pad to 16
    "b96": (256, 192, 96, 6, 2),  # block not a power of two: groups of 32
    "k-pad": (256, 40, 256, 4, 2),  # down K=40: no accepted group divides it -> K padded with zero columns
    "qwen-like": (256, 384, 256, 5, 4),  # down K = 1.5 blocks: groups of 128, as Qwen1.5-MoE's 5.5 blocks
}


def _shape(name: str) -> kc.ExpertShape:
    return kc.ExpertShape(name, *SHAPES[name])


@pytest.fixture(autouse=True)
def poison():
    """Every buffer allocated through runmap.kernels.common.empty starts as NaN."""
    undo = kc.poison_allocations()
    yield
    undo()


def _row(layout: RowLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h, i = layout.hidden_size, layout.intermediate_size
    return layout.pack_expert({"gate": torch.randn(i, h, generator=g), "up": torch.randn(i, h, generator=g) * 3,
                               "down": torch.randn(h, i, generator=g) / 5})


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp32_repack_reproduces_the_qpack_dequantization_exactly(name):
    h, i, b, _e, _k = SHAPES[name]
    layout = RowLayout.build(h, i, b)
    row = _row(layout, seed=sum(map(ord, name)))
    w = layout.dequantize_expert(row)  # fp32 {"gate": (I, H), "up": (I, H), "down": (H, I)}
    rep = repack_expert(row, layout, "fp32")
    gu = rep.gate_up.matmul(torch.eye(h))  # (H, 2I): row k = column k of the stacked (2I, H) weights
    assert torch.equal(gu[:, :i], w["gate"].T) and torch.equal(gu[:, i:], w["up"].T)
    assert torch.equal(rep.down.matmul(torch.eye(i)), w["down"].T)


@pytest.mark.parametrize("name", ["b256-partial", "b128-odd"])
def test_bf16_repack_rounds_each_scale_and_weight_once_to_bfloat16(name):
    """The bf16 kernel's dequantized weight is exactly bf16(q * bf16(s)): two roundings of at most 2^-8
    relative each, so every weight lies within 2^-7 of qpack's q * s (and zero stays zero)."""
    from runmap.format.qpack import unpack_nibbles

    h, i, b, _e, _k = SHAPES[name]
    layout = RowLayout.build(h, i, b)
    row = _row(layout, seed=7)
    w = layout.dequantize_expert(row)["down"]  # (H, I) fp32
    q = unpack_nibbles(layout.view(row, "down.weight")).float()
    s = layout.view(row, "down.scale").float().repeat_interleave(b, dim=1)[:, :i]
    modelled = (q * s.to(torch.bfloat16).float()).to(torch.bfloat16).float()
    rep = repack_expert(row, layout, "bf16")
    got = rep.down.matmul(torch.eye(i, dtype=torch.bfloat16)).float().T  # (H, I)
    assert torch.equal(got, modelled)
    err = (got - w).abs()
    assert bool((err <= 2.0 ** -7 * w.abs()).all()), float(err.max())
    assert float(err.max()) > 0  # bfloat16 really rounds: the tolerance below is needed, not decoration


CASES = [(s, m) for s in SHAPES for m in (1, 4)] + [("b256-partial", 3), ("b64", 17), ("qwen-like", 8)]


@pytest.mark.parametrize("name,m", CASES)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cpu_int4_matches_the_fp32_reference(name, m, precision):
    from runmap.kernels.executors import moe_experts

    shape = _shape(name)
    seed = 1000 * m + sum(map(ord, name)) + (7 if precision == "fp32" else 0)
    layout, storage, table, resident = kc.make_layer(shape, CPU, seed)  # fresh random experts, junk row 0
    x, ids, w = kc.make_batch(shape, m, resident, CPU, seed)  # randn activations: never zeros
    assert float((x != 0).float().mean()) > 0.99 and float(x.abs().mean()) > 0.5
    ref = reference_moe_f32(x, ids, w, storage, table, layout)
    y = moe_experts("cpu-int4", x, ids, w, storage, table, layout, config={"precision": precision})
    assert y.dtype == torch.float16 and y.shape == (m, shape.hidden)
    assert torch.isfinite(y).all(), "an output element was not written (poisoned NaN survived)"
    err = float((y.float() - ref).norm() / ref.norm())
    assert err <= TOLERANCE[precision], f"{name} M={m} {precision}: relative error {err:.2e}"


def _host(shape: kc.ExpertShape, layers: int, seed: int):
    layout = RowLayout.build(shape.hidden, shape.intermediate, shape.block_size)
    rows = [torch.stack([_row(layout, seed + 100 * l + e) for e in range(shape.experts)]) for l in range(layers)]
    return HostSource.from_rows(rows, layout), rows, layout


def test_site_repacks_each_expert_once_from_the_host_source_and_records_its_memory():
    shape = _shape("b256-partial")
    host, rows, layout = _host(shape, layers=2, seed=11)
    site = CpuExpertSite(host)
    ident = torch.arange(shape.experts, dtype=torch.int32)
    for layer in range(2):
        resident = torch.arange(shape.experts)
        x, ids, w = kc.make_batch(shape, 5, resident, CPU, seed=layer)
        ref = reference_moe_f32(x, ids, w, rows[layer], ident, layout)
        for _ in range(2):  # the second call reuses the repacked copies
            y = site.moe(layer, x, ids, w)
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= TOLERANCE["bf16"], f"layer {layer}: {err:.2e}"
    used = {(l, e) for l in range(2) for e in range(shape.experts) if (l, e) in site._cache}
    assert site.repacks == len(used) > 0
    assert site.source_bytes_read == site.repacks * layout.row_bytes
    assert site.nbytes == sum(site._cache[k].nbytes for k in used)
    # the copy stays INT4 (no expanded FP16/BF16 expert): weights as many bytes as qpack's, scales 4x
    assert layout.row_bytes <= site.nbytes / site.repacks <= 1.25 * layout.row_bytes
    assert not host.array.flags.writeable and host.rewrite_attempts == 0
    # one expert alone (the call a mixed placement makes) equals its share of the layer output
    x1 = torch.randn(2, shape.hidden).to(torch.float16)
    one = site.expert_output(0, 3, x1)
    full = site.moe(0, x1, torch.full((2, 1), 3, dtype=torch.int64), torch.ones(2, 1))
    assert torch.equal(one.to(torch.float16), full)


def test_site_refuses_rows_that_are_not_in_host_memory():
    class DeviceRows:  # a source whose rows live elsewhere (meta stands in for a GPU here)
        layout = RowLayout.build(256, 192, 64)
        num_layers, num_experts = 1, 2

        def row_tensor(self, layer, expert):
            return torch.empty(self.layout.row_bytes, dtype=torch.uint8, device="meta")

    site = CpuExpertSite(DeviceRows())
    with pytest.raises(CpuSiteError, match="host rows only"):
        site.expert_output(0, 1, torch.randn(1, 256))
    storage = torch.empty(2, DeviceRows.layout.row_bytes, dtype=torch.uint8, device="meta")
    with pytest.raises(KernelInputError, match="never reads device rows"):
        cpu_int4_moe(torch.randn(1, 256).half(), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1),
                     storage, torch.zeros(2, dtype=torch.int32), DeviceRows.layout)


def test_bad_inputs_get_one_clear_line():
    from runmap.kernels.executors import NotResidentError, moe_experts

    shape = _shape("b64")
    host, rows, layout = _host(shape, layers=1, seed=3)
    site = CpuExpertSite(host)
    x = torch.randn(2, shape.hidden).to(torch.float16)
    with pytest.raises(KernelInputError, match=r"topk_ids\[1, 0\] = 6 is not an expert id"):
        site.moe(0, x, torch.tensor([[0, 1], [6, 1]]), torch.ones(2, 2))
    with pytest.raises(KernelInputError, match="x: dtype float32"):
        site.moe(0, x.float(), torch.tensor([[0, 1], [2, 1]]), torch.ones(2, 2))
    with pytest.raises(KernelInputError, match="layer 1 is not in"):
        site.moe(1, x, torch.tensor([[0, 1], [2, 1]]), torch.ones(2, 2))
    table = torch.tensor([0, 1, -1, 3, 4, 5], dtype=torch.int32)
    with pytest.raises(NotResidentError, match="expert 2"):  # never substituted
        moe_experts("cpu-int4", x, torch.tensor([[0, 2], [1, 3]]), torch.ones(2, 2), rows[0], table, layout)
    with pytest.raises(CpuSiteError, match="block_size 16"):
        repack_expert(torch.zeros(RowLayout.build(64, 32, 16).row_bytes, dtype=torch.uint8),
                      RowLayout.build(64, 32, 16))
    with pytest.raises(CpuSiteError, match="precision"):
        CpuExpertSite(host, precision="int8")


def test_group_size_choice():
    assert cpu_int4.group_size(2048, 256) == (256, 2048)
    assert cpu_int4.group_size(1408, 256) == (128, 1408)  # Qwen1.5-MoE's down: 5.5 blocks
    assert cpu_int4.group_size(320, 256) == (64, 320)
    assert cpu_int4.group_size(40, 256) == (256, 256)  # nothing divides 40: padded
    assert cpu_int4.group_size(192, 96) == (32, 192)


# ---- the engine ----------------------------------------------------------------------------------------

ENGINE_PRESETS = ("tiny-olmoe", "tiny-qwen2-moe")


@pytest.fixture(scope="module")
def tiny_packs(seed3_tiny_packs):
    return seed3_tiny_packs


@pytest.mark.parametrize("preset,executor", [(p, e) for p in ENGINE_PRESETS for e in ("cpu-int4", "cpu-native")]
                         + [("tiny-qwen2-moe", "cpu-native-i16")])
def test_engine_teacher_forced_logits_equal_the_reference_executor(tiny_packs, preset, executor):
    from runmap.engine.engine import Engine

    pack, cfg = tiny_packs[preset]
    eng = Engine.from_pack(pack, executor=executor, device="cpu", max_batch=1, max_seq_len=32)
    try:
        g = torch.Generator().manual_seed(len(preset))
        prompt = torch.randint(3, cfg.vocab_size, (12,), generator=g).tolist()
        got = eng.logits(prompt)  # (T, V): every position, teacher-forced by the prompt
        calls = eng.experts.cpu_site.layer_calls
        ref = eng.logits(prompt, executor="reference")
        assert got.shape == ref.shape == (len(prompt), cfg.vocab_size)
        site = eng.experts.cpu_site
        assert site is not None and site.source is eng.host_source and site.executor == executor
        assert calls >= cfg.num_layers and site.layer_calls == calls  # got's MoE layers ran here, ref's did not
        assert (site.repacks > 0) == (executor == "cpu-int4")  # cpu-native reads the host rows as they lie
        assert eng.stats().executor == executor
        for t in range(len(prompt)):
            # engine tolerance (the Triton executors' in tests/test_engine.py): measured ~1.2e-3 of max |ref|
            err, bound = float((got[t] - ref[t]).abs().max()), 1e-2 * float(ref[t].abs().max()) + 2e-3
            assert err <= bound, f"{preset} position {t}: max |diff| {err:.3g} > {bound:.3g}"
        if executor == "cpu-int4":
            assert not torch.equal(got, ref)  # the bf16 path really ran (a silent fallback would be exact)
    finally:
        eng.close()


def test_engine_refuses_what_the_cpu_site_cannot_do(tiny_packs):
    from runmap.engine.engine import Engine, EngineError

    pack, cfg = tiny_packs["tiny-olmoe"]
    with pytest.raises(EngineError, match="use device='cpu'"):
        Engine.from_pack(pack, executor="cpu-int4", device="cuda")
    with pytest.raises(EngineError, match="leave resident"):
        Engine.from_pack(pack, executor="cpu-int4", device="cpu", resident=cfg.top_k)


def test_registry_lists_the_cpu_site():
    from runmap.kernels.registry import CPU_SITE_EXECUTORS, EXECUTORS, GRAPH_SAFE_EXECUTORS

    from runmap.kernels.cpu_native import cpu_native_i16_moe, cpu_native_moe

    assert CPU_SITE_EXECUTORS == ("cpu-int4", "cpu-native", "cpu-native-i16") == cpu_int4.SITE_EXECUTORS
    assert all(EXECUTORS[n].site == "cpu" and n not in GRAPH_SAFE_EXECUTORS for n in CPU_SITE_EXECUTORS)
    assert EXECUTORS["cpu-int4"].load() is cpu_int4_moe and EXECUTORS["cpu-native"].load() is cpu_native_moe
    assert EXECUTORS["cpu-native-i16"].load() is cpu_native_i16_moe
    assert all(e.site == "device" for n, e in EXECUTORS.items() if n not in CPU_SITE_EXECUTORS)
    assert math.isfinite(TOLERANCE["bf16"]) and TOLERANCE["fp32"] < TOLERANCE["bf16"]


# ---- concurrent experts (CpuExpertSite(workers=...)) ------------------------------------------------------------

import importlib.util  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

WORKER_PREFIX = "cpu-int4-expert"


def _bits(y: torch.Tensor) -> torch.Tensor:
    """The raw bits (torch.equal alone would let -0.0 equal +0.0)."""
    return y.contiguous().view({torch.float16: torch.int16, torch.float32: torch.int32}[y.dtype])


def _routes(shape: kc.ExpertShape, m: int, seed: int, duplicate: bool = False):
    """Fresh random x fp16 (m, H), ids int64 (m, k) and softmax weights; duplicate: token 0 routes its first
    expert twice (slots 0 and 1), so one expert's rows hold the same token twice."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, shape.hidden, generator=g) * 2).to(torch.float16)
    ids = torch.stack([torch.randperm(shape.experts, generator=g)[:shape.top_k] for _ in range(m)])
    if duplicate and shape.top_k > 1:
        ids[0, 1] = ids[0, 0]
    w = torch.softmax(torch.randn(m, shape.top_k, generator=g), dim=1)
    return x, ids, w


_HOSTS: dict[str, tuple] = {}


def _shared_host(name: str):
    """One host source per shape for the whole module (the rows are read only)."""
    if name not in _HOSTS:
        _HOSTS[name] = _host(_shape(name), layers=2, seed=sum(map(ord, name)))
    return _HOSTS[name]


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(WORKER_PREFIX)]


@pytest.fixture
def record_threads(monkeypatch):
    """The names of the threads that ran expert_ffn during the test."""
    names: list[str] = []
    real = cpu_int4.expert_ffn

    def recording(rep, x):
        names.append(threading.current_thread().name)
        return real(rep, x)

    monkeypatch.setattr(cpu_int4, "expert_ffn", recording)
    return names


CONCURRENT_CASES = [("b128-odd", 1, 2, 1), ("b128-odd", 3, 3, 2), ("k-pad", 1, 9, 1), ("k-pad", 5, 2, 1),
                    ("qwen-like", 2, 9, 1), ("b96", 4, 4, 1), ("b256-partial", 1, 3, 2), ("b64", 6, 5, 1)]


@pytest.mark.parametrize("name,m,workers,tpw", CONCURRENT_CASES)
def test_concurrent_layer_call_is_bitwise_the_serial_one(name, m, workers, tpw, record_threads):
    """workers > 1 computes each expert whole on a worker and adds the terms in the serial order: the output is the
    workers=1 output bit for bit (batch 1 and small batches, odd shapes, more workers than experts (9 > E), a
    token routed twice to one expert), for moe and moe_subset; and the experts really ran on the workers."""
    shape = _shape(name)
    host, rows, layout = _shared_host(name)
    serial, conc = CpuExpertSite(host, workers=1), CpuExpertSite(host, workers=workers, threads_per_worker=tpw)
    try:
        for layer in range(2):
            for dup in (False, True):
                x, ids, w = _routes(shape, m, seed=97 * m + 13 * layer + workers + dup, duplicate=dup)
                record_threads.clear()
                want = serial.moe(layer, x, ids, w)
                assert set(record_threads) == {threading.current_thread().name}  # workers=1: the caller only
                record_threads.clear()
                got = conc.moe(layer, x, ids, w)
                assert torch.equal(_bits(got), _bits(want)), f"{name} m={m} layer {layer} dup={dup}"
                assert len(record_threads) == len(want_terms := (ids[0].tolist() if m == 1 else ids.unique().tolist()))
                assert all(n.startswith(WORKER_PREFIX) for n in record_threads), set(record_threads)
                assert len(want_terms) > 1
                subset = ids.unique().tolist()[::2]
                assert torch.equal(_bits(conc.moe_subset(layer, x, ids, w, subset)),
                                   _bits(serial.moe_subset(layer, x, ids, w, subset)))
        # and the serial site still meets the reference (the equality above is not between two wrong answers)
        ident = torch.arange(shape.experts, dtype=torch.int32)
        ref = reference_moe_f32(x, ids, w, rows[1], ident, layout)
        assert float((got.float() - ref).norm() / ref.norm()) <= TOLERANCE["bf16"]
    finally:
        conc.close()


@settings(max_examples=20)
@given(name=st.sampled_from(["b128-odd", "k-pad", "qwen-like", "b96"]), m=st.integers(1, 6),
       workers=st.integers(1, 10), tpw=st.integers(1, 2), seed=st.integers(0, 2 ** 31 - 1), dup=st.booleans(),
       subset_mask=st.integers(0, 255))
def test_concurrent_sum_does_not_depend_on_the_worker_count(name, m, workers, tpw, seed, dup, subset_mask):
    shape = _shape(name)
    host, _rows, _layout = _shared_host(name)
    x, ids, w = _routes(shape, m, seed, duplicate=dup)
    serial, conc = CpuExpertSite(host, workers=1), CpuExpertSite(host, workers=workers, threads_per_worker=tpw)
    try:
        assert torch.equal(_bits(conc.moe(0, x, ids, w)), _bits(serial.moe(0, x, ids, w)))
        subset = [e for e in range(shape.experts) if subset_mask >> e & 1]
        assert torch.equal(_bits(conc.moe_subset(1, x, ids, w, subset)), _bits(serial.moe_subset(1, x, ids, w, subset)))
    finally:
        conc.close()


class _FailingSource:
    """A host source whose rows of some experts fail: ``device`` experts come back on the meta device (the
    CpuSiteError a device row gets today), ``broken`` ones raise OSError from row_tensor itself; ``slow`` experts'
    rows arrive after a delay. ``started`` / ``finished`` record each read's start and end (also when it fails);
    with ``gate`` set, a failing read first waits until expert ``gate`` has started (so that a sibling is
    running when the error reaches the caller)."""

    def __init__(self, host, device=(), broken=(), slow=(), delay=0.3, gate=None):
        self.host, self.layout = host, host.layout
        self.num_layers, self.num_experts = host.num_layers, host.num_experts
        self.device, self.broken, self.slow, self.delay, self.gate = set(device), set(broken), set(slow), delay, gate
        self.started: list[int] = []
        self.finished: list[int] = []
        self._began = {e: threading.Event() for e in range(self.num_experts)}

    def row_tensor(self, layer, expert):
        self.started.append(expert)
        self._began[expert].set()
        try:
            if expert in self.slow:
                time.sleep(self.delay)
            if self.gate is not None and expert in self.device | self.broken:
                assert self._began[self.gate].wait(10), "the gate expert never started"
            if expert in self.broken:
                raise OSError(f"row {expert} unreadable")
            if expert in self.device:
                return torch.empty(self.layout.row_bytes, dtype=torch.uint8, device="meta")
            return self.host.row_tensor(layer, expert)
        finally:
            self.finished.append(expert)


def _call_with_timeout(fn, timeout=60.0):
    """fn() on a helper thread: its result or exception, or a test failure if it hangs."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the call did not return within {timeout} s (a worker hung)"
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("workers", [1, 3])
def test_an_error_in_a_worker_reaches_the_caller_unchanged_and_no_worker_hangs(m, workers):
    """A failing expert raises in the caller the error the serial site raises (type and message: the first failing
    term in the sum's order, slot order at batch 1, expert order otherwise); the call returns only after every
    started term has finished; the workers stay usable (the next call is correct) and none is left busy."""
    shape = _shape("b64")  # E = 6, k = 2
    host, _rows, _layout = _shared_host("b64")
    x = torch.randn(m, shape.hidden).to(torch.float16)
    ids = torch.tensor([[4, 1], [2, 5], [1, 4]][:m])
    w = torch.rand(m, 2)
    first = 4 if m == 1 else 1  # the first failing term in the order the serial path adds
    concurrent = workers > 1 and m > 1  # batch 1 has two terms, both failing: no healthy sibling to wait for
    src = _FailingSource(host, device={1, 4}, slow={2, 5}, gate=2 if concurrent else None)
    site = CpuExpertSite(src, workers=workers, threads_per_worker=1)
    try:
        with pytest.raises(CpuSiteError, match="host rows only") as err:
            _call_with_timeout(lambda: site.moe(0, x, ids, w))
        serial = CpuExpertSite(_FailingSource(host, device={1, 4}), workers=1)
        with pytest.raises(CpuSiteError) as serial_err:
            serial.moe(0, x, ids, w)
        assert str(err.value) == str(serial_err.value)
        assert first in src.started
        # every term that started had finished when the error reached the caller (none still running for it)
        assert sorted(src.started) == sorted(src.finished)
        if concurrent:
            assert 2 in src.finished  # the slow sibling was running, and was waited for, not abandoned
        # a source error that is not the site's own passes through as itself, and with two failing terms the
        # first in the sum's order wins even when it fails last (slow)
        src.device, src.broken, src.slow, src.gate = set(), {1, 4}, {first}, None
        with pytest.raises(OSError, match=f"row {first} unreadable"):
            _call_with_timeout(lambda: site.moe(0, x, ids, w))
        assert sorted(src.started) == sorted(src.finished)
        # the workers are idle and usable: the next call on good experts is the serial result
        good = torch.tensor([[0, 2]] * m)
        got = _call_with_timeout(lambda: site.moe(0, x, good, w))
        want = CpuExpertSite(host, workers=1).moe(0, x, good, w)
        assert torch.equal(_bits(got), _bits(want))
        pool = site._pool()
        if workers == 1:
            assert pool is None
        else:
            assert pool._ex._work_queue.qsize() == 0
            alive = [t for t in _worker_threads() if t.is_alive()]
            assert len(alive) >= workers
    finally:
        site.close()


def test_workers_run_with_their_own_torch_thread_count_and_leave_the_callers_alone():
    """Each worker runs torch ops with threads_per_worker intra-op threads; the caller keeps its count, and a thread
    started after the pool sees the same default as one started before (the pool restores the global default)."""
    host, _rows, _layout = _shared_host("b64")

    def fresh():
        box = []
        t = threading.Thread(target=lambda: box.append(torch.get_num_threads()))
        t.start()
        t.join()
        return box[0]

    caller = torch.get_num_threads()
    torch.set_num_threads(caller)  # the default a fresh thread adopts: the caller's (another test may have moved it)
    before = fresh()
    site = CpuExpertSite(host, workers=3, threads_per_worker=2)
    try:
        pool = site._pool()
        assert pool.worker_threads == [2, 2, 2]
        seen = {pool.submit(lambda: (threading.current_thread().name, torch.get_num_threads())).result()
                for _ in range(12)}
        assert {n for n, _ in seen} <= {t.name for t in _worker_threads()} and {c for _, c in seen} == {2}
        assert torch.get_num_threads() == caller
        assert fresh() == before
        torch.set_num_threads(1 if caller > 1 else 2)  # the caller's own setting does not reach the workers
        try:
            assert pool.submit(torch.get_num_threads).result() == 2
        finally:
            torch.set_num_threads(caller)
        torch.set_num_threads(caller)
        before = fresh()
        site.set_workers(2, 1)
        assert site._pool().worker_threads == [1, 1] and fresh() == before and torch.get_num_threads() == caller
    finally:
        site.close()


def test_workers_stop_at_close_and_come_back_on_the_next_call():
    host, _rows, _layout = _shared_host("b64")
    shape = _shape("b64")
    x, ids, w = _routes(shape, 2, seed=5)
    site = CpuExpertSite(host, workers=2, threads_per_worker=1)
    first = site.moe(0, x, ids, w)
    threads = [t for t in _worker_threads() if t.is_alive()]
    pool = site._pool()
    ours = [t for t in threads if t.ident in {th.ident for th in pool._ex._threads}]
    assert len(ours) == 2
    site.close()
    site.close()  # idempotent
    for t in ours:
        t.join(10)
        assert not t.is_alive()
    assert torch.equal(_bits(site.moe(0, x, ids, w)), _bits(first))  # restarted
    assert site._pool() is not pool
    site.close()


def test_worker_arguments_and_default():
    host, _rows, _layout = _shared_host("b64")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(CpuSiteError, match="workers"):
            CpuExpertSite(host, workers=bad)
        with pytest.raises(CpuSiteError, match="threads_per_worker"):
            CpuExpertSite(host, workers=2, threads_per_worker=bad)
    # the serial site is the default everywhere (the H200 host's sweep: workers were 3x slower, kernels/cpu_int4.py)
    assert [cpu_int4.default_workers(c) for c in (1, 2, 3, 4, 6, 16, 64)] == [1] * 7
    site = CpuExpertSite(host)
    cpus = cpu_int4.usable_cpus()
    assert site.workers == cpu_int4.default_workers(cpus) and site.threads_per_worker == max(1, cpus // site.workers)
    d = site.describe()
    assert (d["workers"], d["threads_per_worker"]) == (site.workers, site.threads_per_worker)
    one = CpuExpertSite(host, workers=1)
    one.moe(0, *_routes(_shape("b64"), 3, seed=1))
    assert one._pool() is None and one._pool_obj is None  # workers=1 makes no threads
    site.close()


def _bench_module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu_experts.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_experts_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_worker_rows_share_the_thread_budget():
    bench = _bench_module()
    assert bench.configs([16], [1, 2, 4, 8, "all"]) == [(16, 1, 16), (16, 2, 8), (16, 4, 4), (16, 8, 2), (16, 16, 1)]
    assert bench.configs([2, 1], [1, 2, "all"]) == [(2, 1, 2), (2, 2, 1), (1, 1, 1)]  # 2 workers > 1 thread: skipped
    assert bench.configs([6], [4]) == [(6, 4, 1)]
    assert bench.main(["--out", "/dev/null", "--workers", "0"]) == 2
    assert bench.main(["--out", "/dev/null", "--workers", "two"]) == 2


def test_workers_repack_distinct_experts_at_once_and_one_expert_once():
    """First use inside a concurrent call: distinct experts' repacks overlap (each read takes 0.3 s; four in
    sequence would take 1.2 s), and threads racing for one expert repack it once (one read, one cache entry)."""
    shape = _shape("b64")
    host, _rows, _layout = _shared_host("b64")
    src = _FailingSource(host, slow={0, 1, 2, 3}, delay=0.3)
    site = CpuExpertSite(src, workers=4, threads_per_worker=1)
    try:
        x = torch.randn(2, shape.hidden).to(torch.float16)
        t0 = time.perf_counter()
        _call_with_timeout(lambda: site.moe(0, x, torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)))
        assert time.perf_counter() - t0 < 1.0
        assert sorted(src.finished) == [0, 1, 2, 3] and site.repacks == 4
        src.slow = {5}
        reps = list(site._pool()._ex.map(lambda _: site.expert(1, 5), range(8)))
        assert all(r is reps[0] for r in reps) and src.finished.count(5) == 1 and site.repacks == 5
        assert site.source_bytes_read == 5 * site.layout.row_bytes
    finally:
        site.close()
