"""--gpu-budget (runmap/engine/budget.py): the plan, the residency it picks, and clear refusals."""
import pytest
import torch
from hypothesis import given, strategies as st

from runmap.arch.config import load_preset
from runmap.cli.main import main as cli
from runmap.engine.budget import FRAGMENTATION_SHARE, BudgetError, parse_size, plan
from runmap.engine.engine import Engine, EngineError
from test_model_support import build_packs


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return build_packs(tmp_path_factory)


@pytest.mark.parametrize("text, n", [("6GiB", 6 << 30), ("6G", 6 << 30), ("6.5GB", 6_500_000_000), ("800MiB", 800 << 20),
                                     ("123456", 123456), (" 2 gib ", 2 << 30)])
def test_sizes_parse(text, n):
    assert parse_size(text) == n


@given(st.text(max_size=12))
def test_any_text_parses_or_is_refused_in_one_line(text):
    try:
        assert parse_size(text) > 0
    except BudgetError as e:
        assert "\n" not in str(e) and repr(text) in str(e)


@pytest.mark.parametrize("preset", ["olmoe-1b-7b-0924", "qwen1.5-moe-a2.7b"])
def test_more_budget_never_means_fewer_experts_and_the_plan_fits(preset):
    cfg, _ = load_preset(preset)
    row = 3 * cfg.hidden_size * cfg.moe_intermediate_size // 2 + 4096  # about an INT4 expert row
    last = 0
    for gib in (3, 4, 6, 8, 10, 12, 16, 24):
        try:
            p = plan(cfg, row, 1 << 30, gib << 30, max_batch=8, max_seq_len=2048)
        except BudgetError as e:
            assert last == 0, "a larger budget was refused after a smaller one fitted"
            assert "below the least" in str(e) and "GiB" in str(e)
            continue
        assert p.total <= p.budget and p.resident >= last and cfg.top_k <= p.resident <= cfg.num_experts
        # the allocator's share stays free: measured plans that filled the budget ran out under the cap on the H200
        assert p.slack == int(p.budget * FRAGMENTATION_SHARE) > 0 and p.total + p.slack <= p.budget
        assert (p.spares == 0) == (p.regime == "full")
        last = p.resident
    assert last == cfg.num_experts  # 24 GiB holds every compact expert of either model


def test_the_engine_takes_its_residency_from_the_budget(packs):
    pk = packs["tiny-qwen2-moe"]  # 6 experts, top-2: top_k resident + their spares cost less than all six
    kw = dict(executor="reference", device="cpu", max_batch=1, max_seq_len=32)
    full = Engine.from_pack(pk, gpu_budget=1 << 40, **kw)
    assert full.resident == full.cfg.num_experts and full.budget_plan.regime == "full"
    # under a budget the prefill passes default to the planner's chunk (activations compete with experts there)
    from runmap.engine.budget import PREFILL_CHUNK_UNDER_BUDGET
    from runmap.engine.engine import PREFILL_CHUNK

    assert full.prefill_chunk == PREFILL_CHUNK_UNDER_BUDGET < PREFILL_CHUNK
    assert Engine.from_pack(pk, **kw).prefill_chunk == PREFILL_CHUNK
    assert Engine.from_pack(pk, gpu_budget=1 << 40, prefill_chunk=77, **kw).prefill_chunk == 77
    # the smallest budget that still plans top_k experts per layer
    lo, hi = 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            Engine.from_pack(pk, gpu_budget=mid, **kw)
            hi = mid
        except EngineError:
            lo = mid + 1
    eng = Engine.from_pack(pk, gpu_budget=lo, **kw)
    assert eng.resident == eng.cfg.top_k and eng.budget_plan.total + eng.budget_plan.slack <= lo
    assert eng.generate([[5, 3, 9]], max_new_tokens=3)[0].token_ids  # runs, with misses, inside the plan
    assert eng.stats().misses > 0
    with pytest.raises(EngineError, match="below the least"):
        Engine.from_pack(pk, gpu_budget=lo - 1, **kw)
    with pytest.raises(EngineError, match="not both"):
        Engine.from_pack(pk, gpu_budget=lo, resident=2, **kw)
    # a caller that keeps more KV rows than max_batch has them counted: the same budget
    # then no longer holds the minimum, and the KV part of the plan grows by exactly one row's worth
    with pytest.raises(EngineError, match="below the least"):
        Engine.from_pack(pk, gpu_budget=lo, budget_kv_rows=2, **kw)
    two = Engine.from_pack(pk, gpu_budget=1 << 40, budget_kv_rows=2, **kw)
    assert two.budget_plan.kv_cache == 2 * full.budget_plan.kv_cache


def test_the_cli_prints_the_plan_and_refuses_bad_budgets(packs, capsys):
    pk = str(packs["tiny-olmoe"])
    base = ["generate", "--packed", pk, "--prompt", "hi", "--max-new-tokens", "2", "--executor", "reference",
            "--device", "cpu"]
    assert cli(base + ["--gpu-budget", "1TiB"]) == 0
    err = capsys.readouterr().err
    assert "gpu budget 1024.00 GiB" in err  # on the CPU device: what of the plan applies
    assert "on the cpu device only its residency applies" in err and "nothing caps memory there" in err
    assert cli(base + ["--gpu-budget", "1KiB"]) == 1
    err = capsys.readouterr().err
    assert "below the least" in err and err.count("\n") == 1
    for bad in (["--gpu-budget", "lots"], ["--gpu-budget", "1GiB", "--resident", "4"]):
        with pytest.raises(SystemExit) as e:
            cli(base + bad)
        assert e.value.code == 2


def test_the_campaign_lifts_the_allocator_cap_by_device_index(monkeypatch):
    """A plain "cuda" device (what a campaign runs on) is resolved to its index before torch sees it: torch
    refuses a device without an index, which failed every configuration without a budget on the H200."""
    from runmap.bench.campaign import lift_allocator_cap

    calls = []

    def set_fraction(fraction, device=None):  # torch's own check (torch.cuda._utils._get_device_index)
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    lift_allocator_cap(torch.device("cuda"))
    lift_allocator_cap(torch.device("cuda", 1))
    assert calls == [(1.0, 3), (1.0, 1)]
