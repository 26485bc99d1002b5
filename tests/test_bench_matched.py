"""Engine rows matched to llama.cpp's --n-cpu-moe rows (issue 25 item 6): the run parameter matched_n_cpu_moe
sets each configuration's residency to llama.cpp's GPU routed-expert bytes, and the record says which row."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from runmap.arch.config import load_preset
from runmap.bench import campaign as bench
from runmap.conformance.schemas import validate_document
from runmap.synth.direct_pack import write_direct_pack

PRESET = "tiny-qwen3-moe"  # 8 experts, top-2


def _spec(group_extra: dict, kind: str = "engine") -> dict:
    g = {"name": "m", "kind": kind, "models": ["m"], "batch": 1, "prompt_len": 5, "decode_len": 3, **group_extra}
    if kind == "engine":
        g.setdefault("executors", ["reference"])
    return {"name": "matched", "description": "d", "device": "cpu",
            "defaults": {"repeats": 1, "warmup": 0, "max_batch": 1, "max_seq_len": 8},
            "models": {"m": {"preset": PRESET}}, "groups": [g]}


def test_matched_residency_is_llama_cpp_gpu_expert_bytes_per_layer():
    # resident + top_k spare rows = E(L - n)/L GPU expert rows per layer, never below top_k resident
    olmoe = load_preset("olmoe-1b-7b-0924")[0]  # 16 layers, 64 experts, top-8
    assert [bench.matched_resident(olmoe, n) for n in (0, 4, 8, 12, 15, 16)] == [64, 40, 24, 8, 8, 8]
    assert [bench.matched_max_group(olmoe, n) for n in (0, 4, 16)] == [None, 8, 8]
    qwen = load_preset("qwen1.5-moe-a2.7b")[0]  # 24 layers, 60 experts, top-4
    assert [bench.matched_resident(qwen, n) for n in (4, 8, 12, 16, 24)] == [46, 36, 26, 16, 4]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 64))
def test_matched_residency_never_exceeds_llama_cpp_bytes_unless_top_k_forces_it(n):
    cfg = load_preset("olmoe-1b-7b-0924")[0]
    r, g = bench.matched_resident(cfg, n), bench.matched_max_group(cfg, n)
    on_gpu = cfg.num_experts * (cfg.num_layers - min(n, cfg.num_layers)) / cfg.num_layers
    held = r + (g or 0)  # resident rows + spare rows
    assert cfg.top_k <= r <= cfg.num_experts
    assert (g is None) == (r == cfg.num_experts)
    assert held <= on_gpu or r == cfg.top_k  # more than llama.cpp only where top_k forces it
    assert on_gpu - held < 1 or r == cfg.top_k  # rounded down by less than one expert per layer


def test_matched_groups_expand_to_one_configuration_per_n_with_its_id_and_record_field():
    cfg = load_preset(PRESET)[0]
    spec = _spec({"resident": "ncmoe", "params": {"matched_n_cpu_moe": [0, 1, cfg.num_layers]}})
    assert validate_document(spec, "campaign-spec") == []
    configs = bench.expand(spec)
    assert [c.p["matched_n_cpu_moe"] for c in configs] == [0, 1, cfg.num_layers]
    assert [c.resident for c in configs] == [bench.matched_resident(cfg, n) for n in (0, 1, cfg.num_layers)]
    assert [c.p["max_group"] for c in configs] == [None, cfg.top_k, cfg.top_k]
    assert [c.id.split("__")[3] for c in configs] == ["ncmoe0", "ncmoe1", f"ncmoe{cfg.num_layers}"]
    assert configs[-1].resident == cfg.top_k  # llama.cpp keeps none; the engine one token's experts


@pytest.mark.parametrize("group, why", [
    ({"resident": [4], "params": {"matched_n_cpu_moe": 1}}, "resident: ncmoe"),
    ({"resident": "ncmoe"}, "resident: ncmoe"),
    ({"resident": "ncmoe", "params": {"matched_n_cpu_moe": 99}}, r"integer in \[0, "),
    ({"resident": "ncmoe", "params": {"matched_n_cpu_moe": 1, "gpu_budget": "1GiB"}}, "no gpu_budget"),
])
def test_bad_matched_groups_are_refused_naming_the_group(group, why):
    with pytest.raises(bench.BenchError, match=why):
        bench.expand(_spec(group))


def test_baselines_refuse_a_matched_row():
    with pytest.raises(bench.BenchError, match="engine option"):
        bench.expand(_spec({"params": {"matched_n_cpu_moe": 1}}, kind="hf-bf16"))


def test_a_matched_record_names_its_llama_cpp_row_and_validates(tmp_path):
    cfg = load_preset(PRESET)[0]
    spec = _spec({"resident": "ncmoe", "params": {"matched_n_cpu_moe": [cfg.num_layers]}})
    spec["models"]["m"]["pack"] = str(write_direct_pack(cfg, tmp_path / "pack", seed=1))
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=False)
    assert summary["failed"] == [] and len(summary["done"]) == 1
    (rec,) = bench.load_records(tmp_path / "matched")
    assert validate_document({k: v for k, v in rec.items() if k != "_path"}, "bench-record") == []
    assert rec["config"]["matched_n_cpu_moe"] == cfg.num_layers and rec["config"]["resident"] == cfg.top_k
    assert any("--n-cpu-moe" in n and "at least top_k" in n for n in rec["notes"])
    assert rec["cache"]["spare_bytes"]["value"] == cfg.top_k * cfg.num_layers * (  # top_k spare rows per layer
        rec["cache"]["resident_bytes"]["value"] // (cfg.num_layers * rec["config"]["resident"]))
    row_bytes = rec["cache"]["resident_bytes"]["value"] // (cfg.num_layers * rec["config"]["resident"])
    spares = rec["cache"]["spare_bytes"]["value"] // (row_bytes * cfg.num_layers)
    assert spares > 0 and any(f"+ {spares} spare rows" in n for n in rec["notes"])  # extra GPU rows, said


def test_a_matched_row_that_lends_its_spares_says_what_it_held(tmp_path):
    """host_read_spares 1 under placement host-read: the matched row's T rows per layer hold T - 1 resident experts
    and one spare, and its note counts them so (not the configured resident count)."""
    cfg = load_preset(PRESET)[0]
    n = cfg.num_layers // 2  # T = E / 2 rows per layer: top_k resident + top_k spares as configured
    spec = _spec({"resident": "ncmoe", "executors": ["grouped"],
                  "params": {"matched_n_cpu_moe": [n], "expert_placement": "host-read", "host_read_spares": 1}})
    spec["models"]["m"]["pack"] = str(write_direct_pack(cfg, tmp_path / "pack", seed=1))
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=False)
    assert summary["failed"] == [] and len(summary["done"]) == 1
    (rec,) = bench.load_records(tmp_path / "matched")
    assert validate_document({k: v for k, v in rec.items() if k != "_path"}, "bench-record") == []
    rows = bench.matched_resident(cfg, n) + cfg.top_k
    assert rec["config"]["resident"] == rows - 1 and rec["config"]["host_read_spares"] == 1
    lent = rows - 1 - bench.matched_resident(cfg, n)
    assert any(f"{rows - 1} of {cfg.num_experts} experts per layer resident ({lent} of the matched top_k spares lent "
               f"to residency, host_read_spares) + 1 spare rows" in note and f"= {rows} GPU expert rows" in note
               for note in rec["notes"]), rec["notes"]
