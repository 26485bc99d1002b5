"""The host-read site: the grouped executor computing absent experts from a second storage (on a GPU registered host
memory mapped into the device's address space; here, in the interpreter, a second host tensor) named by row table
entries past the device rows (runmap.kernels.core.expert_site_row)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import given, settings, strategies as st

from runmap.kernels import common
from runmap.kernels.check import SHAPES, make_layer
from runmap.kernels.executors import moe_experts
from runmap.kernels.reference import reference_moe_f32

SMALL = {s.name: s for group in SHAPES.values() for s in group}
TOL = 2e-3  # relative Frobenius error against the FP32 reference, as the executor's own check


def _split(storage, table, experts, on_host):
    """The layer's experts moved apart: those in ``on_host`` only in a host row storage (E rows, expert e at row e,
    the rest poisoned), the others in a device storage of their own rows; -> (device storage, host rows, table)
    whose entries past the device rows name host rows."""
    R = storage.shape[0]
    rows = storage.clone()
    host = torch.randint(0, 256, (experts, storage.shape[1]), dtype=torch.uint8)  # poison: never read unless named
    split = table.clone()
    for e in on_host:
        r = int(table[e])
        host[e] = storage[r]
        rows[r] = torch.randint(0, 256, (storage.shape[1],), dtype=torch.uint8)  # the device copy is gone
        split[e] = R + e
    return rows, host, split


@pytest.mark.parametrize("shape_name", ["small-b256", "small-b64", "small-mixtral"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_host_rows_compute_what_device_rows_do(shape_name, tokens):
    shape = SMALL[shape_name]
    layout, storage, table, resident = make_layer(shape, torch.device("cpu"), seed=11)
    gen = torch.Generator().manual_seed(5)
    k = shape.top_k
    ids = torch.stack([resident[torch.randperm(resident.numel(), generator=gen)[:k]] for _ in range(tokens)])
    x = torch.randn(tokens, shape.hidden, generator=gen).to(torch.float16)
    w = torch.softmax(torch.randn(tokens, k, generator=gen), dim=1)
    on_host = sorted(set(ids[:, ::2].reshape(-1).tolist()))  # half the routed slots' experts read from the host rows
    dev_rows, host, split = _split(storage, table, shape.experts, on_host)
    want = moe_experts("grouped", x, ids, w, storage, table, layout, validate=False)
    got = moe_experts("grouped", x, ids, w, dev_rows, split, layout, validate=False, host_rows=host)
    assert torch.equal(got, want)  # the same kernel over the same bytes, wherever they lie
    ref = reference_moe_f32(x, ids, w, storage, table, layout)
    assert float((got.float() - ref).norm() / ref.norm()) <= TOL


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 4), host_share=st.floats(0.0, 1.0))
def test_any_split_of_experts_between_sites_gives_the_same_output(seed, tokens, host_share):
    shape = SMALL["small-b64"]
    layout, storage, table, resident = make_layer(shape, torch.device("cpu"), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    k = shape.top_k
    ids = torch.stack([resident[torch.randperm(resident.numel(), generator=gen)[:k]] for _ in range(tokens)])
    x = torch.randn(tokens, shape.hidden, generator=gen).to(torch.float16)
    w = torch.softmax(torch.randn(tokens, k, generator=gen), dim=1)
    used = sorted(set(ids.reshape(-1).tolist()))
    on_host = [e for e, u in zip(used, torch.rand(len(used), generator=gen).tolist()) if u < host_share]
    dev_rows, host, split = _split(storage, table, shape.experts, on_host)
    want = moe_experts("grouped", x, ids, w, storage, table, layout, validate=False)
    got = moe_experts("grouped", x, ids, w, dev_rows, split, layout, validate=False, host_rows=host)
    assert torch.equal(got, want)


def test_an_entry_past_both_sites_gives_nan_never_another_row():
    shape = SMALL["small-b256"]
    layout, storage, table, resident = make_layer(shape, torch.device("cpu"), seed=3)
    k = shape.top_k
    ids = resident[:k].view(1, k).clone()
    x = torch.randn(1, shape.hidden).to(torch.float16)
    w = torch.softmax(torch.randn(1, k), dim=1)
    dev_rows, host, split = _split(storage, table, shape.experts, [int(ids[0, 0])])
    bad = split.clone()
    bad[int(ids[0, 1])] = storage.shape[0] + shape.experts  # one past the host rows
    out = moe_experts("grouped", x, ids, w, dev_rows, bad, layout, validate=False, host_rows=host)
    assert torch.isnan(out).all()  # the token's sum includes a slot with no row: NaN, not a substitute
    absent = split.clone()
    absent[int(ids[0, 0])] = -1
    out = moe_experts("grouped", x, ids, w, dev_rows, absent, layout, validate=False, host_rows=host)
    assert torch.isnan(out).all()


def test_host_rows_are_refused_where_they_cannot_be_honoured():
    shape = SMALL["small-b256"]
    layout, storage, table, resident = make_layer(shape, torch.device("cpu"), seed=3)
    k = shape.top_k
    ids = resident[:k].view(1, k).clone()
    x = torch.randn(1, shape.hidden).to(torch.float16)
    w = torch.softmax(torch.randn(1, k), dim=1)
    host = torch.zeros(shape.experts, storage.shape[1], dtype=torch.uint8)
    with pytest.raises(common.KernelInputError, match="grouped executor only"):
        moe_experts("scalar", x, ids, w, storage, table, layout, validate=False, host_rows=host)
    with pytest.raises(common.KernelInputError, match="validate=False"):
        moe_experts("grouped", x, ids, w, storage, table, layout, validate=True, host_rows=host)
    with pytest.raises(common.KernelInputError, match="row_bytes"):
        moe_experts("grouped", x, ids, w, storage, table, layout, validate=False, host_rows=host[:, 1:].contiguous())
    odd = torch.zeros(shape.experts * storage.shape[1] + 8, dtype=torch.uint8)[8:].view(shape.experts, -1)
    if (odd.data_ptr() - storage.data_ptr()) % 16:
        with pytest.raises(common.KernelInputError, match="multiple of 16"):
            moe_experts("grouped", x, ids, w, storage, table, layout, validate=False, host_rows=odd)
