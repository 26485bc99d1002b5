"""The campaign runner: spec expansion, records (schema + derived figures), ratios, byte floor."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runmap.bench import campaign as bench
from runmap.bench import metrics as bm
from runmap.arch.config import load_preset
from runmap.conformance.schemas import validate_document
from runmap.engine.engine import DEFAULT_FUSED
from test_bench_fakes import FakeEngine, fake_factory, run_fake, tiny_spec

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["default", "h200"])
def test_campaign_specs_validate_and_expand(name):
    spec = bench.load_spec(REPO / "specs" / "campaigns" / f"{name}.yaml")  # raises on a schema violation
    configs = bench.expand(spec)
    assert len({c.id for c in configs}) == len(configs)
    kinds = {c.kind for c in configs}
    # baselines run in the same campaign; the GPU one runs transformers compiled too (the CPU compile is too slow)
    want = {"engine", "engine-fp16", "hf-bf16"} | ({"hf-bf16-compile"} if name == "h200" else set())
    assert kinds == want, "baselines run in the same campaign"
    assert {c.regime for c in configs if c.kind == "engine"} == {"full", "partial"}
    assert len({c.executor for c in configs if c.kind == "engine"}) >= 2


def test_h200_spec_has_the_issue_configurations():
    spec = bench.load_spec(REPO / "specs" / "campaigns" / "h200.yaml")
    configs = [c for c in bench.expand(spec) if (c.prompt_len, c.decode_len) == (128, 128)]
    by_model = {}
    for c in configs:
        if c.kind == "engine":
            by_model.setdefault(c.preset, set()).add(c.resident)
    assert by_model["olmoe-1b-7b-0924"] == {30, 40, 50, 60, 64}
    assert by_model["qwen1.5-moe-a2.7b"] == {20, 30, 39, 60}
    assert {c.batch for c in configs} == {1, 8}
    assert all(c.variant == "default" and not c.p["check"] for c in configs)


HEADLINE_ONLY = r"^olmoe__(engine__grouped|hf-bf16__hf-bf16)__r64__b1__p32__d256$"


def test_h200_spec_expresses_the_headline_run():
    """One `--only` selects the README's headline record (OLMoE, full residency, batch 1, grouped, CUDA graphs,
    logits check) and the transformers baseline it is divided by; the variants and the 4k-context memory
    run are their own configurations, and the issue sweep keeps its run order in front."""
    spec = bench.load_spec(REPO / "specs" / "campaigns" / "h200.yaml")
    configs = bench.expand(spec)
    sel = bench.filter_configs(configs, HEADLINE_ONLY)
    assert [c.kind for c in sel] == ["engine", "hf-bf16"]
    head = sel[0]
    assert (head.model, head.executor, head.regime, head.batch, head.variant) == ("olmoe", "grouped", "full", 1, "default")
    assert head.p["check"] and head.p["cuda_graphs"] and head.p["fused"] == tuple(sorted(DEFAULT_FUSED))
    variants = {c.variant for c in configs if c.prompt_len == 32 and c.kind == "engine"}
    assert variants >= {"default", "nographs", "torchops", "skipexperts"}
    assert any(c.executor == "topk-fused" for c in configs if c.prompt_len == 32)
    mem = [c for c in configs if c.prompt_len + c.decode_len == 4096]
    assert mem and mem[0].engine_key() == head.engine_key(), "the 4k-context memory run shares the headline engine"
    ids = [c.id for c in configs]
    assert ids.index(head.id) > max(i for i, c in enumerate(configs) if c.prompt_len == 128)


def test_spec_schema_rejects_bad_specs():
    good = tiny_spec()
    assert validate_document(good, "campaign-spec") == []
    bad = tiny_spec()
    bad["groups"][2].pop("executors")  # an engine group must name its executors
    assert validate_document(bad, "campaign-spec")
    bad = tiny_spec()
    bad["groups"][0]["resident"] = [4]  # a baseline has no residency sweep
    assert validate_document(bad, "campaign-spec")
    bad = tiny_spec()
    bad["groups"][2]["executors"] = ["magic"]
    assert validate_document(bad, "campaign-spec")
    bad = tiny_spec()
    bad["groups"][2]["decode_len"] = 1  # no decode step, no decode tok/s
    assert validate_document(bad, "campaign-spec")


def test_expand_resolves_full_dedups_and_groups_engines():
    spec = tiny_spec()
    spec["groups"].append({"name": "again", "kind": "engine", "models": ["m"], "resident": ["full", 4],
                           "executors": ["grouped", "scalar"], "batch": [2, 1], "prompt_len": 4, "decode_len": 3})
    configs = bench.expand(spec)
    ids = [c.id for c in configs]
    assert len(ids) == len(set(ids))
    full = [c for c in configs if c.kind == "engine" and c.regime == "full"]
    assert full and all(c.resident == 8 for c in full)  # tiny-olmoe has 8 experts per layer
    # the duplicate (grouped, full) keeps its first group
    assert {c.group for c in full if c.executor == "grouped"} == {"res"}
    # configurations sharing an engine are contiguous, so each engine is built once
    keys = [c.engine_key() for c in configs]
    seen = []
    for k in keys:
        if not seen or seen[-1] != k:
            assert k not in seen, f"engine {k} built twice"
            seen.append(k)
    assert all(c.p["max_batch"] == 2 and c.p["max_seq_len"] == 7 for c in configs)


def test_expand_rejects_resident_above_experts():
    spec = tiny_spec()
    spec["groups"][2]["resident"] = [9]
    with pytest.raises(bench.BenchError, match="resident 9 > 8"):
        bench.expand(spec)


def test_run_campaign_records(tmp_path):
    summary, recs = run_fake(tmp_path)
    assert len(recs) == 10 and not summary["failed"] and not summary["skipped"]
    for r in recs:
        assert validate_document({k: v for k, v in r.items() if k != "_path"}, "bench-record") == []
    assert validate_document(json.loads((tmp_path / "t" / "campaign.json").read_text()), "bench-campaign") == []
    by = {r["id"]: r for r in recs}
    r = by["m__engine__grouped__r4__b2__p4__d3"]
    # decode tok/s: median of the three timed repeats, min and max kept
    vals = r["timing"]["decode_tok_s"]["values"]
    assert len(vals) == 3 and r["timing"]["decode_tok_s"]["median"] == sorted(vals)[1]
    assert r["timing"]["decode_tok_s"]["min"] == min(vals) and r["timing"]["decode_tok_s"]["max"] == max(vals)
    # cache counters are deltas over the timed runs only: 3 runs x batch 2 x 3 tokens x 4 lookups
    lookups = 3 * 2 * 3 * 4
    assert r["cache_stats"]["misses"]["value"] == lookups // 4
    assert r["cache_stats"]["hits"]["value"] == lookups - lookups // 4
    assert r["cache_stats"]["hit_rate"]["value"] == pytest.approx(0.75)
    assert r["h2d"]["bytes"]["value"] == (lookups // 4) * FakeEngine.ROW_BYTES
    assert r["h2d"]["gb_s"]["value"] == pytest.approx(FakeEngine.ROW_BYTES / 1e-6 / 1e9)
    assert r["regime"] == "partial" and by["m__engine__grouped__r8__b2__p4__d3"]["regime"] == "full"
    # CPU: no allocator peaks -> UNSUPPORTED, never a zero
    assert r["memory"]["peak_allocated_bytes"]["status"] == "UNSUPPORTED"
    assert "value" not in r["memory"]["peak_allocated_bytes"]
    # baselines have no cache: UNSUPPORTED counters, required-zero observations explicit
    hf = by["m__hf-bf16__hf-bf16__r8__b2__p4__d3"]
    assert hf["cache_stats"]["misses"]["status"] == "UNSUPPORTED"
    assert {o["status"] for o in hf["observations"].values()} == {"UNSUPPORTED"}


def test_ratios_to_each_baseline(tmp_path):
    _, recs = run_fake(tmp_path)
    by = {r["id"]: r for r in recs}
    r = by["m__engine__grouped__r6__b1__p4__d3"]
    for kind, rid in (("hf-bf16", "m__hf-bf16__hf-bf16__r8__b1__p4__d3"),
                      ("engine-fp16", "m__engine-fp16__torch-fp16__r8__b1__p4__d3")):
        want = r["timing"]["decode_tok_s"]["median"] / by[rid]["timing"]["decode_tok_s"]["median"]
        assert r["ratios"][f"decode_vs_{kind}"]["value"] == pytest.approx(want)
        # CPU peaks are UNSUPPORTED, so is their ratio
        assert r["ratios"][f"peak_allocated_vs_{kind}"]["status"] == "UNSUPPORTED"
    assert "decode_vs_hf-bf16" not in by["m__hf-bf16__hf-bf16__r8__b1__p4__d3"]["ratios"]


def test_ratio_unknown_without_baseline(tmp_path):
    spec = tiny_spec()
    spec["groups"] = spec["groups"][2:]
    _, recs = run_fake(tmp_path, spec)
    assert all(r["ratios"]["decode_vs_hf-bf16"]["status"] == "UNKNOWN" for r in recs)


def test_byte_floor_uses_same_run_bandwidth(tmp_path):
    _, recs = run_fake(tmp_path, measure_bandwidth=True)
    for r in recs:
        bw = r["byte_floor"]["copy_bandwidth_gb_s"]
        assert bw["status"] == "OBSERVED" and bw["value"] > 0
        floor = r["config"]["batch"] / (r["byte_floor"]["bytes_per_step"] / (bw["value"] * 1e9))
        assert r["byte_floor"]["floor_decode_tok_s"]["value"] == pytest.approx(floor)
        assert r["ratios"]["decode_vs_byte_floor"]["value"] == pytest.approx(r["timing"]["decode_tok_s"]["median"] / floor)


def test_only_filter_and_deadline(tmp_path):
    spec = tiny_spec()
    configs = bench.filter_configs(bench.expand(spec), r"grouped__r4")
    assert [c.id for c in configs] == ["m__engine__grouped__r4__b1__p4__d3", "m__engine__grouped__r4__b2__p4__d3"]
    summary, recs = run_fake(tmp_path, spec, configs=configs, deadline_s=0.0)
    assert recs == [] and len(summary["skipped"]) == 2


def test_failure_is_recorded_with_keep_going(tmp_path):
    def factory(c, entry, device):
        if c.kind == "hf-bf16":
            raise RuntimeError("boom")
        return fake_factory()(c, entry, device)

    spec = tiny_spec()
    summary = bench.run_campaign(spec, tmp_path, engine_factory=factory, progress=False, keep_going=True,
                                 measure_bandwidth=False, command="pytest")
    assert len(summary["failed"]) == 2 and "boom" in summary["failed"][0]["error"]
    assert len(summary["done"]) == 8
    with pytest.raises(RuntimeError, match="boom"):
        bench.run_campaign(spec, tmp_path / "x", engine_factory=factory, progress=False, measure_bandwidth=False,
                           command="pytest")


def test_engine_reporting_another_executor_is_an_error(tmp_path):
    def factory(c, entry, device):
        e = FakeEngine(c)
        e.executor = "scalar"  # engine says it ran something else: never record it under the asked name
        return e, {}

    spec = tiny_spec()
    spec["groups"] = spec["groups"][2:]
    with pytest.raises(bench.BenchError, match="engine stats say 'scalar'"):
        bench.run_campaign(spec, tmp_path, engine_factory=factory, progress=False, measure_bandwidth=False,
                           command="pytest")


def test_byte_floor_matches_design_anchor():
    cfg = load_preset("olmoe-1b-7b-0924")[0]
    f = bm.byte_floor(cfg, "int4", 1, bm.observed(4200.0))
    assert f["expert_bytes_per_step"] / 1e9 == pytest.approx(0.41, abs=0.01)  # the byte floor, docs/architecture.md
    assert f["nonrouted_bytes_per_step"] / 1e9 == pytest.approx(0.74, abs=0.01)
    assert f["floor_decode_tok_s"]["value"] == pytest.approx(3600, rel=0.03)
    fp16 = bm.byte_floor(cfg, "fp16", 1, bm.observed(4200.0))
    assert fp16["expert_bytes_per_step"] > 3.9 * f["expert_bytes_per_step"]
    none = bm.byte_floor(cfg, "int4", 1, bm.unsupported("no device"))
    assert none["floor_decode_tok_s"]["status"] == "UNSUPPORTED"


@settings(max_examples=60)
@given(e=st.integers(2, 128), k=st.integers(1, 8), b=st.integers(1, 64))
def test_expected_union_bounds(e, k, b):
    k = min(k, e)
    u = bm.expected_distinct_experts(e, k, b)
    assert k - 1e-9 <= u <= min(e, b * k) + 1e-9
    assert bm.expected_distinct_experts(e, k, b + 1) >= u - 1e-9


def test_measures_never_write_a_value_when_unmeasured():
    with pytest.raises(ValueError):
        bm.observed(None)
    assert "value" not in bm.unknown("x") and "value" not in bm.unsupported("y")
    assert bm.ratio(bm.observed(1.0), bm.unsupported("cpu"), "r")["status"] == "UNSUPPORTED"
    assert bm.ratio(bm.observed(1.0), bm.observed(0), "r")["status"] == "UNKNOWN"
    assert bm.ratio(bm.observed(3.0), bm.observed(2.0), "r")["value"] == 1.5


def test_hf_baseline_matches_transformers_greedy():
    import torch
    from runmap.bench.baselines import HFBaseline

    b = HFBaseline(load_preset("tiny-olmoe")[0], torch.device("cpu"), seed=0)
    prompts = [[5, 9, 11, 40, 7], [8, 3, 300, 2, 17]]
    out = b.generate(prompts, max_new_tokens=4)
    ref = b.model.generate(torch.tensor(prompts), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out == ref[:, 5:].tolist()
    t = b.last_timing
    assert t["new_tokens"] == 8 and t["prompt_tokens"] == 10
    assert t["decode_tok_s"] == pytest.approx(2 * 3 / t["decode_s"])
    assert math.isfinite(t["prefill_s"]) and t["prefill_s"] > 0


def test_max_config_s_cuts_repeats_and_says_so(tmp_path):
    spec = tiny_spec()
    spec["groups"] = spec["groups"][2:3]
    spec["defaults"]["max_config_s"] = 1e-9
    _, recs = run_fake(tmp_path, spec)
    for r in recs:
        assert len(r["timing"]["decode_tok_s"]["values"]) == 1 and r["config"]["repeats"] == 1
        assert any("cut to 1 of 3" in n for n in r["notes"])


def test_first_eager_cuda_configuration_warms_up_every_decode_length(tmp_path, monkeypatch):
    """Eager decode may compile per KV length: the first eager engine of a CUDA run warms up over the whole
    decode length, later ones (same shapes) and graph-captured engines use the short warmup."""
    import torch

    seen = []

    class Eager(FakeEngine):
        use_graphs = False

        def run(self, prompts, *, max_new_tokens, ignore_eos=False):
            seen.append((self.c.id, max_new_tokens))
            return super().run(prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)

    spec = tiny_spec()
    spec["groups"] = spec["groups"][2:3]
    spec["groups"][0]["resident"] = [4, 6]
    spec["groups"][0]["decode_len"] = 5
    spec["defaults"].update(repeats=1, warmup=1, warmup_new_tokens=2)
    monkeypatch.setattr(bench.bm, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(bench.bm, "sync", lambda device: None)
    monkeypatch.setattr(bench.bm, "device_info", lambda device: {"type": "cuda", "name": "fake"})
    monkeypatch.setattr(bench.bm.PeakMemory, "reset", lambda self: None)
    monkeypatch.setattr(bench.bm.PeakMemory, "read", lambda self: {
        "peak_allocated_bytes": bm.observed(1), "peak_reserved_bytes": bm.observed(2)})
    bench._WARM_EAGER.clear()
    bench.run_campaign(spec, tmp_path, engine_factory=lambda c, e, d: (Eager(c), {}), progress=False,
                       measure_bandwidth=False, command="pytest")
    warmups = [n for _, n in seen[0::2]]  # warmup, timed, warmup, timed, ...
    assert warmups == [5, 2, 2, 2]
    recs = {r["id"]: r for r in bench.load_records(tmp_path / "t")}
    assert recs["m__engine__grouped__r4__b1__p4__d5"]["engine"]["full_length_warmup"] is True
    assert recs["m__engine__grouped__r4__b2__p4__d5"]["engine"]["warmup_new_tokens"] == 2
    bench._WARM_EAGER.clear()


def test_nonrouted_bytes_follow_the_adapter_inventory():
    """The byte floor's non-routed bytes: OLMoE-1B-7B by hand (q/k/v/o, two norms, q/k norms over the
    projection, router per layer; final norm, lm_head, one embedding row), and a dense layer adds its MLP."""
    import dataclasses

    from runmap.arch.config import load_preset
    from runmap.bench.metrics import nonrouted_bytes_per_step

    cfg = load_preset("olmoe-1b-7b-0924")[0]
    h, layers, v, e = 2048, 16, cfg.vocab_size, 64
    per_layer = 4 * h * h + 2 * h + 2 * h + e * h
    assert nonrouted_bytes_per_step(cfg, 1) == 2 * (layers * per_layer + h + v * h + h)
    assert nonrouted_bytes_per_step(cfg, 8) - nonrouted_bytes_per_step(cfg, 1) == 2 * 7 * h
    qwen = load_preset("qwen1.5-moe-a2.7b")[0]
    dense = dataclasses.replace(qwen, dense_layers=(0,), intermediate_size=5632)
    extra = nonrouted_bytes_per_step(dense, 1) - nonrouted_bytes_per_step(qwen, 1)
    h, shared = qwen.hidden_size, qwen.shared_expert_intermediate_size
    # layer 0 reads a dense MLP (gate, up, down of 5632) instead of the shared expert, its gate and the router
    assert extra == 2 * 3 * h * 5632 - 2 * (3 * h * shared + h + qwen.num_experts * h)

@pytest.mark.parametrize("name,model,layers", [("h200-llama-matched", "olmoe", 16),
                                               ("h200-llama-matched-qwen", "qwen", 24)])
def test_the_matched_specs_hold_each_llama_cpp_rows_gpu_expert_rows(name, model, layers):
    """Each matched row's resident experts + top_k spares are llama.cpp's --n-cpu-moe row's GPU expert rows,
    E (L - n) / L per layer (clipped at top_k), and every row names the budget it matches."""
    from runmap.arch.config import load_preset

    spec = bench.load_spec(REPO / "specs" / "campaigns" / f"{name}.yaml")
    configs = bench.expand(spec)
    cfg = load_preset(spec["models"][model]["preset"])[0]
    assert cfg.num_layers == layers and {c.model for c in configs} == {model}
    for c in configs:
        n = c.p["matched_n_cpu_moe"]
        rows = cfg.num_experts * (cfg.num_layers - n) // cfg.num_layers
        assert c.resident == (cfg.num_experts if n == 0 else max(cfg.top_k, rows - cfg.top_k)), c.id


def test_each_row_resets_the_placement_reports_after_its_warm_ups_and_before_its_timed_runs(tmp_path):
    """A record's placement joins / step phases are averages the engine keeps over its life; the bench starts them
    afresh once a row's warm-ups are done, so a row never averages in its warm-ups or the rows a shared engine ran."""
    engines = []

    def factory(c, entry, device):
        engines.append(FakeEngine(c))
        return engines[-1], {}

    spec = tiny_spec()
    spec["groups"] = spec["groups"][2:3]
    spec["defaults"].update(repeats=2, warmup=1)
    bench.run_campaign(spec, tmp_path, engine_factory=factory, progress=False, measure_bandwidth=False,
                       command="pytest")
    # each engine serves two rows (batch 1 and 2): warm-up, reset, two timed runs; warm-up, reset, two timed runs
    assert engines and all(e.report_resets == [1, 4] and e.calls == 6 for e in engines), \
        [(e.report_resets, e.calls) for e in engines]
