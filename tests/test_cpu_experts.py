"""The cpu-int4 execution site (kernels/cpu_int4.py) against the FP32 reference executor.

* the repack represents qpack's blocks exactly: in FP32 mode, the identity matrix as activations returns
  the qpack dequantization bit for bit, partial last blocks and padded N / K included;
* the bf16 runtime path is within its stated tolerance of the FP32 reference on fresh random experts,
  activations, routes and gate weights, over odd shapes, with every allocation poisoned (NaN);
* the site repacks each expert once, from the host source only, and records the memory the copies hold;
* the engine with executor="cpu-int4" gives the reference executor's teacher-forced logits at every
  position within the engine tolerance, for tiny-olmoe and tiny-qwen2-moe.
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


@pytest.mark.parametrize("preset", ENGINE_PRESETS)
def test_engine_teacher_forced_logits_equal_the_reference_executor(tiny_packs, preset):
    from runmap.engine.engine import Engine

    pack, cfg = tiny_packs[preset]
    eng = Engine.from_pack(pack, executor="cpu-int4", device="cpu", max_batch=1, max_seq_len=32)
    try:
        g = torch.Generator().manual_seed(len(preset))
        prompt = torch.randint(3, cfg.vocab_size, (12,), generator=g).tolist()
        got = eng.logits(prompt)  # (T, V): every position, teacher-forced by the prompt
        ref = eng.logits(prompt, executor="reference")
        assert got.shape == ref.shape == (len(prompt), cfg.vocab_size)
        site = eng.experts.cpu_site
        assert site is not None and site.source is eng.host_source and site.repacks > 0
        assert eng.stats().executor == "cpu-int4"
        for t in range(len(prompt)):
            # engine tolerance (the Triton executors' in tests/test_engine.py): measured ~1.2e-3 of max |ref|
            err, bound = float((got[t] - ref[t]).abs().max()), 1e-2 * float(ref[t].abs().max()) + 2e-3
            assert err <= bound, f"{preset} position {t}: max |diff| {err:.3g} > {bound:.3g}"
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

    assert CPU_SITE_EXECUTORS == ("cpu-int4",)
    assert EXECUTORS["cpu-int4"].site == "cpu" and "cpu-int4" not in GRAPH_SAFE_EXECUTORS
    assert EXECUTORS["cpu-int4"].load() is cpu_int4_moe
    assert all(e.site == "device" for n, e in EXECUTORS.items() if n != "cpu-int4")
    assert math.isfinite(TOLERANCE["bf16"]) and TOLERANCE["fp32"] < TOLERANCE["bf16"]
