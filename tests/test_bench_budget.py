"""`runmap bench` under a GPU budget (run parameter gpu_budget, --gpu-budget) and on packs synthesized directly:
the plan decides the residency, the record carries budget, plan and the weights' origin (issue 19, items 3-4)."""
from __future__ import annotations

import json
import math

import pytest

from runmap.arch.config import load_preset
from runmap.bench import campaign as bench
from runmap.cli.main import main
from runmap.conformance.schemas import validate_document
from runmap.engine.budget import FRAGMENTATION_SHARE, plan_for_pack
from runmap.synth.direct_pack import write_direct_pack

PRESET = "tiny-qwen3-moe"  # 8 experts, top-2: a budget window where the plan keeps some but not all experts


@pytest.fixture(scope="module")
def direct_pack(tmp_path_factory):
    return write_direct_pack(load_preset(PRESET)[0], tmp_path_factory.mktemp("dp") / "pack", seed=1)


def _partial_budget(pack, max_batch=1, max_seq_len=8, edge=False) -> int:
    """Less than full residency needs (by one byte with ``edge``, else by half an expert row per layer, far from
    any plan's boundary): the plan must drop to partial residency."""
    full = plan_for_pack(pack, 1 << 40, max_batch=max_batch, max_seq_len=max_seq_len)
    assert full.regime == "full"
    # a budget B holds a plan whose counted bytes are at most B less its allocator slack (FRAGMENTATION_SHARE of B)
    def budget_for(total):  # the least such B
        b = math.floor(total / (1 - FRAGMENTATION_SHARE)) - 2
        while b - int(b * FRAGMENTATION_SHARE) < total:
            b += 1
        return b
    if edge:
        return budget_for(full.total) - 1
    per_layer = full.experts // (full.resident * load_preset(PRESET)[0].num_layers)
    return budget_for(full.total - per_layer * load_preset(PRESET)[0].num_layers // 2)


def _spec(pack, budget, extra_groups=()):
    common = {"models": ["m"], "batch": 1, "prompt_len": 5, "decode_len": 3}
    return {
        "name": "budget", "description": "gpu budget on a direct pack", "device": "cpu",
        "defaults": {"repeats": 1, "warmup": 0, "max_batch": 1, "max_seq_len": 8},
        "models": {"m": {"preset": PRESET, "pack": str(pack)}},
        "groups": [
            {"name": "full", "kind": "engine", "resident": "full", "executors": ["reference"], **common},
            {"name": "b", "kind": "engine", "resident": "budget", "executors": ["reference"], **common,
             "params": {"gpu_budget": [str(budget)]}},
            *extra_groups,
        ],
    }


def test_budget_configurations_take_their_residency_from_the_plan(direct_pack):
    budget = _partial_budget(direct_pack)
    spec = _spec(direct_pack, budget)
    assert validate_document(spec, "campaign-spec") == []
    configs = {c.group: c for c in bench.expand(spec)}
    c = configs["b"]
    want = plan_for_pack(direct_pack, budget, max_batch=1, max_seq_len=8).resident
    assert c.resident == want < load_preset(PRESET)[0].num_experts and c.regime == "partial"
    assert "__budget-" in c.id and f"__r{want}__" not in c.id
    assert configs["full"].p["gpu_budget"] is None
    # without the pack, the preset's estimate gives the same residency (the builder checks it against the pack)
    nopack = _spec(direct_pack, budget)
    del nopack["models"]["m"]["pack"]
    assert {x.group: x.resident for x in bench.expand(nopack)}["b"] == want


def test_builder_refuses_a_residency_the_packs_own_plan_does_not_give(direct_pack, tmp_path):
    # one byte below full residency: the pack's plan (non-routed file with its header) keeps fewer experts than
    # the preset's estimate (no header), and the engine must not run under a residency nobody planned
    budget = _partial_budget(direct_pack, edge=True)
    nopack = _spec(direct_pack, budget)
    del nopack["models"]["m"]["pack"]
    configs = [c for c in bench.expand(nopack) if c.group == "b"]
    assert configs[0].resident == load_preset(PRESET)[0].num_experts
    summary = bench.run_campaign(nopack, tmp_path, configs=configs, packs={"m": str(direct_pack)}, progress=False,
                                 measure_bandwidth=False, keep_going=True)
    assert [f["id"] for f in summary["failed"]] == [configs[0].id]
    assert "GPU-budget plan keeps" in summary["failed"][0]["error"]


@pytest.mark.parametrize("group, why", [
    ({"name": "x", "kind": "engine", "resident": [4], "executors": ["reference"], "params": {"gpu_budget": "1GiB"}},
     "resident: budget"),
    ({"name": "x", "kind": "engine", "resident": "budget", "executors": ["reference"]}, "resident: budget"),
    ({"name": "x", "kind": "hf-bf16", "params": {"gpu_budget": "1GiB"}}, "engine option"),
    ({"name": "x", "kind": "engine", "resident": "budget", "executors": ["reference"], "params": {"gpu_budget": "1KiB"}},
     "below the least"),
])
def test_bad_budget_groups_are_refused_naming_the_group(direct_pack, group, why):
    spec = {"name": "bad", "description": "d", "device": "cpu", "models": {"m": {"preset": PRESET}},
            "groups": [{**group, "models": ["m"], "batch": 1, "prompt_len": 5, "decode_len": 3}]}
    with pytest.raises(bench.BenchError, match=why):
        bench.expand(spec)


def test_records_carry_budget_plan_and_the_direct_pack_label(direct_pack, tmp_path):
    budget = _partial_budget(direct_pack)
    hf = {"name": "hf", "kind": "hf-bf16", "models": ["m"], "batch": 1, "prompt_len": 5, "decode_len": 3}
    spec = _spec(direct_pack, budget, [hf])
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=False)
    assert summary["failed"] == [] and len(summary["done"]) == 3
    recs = {r["group"]: r for r in bench.load_records(tmp_path / "budget")}
    for r in recs.values():
        assert validate_document({k: v for k, v in r.items() if k != "_path"}, "bench-record") == [], r["id"]
    b, full, base = recs["b"], recs["full"], recs["hf"]
    assert b["config"]["gpu_budget"] == budget and b["regime"] == "partial"
    assert b["config"]["budget_plan"]["resident"] == b["config"]["resident"] < b["config"]["experts_per_layer"]
    plan_rec = b["config"]["budget_plan"]
    assert plan_rec["budget"] == budget and plan_rec["total"] + plan_rec["slack"] <= budget
    assert full["config"]["gpu_budget"] is None and full["config"]["budget_plan"] is None
    for r in (b, full):
        assert r["config"]["weights"].startswith("synthesized-direct")
        assert any("synthesized directly" in n for n in r.get("notes", []))
        assert r["byte_floor"]["bytes_per_step"] > 0
    assert "transfer_bound_tok_s" in b["timing"] and "misses_per_token" in b["routing"]
    assert base["config"]["weights"].startswith("transformers random init")
    assert any("not the pack's weights" in n for n in base.get("notes", []))


