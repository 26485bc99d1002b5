"""resident-qpacked-cache-v2 (docs/cache-contract.md#contract-v2): the same contract state machine and mutants
as v1 over the direct transport (no staging copy), and the engine giving v1's answers under v2."""
import pytest
import torch

from runmap.engine.engine import Engine, EngineError
from runmap.residency import contract_model as cm
from runmap.residency.transport import (CONTRACT_V2, CpuDirectTransport, TransferError, default_transport)
from test_model_support import build_packs


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return build_packs(tmp_path_factory)


def test_contract_v2_holds_under_the_state_machine(test_device):
    stats, exc = cm.run_contract(examples=80, steps=25, seed=1, device=test_device, shrink=False, contract="v2")
    assert exc is None, exc
    assert stats.outcomes["miss"] > 0 and stats.outcomes["abort"] > 0
    for kind in cm.FAIL_KINDS + ("interrupt", "kernel"):
        assert stats.rules[f"inject_{kind}"] > 0, kind


# The mutants whose fault lives on the miss path v2 changes (copies, their completion, aborts, byte counts,
# read-backs); the others concern leases and eviction, which v2 leaves as they are (v1's tests cover them).
V2_MUTANTS = ("publish-before-transfer", "reuse-staging-early", "no-fence-on-abort", "overcount-h2d-on-abort",
              "read-back-on-miss", "ignore-ambiguous-failure")


def test_the_v2_mutants_exist():
    assert set(V2_MUTANTS) <= set(cm.MUTANTS)


@pytest.mark.parametrize("name", V2_MUTANTS)
def test_v2_catches_the_miss_path_mutants(name, test_device):
    stats, exc = cm.run_contract(examples=500, steps=30, seed=0, device=test_device, cache_cls=cm.MUTANTS[name],
                                 shrink=False, contract="v2")
    assert isinstance(exc, cm.ContractViolation), f"mutant {name} not caught under v2 in {stats.examples}: {exc!r}"


def test_direct_transport_copies_the_host_row_without_staging():
    t = default_transport("cpu", contract="v2")
    assert isinstance(t, CpuDirectTransport) and t.contract == CONTRACT_V2 and t.direct
    slot = t.alloc_staging(4096)
    assert slot.numel() == 1  # a token, not a buffer
    src, dst = torch.arange(256, dtype=torch.uint8).repeat(16), torch.zeros(4096, dtype=torch.uint8)
    t.copy_rows([(dst, slot, src)], lambda j, ev: None)
    assert torch.equal(dst, src) and t.h2d_bytes == 4096 and t.stage_bytes == 0
    with pytest.raises(TransferError):
        t.stage(slot, src)
    with pytest.raises(ValueError, match="unknown cache contract"):
        default_transport("cpu", contract="v3")


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-qwen2-moe"])
def test_engine_under_v2_equals_v1(packs, preset):
    kw = dict(executor="reference", device="cpu", max_batch=2, max_seq_len=32, routing="calibrated")
    outs = {}
    for contract in ("v1", "v2"):
        eng = Engine.from_pack(packs[preset], resident=4, cache_contract=contract, **kw)
        outs[contract] = [r.token_ids for r in eng.generate([[5, 9, 1, 4, 7], [8, 3]], max_new_tokens=6)]
        cache = eng.experts.cache
        assert cache.telemetry()["contract"] == f"resident-qpacked-cache-{contract}"
        assert cache.staging_bytes == (cache.staging if contract == "v2" else cache.staging * cache.row_bytes)
        assert eng.stats().misses > 0
    assert outs["v1"] == outs["v2"]
    with pytest.raises(EngineError, match="cache_contract"):
        Engine.from_pack(packs[preset], cache_contract="v3", **kw)