def test_cli_gpu_budget_replaces_partial_residency_and_keeps_full(direct_pack, tmp_path, capsys):
    spec = _spec(direct_pack, _partial_budget(direct_pack))
    spec["groups"][1] = {**spec["groups"][1], "resident": [4, 6]}
    del spec["groups"][1]["params"]
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(spec))
    assert main(["bench", str(path), "--list", "--gpu-budget", "600MiB", "--gpu-budget", "700MiB",
                 "--pack", f"m={direct_pack}"]) == 0
    ids = capsys.readouterr().out.split()
    assert sum("__budget-600mib__" in i for i in ids) == 1 and sum("__budget-700mib__" in i for i in ids) == 1
    assert sum("__r8__" in i for i in ids) == 1 and not any("__r4__" in i or "__r6__" in i for i in ids)
    with pytest.raises(SystemExit) as e:  # argparse: usage error, one line naming the option
        main(["bench", str(path), "--list", "--gpu-budget", "lots"])
    assert e.value.code == 2 and "--gpu-budget: 'lots' is not a size" in capsys.readouterr().err


def test_a_budget_row_under_host_read_records_the_spares_it_lent(direct_pack, tmp_path):
    """gpu_budget with placement host-read: the engine lends all but one of the plan's spares to residency by
    default; the record's config says what ran (resident above the plan's, host_read_spares 1 kept), the plan stays
    as planned, a note says what was lent, and the record validates."""
    budget = _partial_budget(direct_pack)
    hr = {"name": "hr", "kind": "engine", "models": ["m"], "resident": "budget", "executors": ["grouped"], "batch": 1,
          "prompt_len": 5, "decode_len": 3,
          "params": {"gpu_budget": [str(budget)], "expert_placement": "host-read", "routing": "calibrated"}}
    spec = _spec(direct_pack, budget, [hr])
    spec["groups"] = [g for g in spec["groups"] if g["name"] == "hr"]
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=False)
    assert summary["failed"] == [], summary["failed"]
    (rec,) = bench.load_records(tmp_path / "budget")
    assert validate_document({k: v for k, v in rec.items() if k != "_path"}, "bench-record") == []
    plan_rec, cfg = rec["config"]["budget_plan"], rec["config"]
    assert plan_rec["spares"] > 1 and cfg["host_read_spares"] == 1
    assert cfg["resident"] == min(plan_rec["resident"] + plan_rec["spares"] - 1, cfg["experts_per_layer"] - 1)
    assert cfg["resident"] > plan_rec["resident"]
    assert any(f"{cfg['resident'] - plan_rec['resident']} of the planned spare rows per layer lent to residency" in n
               for n in rec.get("notes", []))
