"""Expert placement (issue 25 items 2-4): absent experts computed at the CPU site beside the device's leased ones.

* teacher-forced logits under every placement equal full residency's within the CPU site's tolerance, for
  tiny-olmoe and tiny-qwen2-moe, at the smallest residency (most experts absent) and a middle one;
* ``cpu`` transfers nothing after startup and publishes nothing; ``auto`` follows its measured-cost rule;
* a failure inside the CPU site leaves no lease, request or staging buffer behind;
* both ways the device part runs (batch-1 columns, larger batches as single-expert pairs) are exercised;
* the engine and the CLI refuse what a placement cannot do, and telemetry records the plan.
"""
from __future__ import annotations

import json
import time
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from runmap.engine.placement import (DECODE_CALL_TOKENS, AutoPlacement, CpuPlacement, InUseRate, PlacementCosts,
                                     PlacementError, make_placement)

PRESETS = ("tiny-olmoe", "tiny-qwen2-moe")


@pytest.fixture(scope="module")
def packs(seed3_tiny_packs):
    # seed 3 (tests/conftest.py): seed 5's tiny-olmoe has a near-tie in a router's top-k at one prompt position that
    # bf16 rounding flips, for the all-CPU executor (cpu-int4) exactly as for a mixed placement
    return seed3_tiny_packs


def _engine(pack, **kw):
    from runmap.engine.engine import Engine

    kw.setdefault("executor", "reference")
    return Engine.from_pack(pack, device="cpu", max_batch=2, max_seq_len=48, **kw)


def _prompt(cfg, n=14, seed=0):
    return torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# cpu-native against the reference executor's logits: FP32 experts, but the mixed sum (the CPU part in fp32 added to
# the device part's fp16) rounds in another order; measured up to 9.2e-4 of max |logit| on these packs (cpu-int4:
# 1.2e-3)
NATIVE_LOGITS_REL = 2e-3


def _close_to(got, ref, what, rel=1e-2):
    # default: the bf16 CPU site's bound (kernels/cpu_int4.py TOLERANCE["bf16"] = 1e-2 relative) on each position
    for t in range(ref.shape[0]):
        err, bound = float((got[t] - ref[t]).abs().max()), rel * float(ref[t].abs().max()) + rel / 5
        assert err <= bound, f"{what} position {t}: max |diff| {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def full_logits(packs):
    out = {}
    for name, (pack, cfg) in packs.items():
        eng = _engine(pack)
        try:
            out[name] = eng.logits(_prompt(cfg))
        finally:
            eng.close()
    return out


# every placement case with the default kernel; torch's kernel at one residency per preset (CI time)
@pytest.mark.parametrize("preset,where,cpu_executor", [(p, w, "cpu-native") for p in PRESETS for w in ("top_k", "half")]
                         + [(p, "half", "cpu-int4") for p in PRESETS])
def test_cpu_placement_logits_equal_full_residency_and_nothing_moves(packs, full_logits, preset, where, cpu_executor):
    pack, cfg = packs[preset]
    resident = cfg.top_k if where == "top_k" else (cfg.top_k + cfg.num_experts) // 2
    eng = _engine(pack, resident=resident, expert_placement="cpu", cpu_executor=cpu_executor)
    try:
        cache = eng.experts.cache
        startup = dict(cache.counters)
        site = eng.experts.cpu_site
        assert site.executor == cpu_executor
        # cpu-int4: every expert repacked at build, so no request pays a first use's repack; cpu-native reads the
        # host rows as they lie and holds no copy
        repacked = cfg.num_layers * cfg.num_experts if cpu_executor == "cpu-int4" else 0
        assert site.repacks == repacked and (site.nbytes > 0) == (repacked > 0)
        assert eng.experts.cpu_site_prepare_s > 0
        got = eng.logits(_prompt(cfg))
        assert site.repacks == repacked
        _close_to(got, full_logits[preset], f"{preset} resident {resident} cpu")
        if cpu_executor == "cpu-native":  # FP32 arithmetic: far inside the bf16 site's bound
            _close_to(got, full_logits[preset], f"{preset} resident {resident} cpu-native", rel=NATIVE_LOGITS_REL)
        c = cache.counters
        assert c["cpu_site_experts"] > 0 and c["misses"] == 0 and c["transactions"] == 0
        assert c["bytes_h2d"] == startup["bytes_h2d"] and cache.generation == 1  # no transfer, no publication
        assert cache.outstanding_leases() == 0 and cache.live_requests() == 0
        tel = eng.telemetry()
        assert tel["placement"]["mode"] == "cpu" and tel["placement"]["cpu_site_experts"] == c["cpu_site_experts"]
        assert tel["placement"]["cpu_site"]["repacked_experts"] == repacked
        assert tel["placement"]["cpu_site"]["executor"] == cpu_executor
        assert all(o["status"] == "OBSERVED" and o["value"] == 0 for o in tel["observations"].values()
                   if "value" in o and o.get("unit") != "bytes/s")
        assert not eng.use_segments  # mixed steps run the per-call path
    finally:
        eng.close()


@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_placement_at_the_same_residency_transfers(packs, preset):
    """The control: without a CPU site the same prompt at the same residency misses (so the cpu runs above really
    had absent experts to place)."""
    pack, cfg = packs[preset]
    eng = _engine(pack, resident=cfg.top_k)
    try:
        eng.logits(_prompt(cfg))
        assert eng.experts.cache.counters["misses"] > 0 and eng.experts.cache.counters["cpu_site_experts"] == 0
        assert "placement" not in eng.telemetry()
    finally:
        eng.close()


@pytest.mark.parametrize("preset", PRESETS)
def test_auto_placement_follows_its_rule_and_stays_equal(packs, full_logits, preset):
    pack, cfg = packs[preset]
    eng = _engine(pack, resident=cfg.top_k, expert_placement="auto")
    try:
        cache = eng.experts.cache
        measured = eng.experts.placement.costs
        assert measured.h2d_gb_s > 0 and measured.cpu_gb_s > 0 and measured.row_bytes == cache.row_bytes
        # a link 4x slower than the CPU site: transfer only above a 0.75 hit rate. The cold start (no evidence of
        # reuse) computes on the CPU; once hits dominate it transfers
        auto = AutoPlacement(PlacementCosts(h2d_gb_s=1.0, cpu_gb_s=4.0, row_bytes=cache.row_bytes, source="test"),
                             cache.counters, learn=False)
        eng.experts.placement = auto
        got = eng.logits(_prompt(cfg))
        _close_to(got, full_logits[preset], f"{preset} auto")
        assert auto.decisions["cpu"] > 0
        assert cache.counters["cpu_site_experts"] == auto.decisions["cpu"]
        assert cache.counters["misses"] == auto.decisions["transfer"]
        d = eng.telemetry()["placement"]
        assert d["mode"] == "auto" and d["transfer_if_hit_rate_above"] == pytest.approx(0.75)
        assert d["decisions"] == auto.decisions
    finally:
        eng.close()


def test_auto_rule():
    counters = {"hits": 0, "misses": 0, "cpu_site_experts": 0}
    fast_link = AutoPlacement(PlacementCosts(8.0, 4.0, 100, "test"), counters, learn=False, split=False)
    assert fast_link((3, 5)) == () and fast_link.decisions == {"transfer": 2, "cpu": 0}  # link >= CPU: transfer
    slow_link = AutoPlacement(PlacementCosts(1.0, 4.0, 100, "test"), counters, learn=False, split=False)
    assert slow_link((3,)) == (3,)  # no reuse seen yet: one CPU use (0.25) beats a transfer (1)
    counters.update(hits=80, misses=10, cpu_site_experts=10)  # h = 0.8 > 1 - 1/4: reuse pays for the transfer
    assert slow_link.hit_rate() == pytest.approx(0.8) and slow_link((4, 6)) == ()
    counters.update(hits=70)  # h = 0.7778... > 0.75 still
    assert slow_link((4,)) == ()
    counters.update(hits=20)  # h = 0.5
    assert slow_link((4,)) == (4,)
    assert CpuPlacement()((1, 2)) == (1, 2)
    with pytest.raises(ValueError, match="choose one of gpu, cpu, auto, auto-split"):
        make_placement("disk")
    costs = PlacementCosts(1.0, 4.0, 100, "test")
    split = make_placement("auto-split", cache=types.SimpleNamespace(counters=counters, resident=4), costs=costs)
    plain = make_placement("auto", cache=types.SimpleNamespace(counters=counters, resident=4), costs=costs)
    assert split.split and split.describe()["mode"] == "auto-split" and split.describe()["split"]
    assert not plain.split and plain.describe()["mode"] == "auto"


def test_auto_split_divides_a_calls_absent_experts_between_the_sites():
    """split (opt-in): the CPU site takes the share it computes while the link moves the rest, cpu / (cpu +
    h2d) = 0.75 here: floor(n x 0.75) where the rule favours transferring, n - floor(n x 0.25) where it favours the
    CPU; the least recently routed experts are the ones left on the CPU (they stay absent)."""
    counters = {"hits": 0, "misses": 0, "cpu_site_experts": 0}
    auto = AutoPlacement(PlacementCosts(h2d_gb_s=10.0, cpu_gb_s=30.0, row_bytes=100, source="test"), counters,
                         resident=4, learn=False, split=True)
    assert auto.split and not AutoPlacement(auto.costs, counters).split and auto.cpu_share() == pytest.approx(0.75)
    assert [auto.cpu_count(n, 0.0) for n in (1, 2, 3, 4)] == [1, 2, 3, 3]  # CPU favoured (h = 0 < 1 - 1/3)
    assert [auto.cpu_count(n, 0.9) for n in (1, 2, 3, 4)] == [0, 1, 2, 3]  # transfer favoured (h = 0.9)
    for _ in range(10):
        auto.observe(0, [1, 2])  # layer 0 reuses {1, 2}: h = 18 / 20
    auto.observe(0, [1, 6, 7, 2])  # 1 and 2 routed before (1 less recently), 6 and 7 never
    assert auto.reuse.last_recency == {1: 0, 2: 1, 6: -1, 7: -1}
    assert auto.hit_rate() == pytest.approx(20 / 24)  # transfer favoured (> 1 - 10 / 30): the CPU takes floor(0.75 n)
    assert auto((1, 6, 7)) == (6, 7)  # never-seen first; 1 is transferred
    assert auto((1, 2, 6)) == (6, 1)  # then the least recently routed
    assert auto.split_calls == 2 and auto.decisions == {"cpu": 4, "transfer": 2}
    d = auto.describe()
    assert d["split"] is True and d["cpu_share"] == pytest.approx(0.75) and d["split_calls"] == auto.split_calls
    # split keeps the chain with a CPU part while a call with the expected absent count would give the CPU one
    assert 0 < auto.expected_absent() < 1.5 and not auto.uses_cpu_now()  # one absent expert: floor(0.75) = 0
    auto.reuse.hits, auto.reuse.uses, auto.reuse.calls = 70, 100, 10  # h = 0.7, groups of 10: 3 absent expected
    assert auto.expected_absent() == pytest.approx(3.0) and auto.cpu_count(3, 0.7) == 2 and auto.uses_cpu_now()
    slow_cpu = AutoPlacement(PlacementCosts(h2d_gb_s=30.0, cpu_gb_s=1.0, row_bytes=100, source="test"), counters,
                             resident=4, learn=False, split=True)
    slow_cpu.observe(0, [1, 2])
    assert slow_cpu.cpu_count(1, 0.0) == 0 and not slow_cpu.uses_cpu_now()  # share 1/31: never worth a CPU part


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("placement", ["cpu", "auto-split"])
def test_a_batch_past_one_lease_with_a_cpu_site_runs_the_grouped_chain(packs, preset, placement, test_device,
                                                                       monkeypatch, record_decode):
    """A batch whose union may exceed one lease (2 rows, max_group = top_k) with a CPU site: the grouped chain with a
    CPU part (the placement asked once per layer; the experts it gives the CPU site computed on the job thread while
    the device groups hold the rest, added before the residual) gives the per-call path's greedy tokens and its
    logits up to the FP32 order of the sums; nothing stays leased or admitted. Under placement cpu nothing is
    transferred, so each layer call holds one request."""
    from runmap.engine.engine import Engine, SegmentDecoder

    run_groups, admitted = SegmentDecoder._run_groups, []

    def counted(self, layer):
        before = self.e.experts.cache.counters["requests_admitted"]
        run_groups(self, layer)
        admitted.append(self.e.experts.cache.counters["requests_admitted"] - before)
    monkeypatch.setattr(SegmentDecoder, "_run_groups", counted)
    pack, cfg = packs[preset]
    runs = {}
    for segments in (False, "eager" if test_device == "cpu" else True):
        eng = record_decode(Engine.from_pack(
            pack, executor="reference" if test_device == "cpu" else "grouped", device=test_device,
            resident=cfg.top_k + 1, max_batch=2, max_seq_len=48, segments=segments,
            expert_placement="cpu" if placement == "cpu" else "auto"))
        try:
            cache = eng.experts.cache
            assert cfg.top_k * 2 > cache.max_group
            if placement == "auto-split":  # the CPU twice the link: absent experts split both ways
                eng.experts.placement = AutoPlacement(PlacementCosts(5.0, 10.0, cache.row_bytes, "test"),
                                                      cache.counters, resident=cache.resident, learn=False,
                                                      split=True)
            toks = [r.token_ids for r in eng.generate(CHAIN_PROMPTS, max_new_tokens=8)]
            runs[segments] = (toks, eng.decoded, cache.counters["cpu_site_experts"])
            if segments:
                chain = eng._mixed_segments[2]
                assert chain.mixed and chain.grouped and chain.cpu_parts > 0 and chain.groups_run > 0
                # auto runs the grouped chain without a CPU part on a step where it would transfer everything
                steps = eng.decode_paths["chain_groups_cpu"] + eng.decode_paths["chain_groups"]
                assert steps == len(eng.decoded) and eng.decode_paths["per_call"] == 0
                assert eng.decode_paths["chain_groups"] == 0 or placement == "auto-split"
            assert cache.outstanding_leases() == 0 and cache.live_requests() == 0
        finally:
            eng.close()
    (toks_p, logits_p, cpu_p), (toks_c, logits_c, cpu_c) = runs.values()
    assert len(logits_c) == len(logits_p) > 0 and cpu_p > 0 and cpu_c > 0
    assert admitted and (placement != "cpu" or set(admitted) == {1})
    for a, b in zip(logits_c, logits_p):  # step by step while both decoded the same tokens
        atol = 1e-3 * b.abs().max().item()
        assert torch.allclose(a, b, atol=atol, rtol=0), (a - b).abs().max()
        if not torch.equal(a.argmax(-1), b.argmax(-1)):  # the sums' order may only flip a near tie
            top2 = b.topk(2, dim=-1).values
            assert ((top2[:, 0] - top2[:, 1]) <= 2 * atol).any()
            break
    else:
        assert toks_c == toks_p


def test_the_segment_chain_with_a_split_auto_equals_the_per_call_path(packs, record_decode):
    """auto with split (share 2/3): within one decode, some absent experts are transferred and others
    computed on the CPU; the chain (CPU part on the job thread, started at the placement decision) and the per-call
    path make the same decisions and give the same logits bit for bit, the same tokens and the same counters."""
    pack, cfg = packs["tiny-olmoe"]
    runs = {}
    for segments in (False, "eager"):
        eng = record_decode(_chain_engine(pack, cfg.top_k, "auto", segments))
        try:
            cache = eng.experts.cache
            # CPU twice the link: share 2/3, the CPU favoured below h = 0.5, so splits go both ways
            eng.experts.placement = auto = AutoPlacement(PlacementCosts(5.0, 10.0, cache.row_bytes, "test"),
                                                         cache.counters, resident=cache.resident, learn=False,
                                                         split=True)
            toks = [r.token_ids for r in eng.generate(CHAIN_PROMPTS, max_new_tokens=8)]
            c = cache.counters
            runs[segments] = (toks, eng.decoded, {k: c[k] for k in ("hits", "misses", "cpu_site_experts")},
                              dict(auto.decisions), auto.split_calls)
            if segments:
                assert eng.decode_paths["chain_cpu"] > 0 and eng._mixed_segments[1].cpu_parts > 0
            assert cache.outstanding_leases() == 0 and cache.live_requests() == 0
        finally:
            eng.close()
    (toks_p, logits_p, count_p, dec_p, split_p), (toks_c, logits_c, count_c, dec_c, split_c) = runs.values()
    assert split_p > 0 and count_p["misses"] > 0 and count_p["cpu_site_experts"] > 0
    assert toks_c == toks_p and count_c == count_p and dec_c == dec_p and split_c == split_p
    assert len(logits_c) == len(logits_p) > 0 and all(torch.equal(a, b) for a, b in zip(logits_c, logits_p))


def test_a_failing_cpu_site_leaves_nothing_held(packs, monkeypatch):
    pack, cfg = packs["tiny-olmoe"]
    eng = _engine(pack, resident=cfg.top_k, expert_placement="cpu")
    try:
        cache = eng.experts.cache
        site = eng.experts.site()

        def boom(*a, **k):
            raise RuntimeError("injected CPU-site failure")
        monkeypatch.setattr(site, "moe_subset", boom)
        with pytest.raises(RuntimeError, match="injected CPU-site failure"):
            eng.logits(_prompt(cfg))
        assert cache.outstanding_leases() == 0 and cache.staging_reserved() == 0
        monkeypatch.undo()
        eng.logits(_prompt(cfg, n=4))  # the engine still serves
        assert cache.outstanding_leases() == 0 and cache.live_requests() == 0
    finally:
        eng.close()


def test_both_device_paths_run_with_a_triton_executor(packs, full_logits, monkeypatch):
    """grouped (Triton, interpreter here) as the device executor: a batch-1 group keeps its device slots as columns,
    a larger group runs its device pairs as single-expert rows. Both shapes are seen and the logits still match."""
    pack, cfg = packs["tiny-olmoe"]
    r = cfg.num_experts - 2  # a group (its union of experts) may span several tokens: max_group up to resident
    eng = _engine(pack, executor="grouped", resident=r, expert_placement="cpu", max_group=r)
    try:
        shapes = []
        inner = eng.experts.moe

        def spy(executor, x, ids, gw, *a, **k):
            shapes.append((x.shape[0], ids.shape[1]))
            return inner(executor, x, ids, gw, *a, **k)
        monkeypatch.setattr(eng.experts, "moe", spy)
        got = eng.logits(_prompt(cfg))
        _close_to(got, full_logits["tiny-olmoe"], "tiny-olmoe grouped cpu")
        assert any(t > 1 and k == 1 for t, k in shapes), shapes  # pairs of a multi-token group
        eng.experts.moe = inner
        shapes.clear()
        eng.experts.moe = spy
        eng.generate(["hello"], max_new_tokens=3)  # decode at batch 1: the kept slots as columns
        assert any(t == 1 and 1 <= k < cfg.top_k for t, k in shapes), shapes
    finally:
        eng.close()


def test_the_engine_refuses_what_a_placement_cannot_do(packs):
    from runmap.engine.engine import EngineError

    pack, cfg = packs["tiny-olmoe"]
    with pytest.raises(EngineError, match="unknown expert placement 'disk'"):
        _engine(pack, resident=cfg.top_k, expert_placement="disk")
    with pytest.raises(EngineError, match="beside a device executor"):
        _engine(pack, executor="cpu-int4", expert_placement="cpu")
    with pytest.raises(EngineError, match="beside a device executor"):
        _engine(pack, expert_format="fp16", expert_placement="cpu")


def test_cli_logits_prints_the_plan_and_writes_valid_telemetry(packs, tmp_path, capsys):
    from runmap.cli.main import main
    from runmap.conformance.schemas import load_schemas

    pack, cfg = packs["tiny-olmoe"]
    out = tmp_path / "l.safetensors"
    rc = main(["logits", "--packed", str(pack), "--tokens", "5,6,7,8", "--executor", "reference", "--device", "cpu",
               "--resident", str(cfg.top_k), "--expert-placement", "auto", "--out", str(out),
               "--telemetry", str(tmp_path / "telemetry.json")])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "expert placement auto: host->device" in err and "transfer a miss when the hit rate is above" in err
    assert "(CPU device: a copy in host memory, no link)" in err and " 0.0 GB/s" not in err  # (rates to 3 digits)
    doc = json.loads((tmp_path / "telemetry.json").read_text())
    assert doc["placement"]["mode"] == "auto" and set(doc["placement"]["decisions"]) == {"transfer", "cpu"}
    assert load_schemas().validate_document(doc, "telemetry") == []
    with pytest.raises(SystemExit) as exit_:
        main(["logits", "--packed", str(pack), "--tokens", "5,6", "--expert-placement", "disk", "--out", str(out)])
    assert exit_.value.code == 2 and "--expert-placement: invalid choice: 'disk'" in capsys.readouterr().err


# ---- next-layer prefetch (issue 24 items 4 and 7) ---------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_prefetch_changes_no_logit_and_predicts_some_experts(packs, full_logits, preset):
    """With the reference executor the rows an expert sits in cannot change a result, so logits with prefetch on
    equal prefetch off exactly; the prediction (layer L+1's router on layer L's input) is right for some experts."""
    pack, cfg = packs[preset]
    resident = (cfg.top_k + cfg.num_experts) // 2
    outs, counters = {}, {}
    for on in (False, True):
        eng = _engine(pack, resident=resident, prefetch=on)
        try:
            outs[on] = eng.logits(_prompt(cfg))
            counters[on] = dict(eng.experts.cache.counters)
            assert eng.experts.cache.outstanding_leases() == 0 and not eng.use_segments
        finally:
            eng.close()
    assert torch.equal(outs[True], outs[False])
    _close_to(outs[True], full_logits[preset], f"{preset} prefetch")
    on, off = counters[True], counters[False]
    assert off["prefetches"] == 0 and on["prefetches"] > 0 and on["prefetched_experts"] >= on["prefetches"]
    assert 0 < on["prefetch_used"] <= on["prefetched_experts"]
    assert on["misses"] < off["misses"]  # predicted experts were resident when their layer routed to them


def test_prefetch_refusals(packs):
    from runmap.engine.engine import EngineError

    pack, cfg = packs["tiny-olmoe"]
    with pytest.raises(EngineError, match="needs partial residency"):
        _engine(pack, prefetch=True)
    # a routing workload is served by its own prediction (tests/test_routing_workload.py), no longer refused
    assert _engine(pack, resident=cfg.top_k, prefetch=True, routing="calibrated").imposed.predicting
    with pytest.raises(EngineError, match="choose one of the two"):  # a prefetch would be silently skipped
        _engine(pack, resident=cfg.top_k, prefetch=True, expert_placement="cpu")


def test_bench_records_carry_the_placement_and_prefetch(packs, tmp_path):
    """runmap bench: the run parameters expert_placement / prefetch reach the engine, the record's config and id,
    and a `sites` block with what the CPU site and the prefetch did (schema-valid)."""
    from runmap.bench import campaign as bench
    from runmap.conformance.schemas import validate_document

    pack, cfg = packs["tiny-olmoe"]
    spec = {"name": "pl", "description": "placement", "device": "cpu",
            "defaults": {"repeats": 1, "warmup": 0},
            "models": {"m": {"preset": "tiny-olmoe", "pack": str(pack)}},
            "groups": [{"name": "cpu", "kind": "engine", "models": ["m"], "resident": [cfg.top_k],
                        "executors": ["reference"], "batch": [1], "prompt_len": 6, "decode_len": 4,
                        "params": {"expert_placement": "cpu"}},
                       {"name": "pf", "kind": "engine", "models": ["m"], "resident": [6],
                        "executors": ["reference"], "batch": [1], "prompt_len": 6, "decode_len": 4,
                        "params": {"prefetch": True}},
                       {"name": "plain", "kind": "engine", "models": ["m"], "resident": [6],
                        "executors": ["reference"], "batch": [1], "prompt_len": 6, "decode_len": 4}]}
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=False, command="pytest")
    assert not summary["failed"], summary["failed"]
    recs = {r["group"]: r for r in bench.load_records(tmp_path / "pl")}
    for r in recs.values():
        assert validate_document({k: v for k, v in r.items() if k != "_path"}, "bench-record.schema.json") == []
    cpu, pf, plain = recs["cpu"], recs["pf"], recs["plain"]
    assert cpu["id"].endswith("__placement-cpu") and cpu["config"]["expert_placement"] == "cpu"
    assert cpu["sites"]["cpu_site_experts"] > 0 and cpu["sites"]["placement"]["mode"] == "cpu"
    assert cpu["cache_stats"]["misses"]["value"] == 0  # nothing transferred after startup
    cs = cpu["cache_stats"]
    assert cs["cpu_site_experts"]["value"] == cpu["sites"]["cpu_site_experts"] > 0
    assert cs["hit_rate"]["value"] == pytest.approx(
        cs["hits"]["value"] / (cs["hits"]["value"] + cs["cpu_site_experts"]["value"]))
    assert cs["hit_rate"]["value"] < 1  # a CPU placement does not read as all hits
    assert pf["id"].endswith("__prefetch") and pf["config"]["prefetch"] is True
    s = pf["sites"]
    assert s["prefetch"] is True and s["prefetched_experts"] >= s["prefetch_used"] >= 0
    if s["prefetched_experts"]:
        assert s["prefetch_accuracy"] == pytest.approx(s["prefetch_used"] / s["prefetched_experts"])
    assert plain["config"]["expert_placement"] == "gpu" and plain["config"]["prefetch"] is False
    # a partial-residency row says which path decoded it (3 decode steps after the prefill's token, per call on the CPU)
    assert plain["sites"] == {"expert_placement": "gpu", "prefetch": False,
                              "decode_steps": {"graphs": 0, "chain": 0, "chain_groups": 0, "chain_cpu": 0,
                                               "chain_groups_cpu": 0, "host_read": 0, "two_site": 0, "per_call": 3}}


# ---- an emulated slower link (issue 25 item 6: the consumer-link experiment) ------------------------------------

@pytest.mark.parametrize("placement", ["auto", "auto-split"])
def test_auto_sees_the_emulated_link_and_the_record_says_emulation(packs, tmp_path, placement):
    from runmap.bench import campaign as bench
    from runmap.conformance.schemas import validate_document

    pack, cfg = packs["tiny-olmoe"]
    eng = _engine(pack, resident=cfg.top_k, expert_placement=placement, emulate_link_gb_s=0.001)  # 1 MB/s
    try:
        assert eng.experts.placement.split == (placement == "auto-split")
        costs = eng.experts.placement.costs
        assert costs.h2d_gb_s == 0.001 and "emulated link" in costs.source
        assert eng.experts.cache.transport.describe()["emulation"] is True
    finally:
        eng.close()
    spec = {"name": "em", "description": "emulated link", "device": "cpu", "defaults": {"repeats": 1, "warmup": 0},
            "models": {"m": {"preset": "tiny-olmoe", "pack": str(pack)}},
            "groups": [{"name": "auto", "kind": "engine", "models": ["m"], "resident": [cfg.top_k],
                        "executors": ["reference"], "batch": [1], "prompt_len": 4, "decode_len": 3,
                        "params": {"expert_placement": placement, "emulate_link_gb_s": 0.5}}]}
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=False, command="pytest")
    assert not summary["failed"], summary["failed"]
    (rec,) = bench.load_records(tmp_path / "em")
    assert validate_document({k: v for k, v in rec.items() if k != "_path"}, "bench-record.schema.json") == []
    assert rec["id"].endswith(f"__placement-{placement}.link0p5gbs") and rec["sites"]["placement"]["mode"] == placement
    assert rec["config"]["emulate_link_gb_s"] == 0.5 and any("EMULATION" in n for n in rec["notes"])
    assert rec["sites"]["placement"]["costs"]["h2d_gb_s"] <= 0.5
    # the timed run's 2 decode steps (decode_len 3: the first token is the prefill's), eager on the CPU
    assert rec["sites"]["decode_steps"] == {"graphs": 0, "chain": 0, "chain_groups": 0, "chain_cpu": 0, "chain_groups_cpu": 0,
                                            "host_read": 0, "two_site": 0, "per_call": 2}


@pytest.mark.parametrize("workers", [1, 3, 64])
def test_parallel_repack_at_build_makes_the_same_experts(packs, workers):
    """CpuExpertSite.prepare on several threads repacks each expert exactly once (counters) into the same tensors
    as one thread, and an expert asked for later is the stored one."""
    from runmap.kernels.cpu_int4 import CpuExpertSite

    pack, cfg = packs["tiny-qwen2-moe"]
    eng = _engine(pack, resident=cfg.num_experts)
    try:
        host = eng.experts.cache.host
        one, many = CpuExpertSite(host), CpuExpertSite(host)
        one.prepare()
        many.prepare(workers=workers)
        assert many.repacks == one.repacks == cfg.num_layers * cfg.num_experts
        assert many.source_bytes_read == one.source_bytes_read and many.nbytes == one.nbytes
        for layer in range(cfg.num_layers):
            for e in range(cfg.num_experts):
                a, b = one.expert(layer, e), many.expert(layer, e)
                for pa, pb in ((a.gate_up, b.gate_up), (a.down, b.down)):
                    assert torch.equal(pa.weight, pb.weight) and torch.equal(pa.scale_zero, pb.scale_zero)
                    assert (pa.n, pa.k, pa.k_pad, pa.group) == (pb.n, pb.k, pb.k_pad, pb.group)
        assert many.repacks == cfg.num_layers * cfg.num_experts  # asking again repacks nothing
    finally:
        eng.close()


def test_a_failing_repack_at_build_surfaces_as_itself(packs, monkeypatch):
    from runmap.kernels import cpu_int4

    pack, cfg = packs["tiny-olmoe"]
    site = cpu_int4.CpuExpertSite(_engine(pack, resident=cfg.num_experts).experts.cache.host)

    def broken(row, layout, precision):
        raise cpu_int4.CpuSiteError("repack refused")
    monkeypatch.setattr(cpu_int4, "repack_expert", broken)
    with pytest.raises(cpu_int4.CpuSiteError, match="repack refused"):
        site.prepare(workers=4)
    assert site.repacks == 0


def test_auto_on_a_link_faster_than_the_cpu_site_runs_the_plain_path(packs):
    """auto with h2d >= the CPU site's rate never chooses the CPU: the layer calls take the plain path (and the
    segment chain stays available), while the plan is still reported."""
    from runmap.engine.placement import AutoPlacement, PlacementCosts

    pack, cfg = packs["tiny-olmoe"]
    eng = _engine(pack, resident=cfg.top_k, expert_placement="auto")
    try:
        cache = eng.experts.cache
        eng.experts.placement = AutoPlacement(PlacementCosts(10.0, 1.0, cache.row_bytes, "test"), cache.counters,
                                                      learn=False)
        assert not eng.experts.mixed(1) and eng.experts.placement.may_use_cpu() is False
        eng.logits(_prompt(cfg, n=4))
        assert cache.counters["cpu_site_experts"] == 0 and cache.counters["misses"] > 0
        assert eng.telemetry()["placement"]["transfer_if_hit_rate_above"] == 0
    finally:
        eng.close()


def _chain_engine(pack, resident, placement, segments):
    from runmap.engine.engine import Engine

    return Engine.from_pack(pack, executor="reference", device="cpu", resident=resident, max_batch=1,
                            max_seq_len=48, segments=segments, expert_placement=placement)


CHAIN_PROMPTS = ["the cache holds", "experts"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("where", ["top_k", "half"])
def test_the_segment_chain_with_a_cpu_site_equals_the_per_call_path(packs, preset, where, test_device, record_decode):
    """Placement cpu in the decode chain (each layer: routing segment, device part with the CPU-site slots'
    weights zeroed, CPU part added by the next segment; captured as CUDA graphs on a GPU) gives the per-call
    path's decode logits exactly at batch 1 (zeroed slots add exact zeros to the device part's FP32 sum), hence its
    greedy tokens, and on the CPU the same hits, misses and CPU-site experts (on CUDA the capture's warm-up steps
    lease too)."""
    from runmap.engine.engine import Engine

    pack, cfg = packs[preset]
    resident = cfg.top_k if where == "top_k" else (cfg.top_k + cfg.num_experts) // 2
    runs = {}
    for segments in (False, "eager" if test_device == "cpu" else True):
        eng = record_decode(Engine.from_pack(
            pack, executor="reference" if test_device == "cpu" else "grouped", device=test_device,
            resident=resident, max_batch=1, max_seq_len=48, segments=segments, expert_placement="cpu"))
        try:
            assert eng.use_segments == bool(segments)
            toks = [r.token_ids for r in eng.generate(CHAIN_PROMPTS, max_new_tokens=8)]
            c = eng.experts.cache.counters
            runs[segments] = (toks, eng.decoded, {k: c[k] for k in ("hits", "misses", "cpu_site_experts")})
            if segments:
                chain = eng._mixed_segments[1]
                assert chain.mixed and chain.cpu_parts > 0 and not eng._segments
                assert eng.decode_paths["chain_cpu"] == len(eng.decoded) and eng.decode_paths["per_call"] == 0
            else:
                assert eng.decode_paths["per_call"] == len(eng.decoded) and eng.decode_paths["chain_cpu"] == 0
            assert eng.experts.cache.outstanding_leases() == 0 and eng.experts.cache.live_requests() == 0
        finally:
            eng.close()
    (toks_p, logits_p, count_p), (toks_c, logits_c, count_c) = runs.values()
    assert toks_c == toks_p and len(logits_c) == len(logits_p) > 0
    assert all(torch.equal(a, b) for a, b in zip(logits_c, logits_p))
    assert count_p["cpu_site_experts"] > 0
    if test_device == "cpu":
        assert count_c == count_p
    else:
        assert count_c["cpu_site_experts"] >= count_p["cpu_site_experts"] and count_c["misses"] == count_p["misses"]


class _NothingOnTheCpu(CpuPlacement):
    """A placement that could use the CPU site (the engine keeps the chain with a CPU part) but gives it nothing."""

    def __call__(self, absent):
        return ()


def test_a_layer_without_cpu_experts_after_one_with_them_adds_nothing_stale(packs, record_decode):
    """After steps with CPU-site experts, steps whose layers have none (the placement gives the CPU nothing) must
    neither keep the old mask (slots zeroed) nor add the old CPU sum: the chain's decode logits equal the per-call
    path's, which has no such buffers, through both phases."""
    pack, cfg = packs["tiny-olmoe"]
    logits = {}
    for segments in (False, "eager"):
        eng = record_decode(_chain_engine(pack, cfg.top_k, "cpu", segments))
        try:
            eng.generate(CHAIN_PROMPTS[:1], max_new_tokens=4)
            cpu_first = eng.experts.cache.counters["cpu_site_experts"]
            eng.experts.placement = _NothingOnTheCpu()
            eng.generate(CHAIN_PROMPTS[1:], max_new_tokens=4)
            assert eng.experts.cache.counters["cpu_site_experts"] == cpu_first > 0
            if segments:
                chain = eng._mixed_segments[1]
                assert not any(chain.cpu_set) and not any(chain.layer_cpu)
                assert bool((chain.host_slots[:, cfg.num_experts:] == 1).all())  # every slot kept on the device
            logits[segments] = eng.decoded
        finally:
            eng.close()
    assert len(logits["eager"]) == len(logits[False]) == 6  # 3 decode steps per generate (the first token is prefill's)
    assert all(torch.equal(a, b) for a, b in zip(logits["eager"], logits[False]))


def test_auto_in_the_segment_chain_follows_its_rule_from_step_to_step(packs):
    """auto on a link slower than the CPU site (threshold 0.1 here): while the hit rate it reads is below the
    threshold, decode steps run the chain with a CPU part and absent experts go to the CPU site; once it is above,
    steps run the plain chain and transfer, exactly as placement gpu would (no CPU-site expert)."""
    pack, cfg = packs["tiny-olmoe"]
    resident = (cfg.top_k + cfg.num_experts) // 2
    eng = _chain_engine(pack, resident, "auto", "eager")
    try:
        cache = eng.experts.cache
        seen = {"hits": 0, "misses": 100, "cpu_site_experts": 0}  # the counters the rule reads: hit rate 0
        eng.experts.placement = auto = AutoPlacement(PlacementCosts(9.0, 10.0, cache.row_bytes, "test"), seen,
                                                             learn=False, split=False)
        assert auto.may_use_cpu() and eng.experts.mixed(1)
        eng.generate(CHAIN_PROMPTS[:1], max_new_tokens=4)
        cpu_first = cache.counters["cpu_site_experts"]
        assert cpu_first > 0 and eng._mixed_segments[1].cpu_parts > 0 and not eng._segments
        assert auto.decisions["cpu"] > 0 and auto.decisions["transfer"] == 0
        seen["hits"] = 900  # hit rate 0.9: transfer from now on
        assert not eng.experts.mixed(1)
        misses = cache.counters["misses"]
        eng.generate(CHAIN_PROMPTS[1:], max_new_tokens=4)
        assert 1 in eng._segments and cache.counters["cpu_site_experts"] == cpu_first
        assert eng.decode_paths["chain_cpu"] == 3 and eng.decode_paths["chain"] == 3  # 3 decode steps each
        assert cache.counters["misses"] > misses
        assert cache.outstanding_leases() == 0 and cache.live_requests() == 0
    finally:
        eng.close()


def test_a_failing_cpu_site_inside_the_chain_leaves_nothing_held(packs, monkeypatch):
    """The CPU site raising in a decode step's CPU part (not in prefill, which runs per call; with cpu-native the part
    runs on the site's job thread and its error surfaces when the chain collects it): the error reaches the caller
    and the step's request gives back every lease."""
    from runmap.kernels import cpu_int4

    pack, cfg = packs["tiny-olmoe"]
    eng = _chain_engine(pack, cfg.top_k, "cpu", "eager")
    assert eng.experts.site().native  # the default CPU executor: the chain's CPU part is a job

    def failing_call(self, *a, **k):
        def call():  # fails on the job thread, as a kernel error would
            raise RuntimeError("cpu site failed in the chain")
        return call

    monkeypatch.setattr(cpu_int4.CpuExpertSite, "prepare_subset_arrays", failing_call)  # only the chain calls it
    try:
        with pytest.raises(RuntimeError, match="cpu site failed in the chain"):
            eng.generate(CHAIN_PROMPTS[:1], max_new_tokens=3)
        assert 1 in eng._mixed_segments  # the failure came from the chain's CPU part
        cache = eng.experts.cache
        assert cache.outstanding_leases() == 0 and cache.live_requests() == 0
    finally:
        eng.close()


def test_a_lease_failing_after_the_cpu_part_started_waits_for_it(packs, monkeypatch):
    """The placement has started a layer's CPU part on the job thread and the lease then fails (here: right after the
    cache's acquisition returns): the step waits for the job before it releases the request and raises, so no kernel
    is left writing buffers the next step reuses."""
    import threading

    from runmap.kernels import cpu_int4
    from runmap.residency.cache import ExpertCache

    pack, cfg = packs["tiny-olmoe"]
    eng = _chain_engine(pack, cfg.top_k, "cpu", "eager")
    prepare, acquire = cpu_int4.CpuExpertSite.prepare_subset_arrays, ExpertCache._acquire
    finished, in_chain = [], threading.Event()

    def slow_prepare(self, *a, **k):
        call = prepare(self, *a, **k)

        def slow():
            time.sleep(0.3)
            call()
            finished.append(time.perf_counter())
        return slow

    def failing_acquire(self, req, layer, ids, place=None):
        lease = acquire(self, req, layer, ids, place)
        if place is not None and lease.cpu_experts and in_chain.is_set():
            raise RuntimeError("lease failed after the CPU part started")
        return lease

    monkeypatch.setattr(cpu_int4.CpuExpertSite, "prepare_subset_arrays", slow_prepare)
    monkeypatch.setattr(ExpertCache, "_acquire", failing_acquire)
    decode = eng.decode

    def decode_in_chain(*a, **k):
        in_chain.set()
        return decode(*a, **k)
    eng.decode = decode_in_chain
    try:
        with pytest.raises(RuntimeError, match="lease failed after the CPU part started"):
            eng.generate(CHAIN_PROMPTS[:1], max_new_tokens=3)
        raised = time.perf_counter()
        chain = eng._mixed_segments[1]
        assert finished and finished[-1] < raised and not any(chain._jobs)  # the job ran to its end first
        cache = eng.experts.cache
        assert cache.outstanding_leases() == 0 and cache.live_requests() == 0
    finally:
        eng.close()


@pytest.mark.parametrize("preset", PRESETS)
def test_prefetch_in_the_segment_chain(packs, preset, test_device):
    """The partial-residency decode chain (segments; on the CPU without graphs) prefetches too: each segment that
    routes layer l also writes layer l + 1's predicted ids, moved while the next segment runs. Greedy tokens equal
    the chain without prefetch, and the decode steps' prefetches are used."""
    from runmap.engine.engine import Engine

    seg_mode = True if test_device == "cuda" else "eager"
    pack, cfg = packs[preset]
    resident = (cfg.top_k + cfg.num_experts) // 2
    runs = {}
    for on in (False, True):
        eng = Engine.from_pack(pack, executor="reference" if test_device == "cpu" else "grouped", device=test_device,
                               resident=resident, max_batch=1, max_seq_len=48, segments=seg_mode, prefetch=on)
        try:
            assert eng.use_segments
            toks = eng.generate(["the cache holds", "experts"], max_new_tokens=8)
            assert 1 in eng._segments
            runs[on] = ([r.token_ids for r in toks], dict(eng.experts.cache.counters))
            assert eng.experts.cache.outstanding_leases() == 0 and eng.experts.cache.live_requests() == 0
        finally:
            eng.close()
    assert runs[True][0] == runs[False][0]
    on, off = runs[True][1], runs[False][1]
    assert off["prefetches"] == 0 and on["prefetches"] > 0 and 0 < on["prefetch_used"] <= on["prefetched_experts"]


# ---- auto's reuse estimate: a shadow LRU of the routes, not the cache's own hit rate ------------------------------


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 6), data=st.data())
def test_the_reuse_estimate_is_the_lru_replay_of_the_routes(capacity, data):
    """ReuseEstimator, fed one layer call at a time, counts what runmap.workload.replay.lru_hits counts over the
    whole sequence (an independent implementation), per layer, cold misses included."""
    from runmap.engine.placement import ReuseEstimator
    from runmap.workload.replay import lru_hits

    est = ReuseEstimator(capacity)
    per_layer = {0: [], 1: []}
    for layer, step in data.draw(st.lists(st.tuples(st.sampled_from([0, 1]), st.lists(
            st.integers(0, 9), min_size=1, max_size=capacity, unique=True)), max_size=30)):
        est.observe(layer, step)
        per_layer[layer].append(step)
    hits = uses = 0
    for steps in per_layer.values():
        h, n = lru_hits(steps, capacity)
        hits, uses = hits + h, uses + n
    assert (est.hits, est.uses) == (hits, uses)
    assert est.hit_rate == (hits / uses if uses else 0.0)


def test_auto_reads_the_shadow_lru_not_the_cache_counters():
    """With a resident count, auto's h is the shadow LRU's: counters that say nothing was ever a hit (as the cache's
    do once the CPU site takes the misses) do not keep it on the CPU when the routes reuse their experts."""
    from runmap.engine.placement import PlacementError, ReuseEstimator

    costs = PlacementCosts(h2d_gb_s=5.0, cpu_gb_s=10.0, row_bytes=1000, source="test")  # transfer if h > 0.5
    never_hit = {"hits": 0, "misses": 0, "cpu_site_experts": 1000}
    auto = AutoPlacement(costs, never_hit, resident=4, learn=False, split=False)  # the rule alone: no exploration
    assert auto.hit_rate() == 0.0 and auto((7,)) == (7,)  # no evidence yet: the CPU
    for _ in range(3):
        auto.observe(0, torch.tensor([[1, 2], [2, 3]]))  # one batch's union {1, 2, 3}, reused
    assert auto.hit_rate() == pytest.approx(6 / 9) and auto((7,)) == ()  # reuse 0.67 > 0.5: transfer
    d = auto.describe()
    assert d["hit_rate_source"].startswith("shadow LRU of the routed experts at 4 per layer (9 uses")
    assert AutoPlacement(costs, never_hit).hit_rate() == 0.0  # without a resident count: the counters given
    with pytest.raises(PlacementError, match="capacity 0 must be >= 1"):
        ReuseEstimator(0)


def test_an_engine_tells_auto_every_routed_expert_once(packs):
    """Every acquisition of every path (prefill per call, decode chain) shows auto its routed ids first: the shadow's
    uses equal the cache's hits + misses + CPU-site experts, whatever sites were chosen."""
    pack, cfg = packs["tiny-olmoe"]
    eng = _chain_engine(pack, cfg.top_k, "auto", "eager")
    try:
        cache = eng.experts.cache
        auto = eng.experts.placement
        assert auto.reuse is not None and auto.reuse.capacity == cache.resident == cfg.top_k
        eng.experts.placement = auto = AutoPlacement(PlacementCosts(1.0, 10.0, cache.row_bytes, "test"),
                                                     cache.counters, resident=cache.resident,
                                                     learn=False)  # CPU unless h > 0.9
        before = {k: cache.counters[k] for k in ("hits", "misses", "cpu_site_experts")}
        eng.generate(CHAIN_PROMPTS, max_new_tokens=6)
        seen = sum(cache.counters[k] - before[k] for k in before)
        assert auto.reuse.uses == seen > 0 and cache.counters["cpu_site_experts"] > before["cpu_site_experts"]
    finally:
        eng.close()


def test_the_in_use_rate_is_a_decaying_average_trusted_after_enough_calls():
    r = InUseRate(decay=0.5, min_calls=2)
    r.add(1e9, 1.0)
    assert r.gb_s is None and r.calls == 1  # one call is not enough evidence
    r.add(1e9, 3.0)  # (0.5 * 1e9 + 1e9) / (0.5 * 1 + 3) bytes per second
    assert r.gb_s == pytest.approx(1.5 / 3.5)
    r.add(0, 5.0)  # a call that read nothing says nothing
    assert r.calls == 2
    with pytest.raises(PlacementError, match="decay"):
        InUseRate(decay=1.0)
    with pytest.raises(PlacementError, match="clip"):
        InUseRate(clip=0.5)


def test_a_stalled_call_weighs_at_most_the_clip_and_a_real_slowdown_still_moves_the_rate():
    r = InUseRate(decay=0.9, min_calls=4, clip=4.0)
    for _ in range(3):  # untrusted calls are taken as they come: there is no rate yet to clip against
        r.add(1e9, 100.0)
    assert r.clipped == 0
    r = InUseRate(decay=0.9, min_calls=4, clip=4.0)
    for _ in range(8):
        r.add(1e9, 0.1)  # 10 GB/s
    before = r.gb_s
    assert before == pytest.approx(10.0)
    r.add(1e9, 50.0)  # one call stalled 500x: counted as 4x the rate's 0.1 s
    assert r.clipped == 1 and r.gb_s > 0.6 * before
    nbytes = sum(1e9 * 0.9 ** i for i in range(9))  # the eight 0.1 s calls decayed once more, then the stalled one
    seconds = sum(0.1 * 0.9 ** i for i in range(1, 9)) + 0.4
    assert r.gb_s == pytest.approx(nbytes / seconds / 1e9)
    for _ in range(60):  # a site that really slowed to 0.5 GB/s: the rate follows it, each call counted at most at
        prev = r.gb_s    # the clip: rate' = rate (0.9 B + 1) / (0.9 B + 4), B the decayed calls (6.1 here, up to 10)
        r.add(1e9, 2.0)
        assert prev / 1.5 <= r.gb_s <= prev
    assert r.gb_s == pytest.approx(0.5, rel=0.05)
    r.add(1e9, 0.0)  # no seconds: no evidence
    assert r.gb_s == pytest.approx(0.5, rel=0.05)
    off = InUseRate(decay=0.9, min_calls=4)  # the default: no clip (auto's rates)
    for _ in range(8):
        off.add(1e9, 0.1)
    off.add(1e9, 50.0)
    assert off.clipped == 0 and off.gb_s < 0.4


def test_auto_replaces_its_build_time_rates_by_what_it_observes_in_use():
    """The build-time probe says the CPU site is 4x the link (compute absent experts on the CPU at h = 0.5); the CPU
    calls observed in use run at a tenth of the probe's rate, so the rule turns to transfers; learn=False keeps the
    probe's rates (and still reports what it saw)."""
    counters = {"hits": 0, "misses": 0, "cpu_site_experts": 0}
    costs = PlacementCosts(h2d_gb_s=1.0, cpu_gb_s=4.0, row_bytes=1000, source="test")
    learning, fixed = AutoPlacement(costs, counters, split=False), AutoPlacement(costs, counters, learn=False,
                                                                                 split=False)
    for auto in (learning, fixed):
        assert not auto.transfer(0.5) and auto.uses_cpu_now()
        for _ in range(4):
            auto.observe_cpu(4000, 4000 / 0.4e9)  # 0.4 GB/s in use
    assert learning.cpu_gb_s() == pytest.approx(0.4) and learning.transfer(0.5) and not learning.uses_cpu_now()
    assert fixed.cpu_gb_s() == 4.0 and not fixed.transfer(0.5)
    d = learning.describe()
    assert d["rates_used"]["cpu_gb_s"] == pytest.approx(0.4) and d["in_use"]["cpu_calls"] == 4 and d["now"] == "transfer"
    # transfers observed slower than the probe lower the link's rate (never above an emulated link's pace)
    for _ in range(4):
        learning.observe_transfer(1000, 1000 / 0.1e9)
    assert learning.h2d_gb_s() == pytest.approx(0.1) and learning.uses_cpu_now()


def test_auto_learns_the_cpu_rate_of_decode_steps_apart_from_prompt_passes():
    """A prompt pass's CPU-site calls (many tokens per expert) run far below a decode step's; what the passes teach
    must not decide the decode steps. The link here (2 GB/s) is slower than the CPU at decode size (8 GB/s in use)
    and faster than it in passes (0.5 GB/s in use): at hit rate 0.5 a decode step computes on the CPU, a pass
    transfers, whichever was observed last."""
    counters = {"hits": 1, "misses": 1, "cpu_site_experts": 0}  # h = 0.5
    auto = AutoPlacement(PlacementCosts(h2d_gb_s=2.0, cpu_gb_s=3.0, row_bytes=1000, source="test"), counters,
                         split=False)
    auto.observe(0, np.zeros((64, 2), dtype=np.int64))  # a 64-token pass routes: its calls are of the pass class
    for _ in range(4):
        auto.observe_cpu(4000, 4000 / 0.5e9)
    assert auto.cpu_gb_s() == pytest.approx(0.5) and auto.cpu_gb_s(1) == 3.0  # decode: still the probe's rate
    for _ in range(4):
        auto.observe_cpu(4000, 4000 / 8e9, tokens=1)  # decode steps, told their size
    assert auto.cpu_gb_s(1) == pytest.approx(8.0) and auto.cpu_gb_s(64) == pytest.approx(0.5)
    assert auto.uses_cpu_now(1) and auto(("a", "b")) == ("a", "b")  # a decode step: the CPU site
    assert not auto.uses_cpu_now(64) and auto(("a", "b")) == ()  # a pass: the link
    auto.observe(0, np.zeros((DECODE_CALL_TOKENS, 2), dtype=np.int64))  # the largest call of the decode class
    assert auto.cpu_gb_s() == pytest.approx(8.0) and auto.uses_cpu_now()
    auto.observe(0, np.zeros((DECODE_CALL_TOKENS + 1, 2), dtype=np.int64))
    assert auto.cpu_gb_s() == pytest.approx(0.5) and not auto.uses_cpu_now()
    d = auto.describe()["in_use"]
    assert d["cpu_calls"] == 4 and d["cpu_passes_calls"] == 4 and d["cpu_passes_gb_s"] == pytest.approx(0.5)


def test_auto_explores_the_cpu_site_until_its_rate_is_measured_in_use():
    """A build-time probe that says the CPU site is slow (here 0.01 GB/s against a 10 GB/s link) would keep the rule on
    the link for good, since a site never chosen is never measured: while a call size class has fewer than min_calls
    CPU-site calls in use, each call gives the CPU one absent expert (the lowest id, without split), then the rule decides
    with the measured rate. Without learn the rule alone decides from the start, and a class whose calls are not
    expected to miss does not explore (it would keep the engine on the path with a CPU part for nothing)."""
    counters = {"hits": 0, "misses": 0, "cpu_site_experts": 0}
    costs = PlacementCosts(h2d_gb_s=10.0, cpu_gb_s=0.01, row_bytes=1000, source="test")
    fixed = AutoPlacement(costs, counters, resident=4, learn=False)
    assert not fixed.uses_cpu_now(1) and fixed((5, 6)) == () and fixed.explored == 0
    auto = AutoPlacement(costs, counters, resident=4)
    assert auto.exploring(1) and auto.uses_cpu_now(1)  # the step runs the path with a CPU part
    for call in range(4):
        assert auto((5, 6, 7)) == (5,) and auto.explored == call + 1  # one expert of the call, the rest transferred
        auto.observe_cpu(1000, 1000 / 20e9)  # measured in use: 20 GB/s, twice the link
    assert not auto.exploring(1) and auto.cpu_gb_s(1) == pytest.approx(20.0)
    assert auto((5, 6, 7)) == (5, 6, 7) and auto.explored == 4  # the rule now, with the rate from use: the CPU
    assert auto.exploring(64) and auto.uses_cpu_now(64)  # prompt passes are a class of their own, not measured yet
    assert auto((5, 6)) == (5,)  # a pass's call: one expert to the CPU (its rule, with the probe's rate, transfers)
    assert auto.describe()["explored"] == 5 and auto.decisions == {"transfer": 9, "cpu": 8}
    resident = AutoPlacement(costs, counters, resident=4)
    for _ in range(50):
        resident.observe(0, np.array([[1, 2]]))  # every call all hit after the first: ~0.04 experts expected absent
    assert not resident.exploring(1) and not resident.uses_cpu_now(1)


def test_an_engine_whose_cpu_probe_was_wrong_times_both_decode_modes_and_keeps_the_tokens(packs):
    """End to end in the decode segment chain: the build-time probe says the CPU site is far slower than the link, so
    the rule alone would transfer every miss for good; auto's decode step chooser runs steps of both modes (every
    absent expert moved, then every one computed at the CPU site), times them and goes on with the faster. The tokens
    equal placement gpu's throughout (the route never changes), both chains ran, and what it did is reported."""
    pack, cfg = packs["tiny-olmoe"]
    prompt = _prompt(cfg, n=DECODE_CALL_TOKENS + 8)  # its prefill is a pass: the rule, not the chooser
    ref = _chain_engine(pack, cfg.top_k, "gpu", "eager")
    try:
        want = ref.generate([prompt], max_new_tokens=12)
    finally:
        ref.close()
    eng = _chain_engine(pack, cfg.top_k, "auto", "eager")
    try:
        cache = eng.experts.cache
        eng.experts.placement = auto = AutoPlacement(PlacementCosts(10.0, 1e-6, cache.row_bytes, "test"),
                                                     cache.counters, resident=cfg.top_k)
        got = eng.generate([prompt], max_new_tokens=12)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert eng.decode_paths["chain"] > 0 and eng.decode_paths["chain_cpu"] > 0
        steps = auto.describe()["decode_steps"]["by_batch"]["1"]
        # 11 decode steps: 5 moving every miss, 5 computing them at the CPU site (3 timed each), then the faster (its
        # steps timed as it runs)
        assert steps["steps"]["transfer"] + steps["steps"]["cpu"] == 11 and min(steps["timed"].values()) == 3
        assert steps["chosen"] in ("transfer", "cpu") and steps["choices"] == 1
        # (the prompt pass explores its class; decode steps never explore: their modes are timed)
        assert auto.decisions["cpu"] > auto.explored
        assert cache.counters["cpu_site_experts"] > 0
    finally:
        eng.close()


def test_auto_decode_probes_run_on_until_their_steps_are_timed():
    """Runs of three steps (a warm-up, short requests) time one step each: auto's chooser (until_timed) keeps each
    probe going until it has timed DECODE_PROBE_STEPS steps, where a probe of fixed length would end with one; a
    chooser without until_timed (two-site's) keeps its fixed lengths; a probe that can time nothing (one-step runs)
    ends after its cap of extra steps."""
    from runmap.engine.placement import DECODE_PROBE_STEPS, StepChooser

    def drive(ch, run_len, steps):
        now, out = 0.0, []
        for i in range(steps):
            if i % run_len == 0:
                ch.break_runs()
            m = ch.mode(1, 100 + i, now)
            out.append(m)
            now += 0.01 if m == "cpu" else 0.02
        return out

    auto = StepChooser(min_batch=1, probe_steps=DECODE_PROBE_STEPS, rounds=1, modes=("transfer", "cpu"),
                       until_timed=True)
    modes = drive(auto, 3, 40)
    by = auto.describe()["by_batch"]["1"]
    assert by["timed"]["transfer"] >= DECODE_PROBE_STEPS and by["timed"]["cpu"] >= DECODE_PROBE_STEPS
    assert by["chosen"] == "cpu" and modes[-1] == "cpu"
    fixed = StepChooser(min_batch=1, probe_steps=DECODE_PROBE_STEPS, rounds=1, modes=("transfer", "cpu"))
    assert drive(fixed, 3, 10) == ["transfer"] * 5 + ["cpu"] * 5
    assert fixed.describe()["by_batch"]["1"]["timed"] == {"transfer": 1, "cpu": 1}  # one timed step per probe
    capped = StepChooser(min_batch=1, probe_steps=DECODE_PROBE_STEPS, rounds=1, modes=("transfer", "cpu"),
                         until_timed=True)
    # one-step runs: nothing is ever timed; each probe ends after its 5 steps + 4 x 3 extra, then the default mode
    assert drive(capped, 1, 40) == ["transfer"] * 17 + ["cpu"] * 17 + ["transfer"] * 6


def test_warm_ups_run_both_of_autos_decode_steps_without_its_chooser_counting_them(packs):
    """A warm-up (Engine.warm_up, the server's) asks warm_step_modes and runs each inside forced_step: under auto's
    rule in the segment chain those are the step moving every miss and the step computing them at the CPU site, both
    chains run and the chooser counts neither (its probes then time real steps); forcing auto's modes elsewhere is an
    error naming the mode."""
    from runmap.engine.engine import EngineError

    pack, cfg = packs["tiny-olmoe"]
    eng = _chain_engine(pack, cfg.top_k, "auto", "eager")
    try:
        auto = eng.experts.placement
        assert auto.decode_steps is not None and eng.warm_step_modes(1) == ("transfer", "cpu")
        zeros = torch.zeros(1, dtype=torch.long)
        for mode in eng.warm_step_modes(1):
            with eng.forced_step(mode):
                eng.decode(zeros, 0, zeros)
        assert eng.decode_paths["chain"] == 1 and eng.decode_paths["chain_cpu"] == 1
        assert auto.describe()["decode_steps"]["by_batch"] == {} and auto.forced_mode is None
    finally:
        eng.close()
    gpu = _chain_engine(pack, cfg.top_k, "gpu", "eager")
    try:
        assert gpu.warm_step_modes(1) == (None,)
        with pytest.raises(EngineError, match="forced step 'cpu': only under placement auto's rule"):
            with gpu.forced_step("cpu"):
                pass
    finally:
        gpu.close()


def test_auto_decode_steps_go_all_one_way_by_their_measured_step_times():
    """AutoPlacement's decode step chooser (no split, learn): a step's layer calls give the CPU site every absent
    expert or none, as the step's mode says; the modes are timed (wall time between consecutive steps) and the faster
    is kept, here the CPU's although the rule (a probe 1,000x slower than the link) would transfer; outside a step the
    rule decides again; auto-split and learn=False have no chooser."""
    counters = {"hits": 0, "misses": 0, "cpu_site_experts": 0}
    costs = PlacementCosts(h2d_gb_s=10.0, cpu_gb_s=0.01, row_bytes=1000, source="test")
    auto = AutoPlacement(costs, counters, resident=4)
    now, modes = 0.0, []
    for slot in range(40, 52):
        mode = auto.decode_step(8, slot, now)
        modes.append(mode)
        assert auto.uses_cpu_now(8) == (mode == "cpu") and not auto.exploring(8)
        assert auto((3, 5, 9)) == ((3, 5, 9) if mode == "cpu" else ())
        auto.end_decode_step()
        now += 0.010 if mode == "cpu" else 0.030  # the CPU's steps 3x faster
    assert modes == ["transfer"] * 5 + ["cpu"] * 7  # 5-step probes (3 timed), then the faster for the rest
    by = auto.describe()["decode_steps"]["by_batch"]["8"]
    assert by["chosen"] == "cpu" and by["median_ms"] == {"transfer": pytest.approx(30.0), "cpu": pytest.approx(10.0)}
    assert auto.decisions == {"transfer": 15, "cpu": 21}
    auto.forced_mode = "transfer"  # a warm-up's step (Engine.forced_step): that mode, the chooser not asked
    assert auto.decode_step(8, 52, now) == "transfer" and auto.describe()["decode_steps"]["by_batch"]["8"] == by
    auto.end_decode_step()
    auto.forced_mode = None
    assert auto((3, 5)) == (3,)  # no step: the rule again (exploring: one expert to the CPU site)
    assert AutoPlacement(costs, counters, resident=4, split=True).decode_steps is None
    assert AutoPlacement(costs, counters, resident=4, learn=False).decode_step(1, 0) is None


def test_a_prompt_pass_is_classed_by_its_size_whatever_its_token_groups(packs):
    """The per-call path leases a pass in token groups of at most max_group experts (top_k here: a token or two each),
    each one CPU-site call on this thread: the rule decides and learns them as the pass they belong to (40 tokens:
    the passes' class), not as decode steps, whose CPU part runs on the site's job thread beside the device."""
    pack, cfg = packs["tiny-olmoe"]
    eng = _engine(pack, resident=cfg.top_k, expert_placement="auto", max_group=cfg.top_k)
    try:
        cache = eng.experts.cache
        # the CPU far faster than the link: every absent expert of every call goes to the CPU site
        eng.experts.placement = auto = AutoPlacement(PlacementCosts(1e-6, 4.0, cache.row_bytes, "test"),
                                                     cache.counters, resident=cfg.top_k, split=False)
        asked, ask = [], auto.uses_cpu_now
        auto.uses_cpu_now = lambda tokens=None: asked.append(tokens) or ask(tokens)
        eng.logits(_prompt(cfg, n=40))
        assert cache.counters["cpu_site_experts"] > 0 and set(asked) == {40}
        assert auto.cpu_in_use_passes.calls > 0 and auto.cpu_in_use.calls == 0
        assert auto.describe()["rates_used"]["call_tokens"] == 40
    finally:
        eng.close()


def test_the_engine_tells_auto_what_its_cpu_calls_and_transfers_cost(packs):
    """Per-call path with a CPU part: every CPU-site call and every acquisition that moved bytes reaches auto."""
    pack, cfg = packs["tiny-olmoe"]
    eng = _engine(pack, resident=cfg.top_k, expert_placement="auto")
    try:
        cache = eng.experts.cache
        auto = AutoPlacement(PlacementCosts(1.0, 4.0, cache.row_bytes, "test"), cache.counters, learn=False)
        eng.experts.placement = auto
        eng.logits(_prompt(cfg))
        assert cache.counters["cpu_site_experts"] > 0 and auto.cpu_in_use.calls > 0
        assert auto.cpu_in_use._bytes > 0 and auto.describe()["in_use"]["cpu_calls"] == auto.cpu_in_use.calls
        if cache.counters["misses"]:
            assert auto.h2d_in_use.calls > 0
    finally:
        eng.close()


# ---- auto as placement host-read (the host-read site measured at build) -------------------------------------------

def test_auto_becomes_host_read_where_that_site_is_possible_unless_the_cpu_site_is_the_fastest():
    from runmap.engine.placement import HostReadPlacement, auto_chooses_host_read

    cache = types.SimpleNamespace(counters={"hits": 0, "misses": 0, "cpu_site_experts": 0}, resident=4)
    measured = []

    def rate(value):
        def measure():
            measured.append(value)
            return value
        return measure

    cpu_fastest = PlacementCosts(h2d_gb_s=20.0, cpu_gb_s=30.0, row_bytes=100, source="test")
    fast = make_placement("auto", cache=cache, costs=cpu_fastest, host_read_rate=rate(30.0))  # a tie: host-read
    assert isinstance(fast, HostReadPlacement) and measured == [30.0]
    d = fast.describe()
    assert d["mode"] == "host-read" and d["requested"] == "auto" and d["costs"]["host_read_gb_s"] == 30.0
    assert "30.0 GB/s per expert byte is not 1.25x above both the host-read site's 30.0 and the copy's 20.0" in d["why"]
    near = make_placement("auto", cache=cache, costs=cpu_fastest, host_read_rate=rate(24.0))  # 30 = 1.25 x 24: host-read
    assert isinstance(near, HostReadPlacement)
    slow = make_placement("auto", cache=cache, costs=cpu_fastest, host_read_rate=rate(23.9))  # 30 > 1.25 x 23.9: the rule
    assert isinstance(slow, AutoPlacement) and slow.describe()["costs"]["host_read_gb_s"] == 23.9
    # a slower host-read site still wins where the copy beats the CPU (the rule alone would run the chain)
    copy_faster = PlacementCosts(h2d_gb_s=40.0, cpu_gb_s=30.0, row_bytes=100, source="test")
    assert isinstance(make_placement("auto", cache=cache, costs=copy_faster, host_read_rate=rate(10.0)),
                      HostReadPlacement)
    # auto-split stays the rule and never measures the site
    split = make_placement("auto-split", cache=cache, costs=copy_faster, host_read_rate=rate(99.0))
    assert isinstance(split, AutoPlacement) and split.split and split.describe()["costs"]["host_read_gb_s"] is None
    # a rate given with the costs is used as is, never measured again
    given = make_placement("auto", cache=cache, costs=PlacementCosts(20.0, 30.0, 100, "test", host_read_gb_s=50.0),
                           host_read_rate=rate(1.0))
    assert isinstance(given, HostReadPlacement) and measured == [30.0, 24.0, 23.9, 10.0]
    # where the site is not possible (no measuring callable) a given rate decides nothing and is not reported
    impossible = make_placement("auto", cache=cache, costs=PlacementCosts(40.0, 30.0, 100, "test", host_read_gb_s=50.0))
    assert isinstance(impossible, AutoPlacement) and impossible.describe()["costs"]["host_read_gb_s"] is None
    assert not auto_chooses_host_read(cpu_fastest) and "requested" not in HostReadPlacement().describe()

    def broken():
        raise RuntimeError("no mapping here")

    failed = make_placement("auto", cache=cache, costs=copy_faster, host_read_rate=broken)  # the rule, and why
    c = failed.describe()["costs"]
    assert isinstance(failed, AutoPlacement) and c["host_read_gb_s"] is None
    assert "could not be measured (RuntimeError: no mapping here)" in c["source"]
    # host-read asked by name records the rate it measures, and nothing where the measurement raises
    assert make_placement("host-read", host_read_rate=rate(12.5)).describe()["host_read_gb_s"] == 12.5
    assert make_placement("host-read", host_read_rate=broken).describe()["host_read_gb_s"] is None
    assert make_placement("host-read").describe()["host_read_gb_s"] is None


@pytest.mark.parametrize("host_read_gb_s,policy", [(2.0, None), (2.0, "lfu-decay"), (2.0, "lru"), (0.5, None)])
# the CPU run: no policy asked (which takes lfu-decay) and lru; lfu-decay asked by name on a GPU (conftest.py, sweep)
@pytest.mark.sweep(lambda p: p["policy"] == "lfu-decay")
def test_an_engine_asked_for_auto_runs_host_read_when_it_is_the_cheaper_site(packs, host_read_gb_s, policy,
                                                                            test_device, record_decode, monkeypatch):
    """With the host-read site given faster than the CPU site and no batch the two-site step may run at (its chooser's
    minimum above the max batch), ``auto`` builds placement host-read's engine (host rows, the whole-step decoder,
    lfu-decay unless a policy was asked for) and decodes what placement host-read decodes, bit for bit; given slower,
    it stays auto with no host rows."""
    from runmap.engine.engine import TWO_SITE_MIN_BATCH_ENV, Engine
    from runmap.engine.placement import HostReadPlacement

    monkeypatch.setenv(TWO_SITE_MIN_BATCH_ENV, "3")  # max batch 2 below it, whatever the default

    pack, cfg = packs["tiny-olmoe"]
    costs = PlacementCosts(h2d_gb_s=0.5, cpu_gb_s=1.0, row_bytes=100, source="test", host_read_gb_s=host_read_gb_s)
    kw = dict(executor="grouped", device=test_device, resident=cfg.top_k, max_batch=2, max_seq_len=48,
              cache_contract="v2", policy=policy, warm_up=False)
    eng = record_decode(Engine.from_pack(pack, expert_placement="auto", placement_costs=costs, **kw))
    try:
        d = eng.telemetry()["placement"]
        if host_read_gb_s < costs.cpu_gb_s:
            assert d["mode"] == "auto" and d["costs"]["host_read_gb_s"] == 0.5
            assert not eng.use_host_read and eng.experts.host_rows is None
            assert eng.experts.cache.policy.name == "lru"
            return
        assert isinstance(eng.experts.placement, HostReadPlacement) and d["requested"] == "auto"
        assert eng.use_host_read and eng.experts.host_rows is not None
        assert eng.experts.cache.policy.name == (policy or "lfu-decay") and eng.experts.cpu_site is None
        if policy == "lru":  # an asked-for policy is kept; the decode below is the same code with either policy
            return
        eng._prefiller = None  # eager prompt passes on both sides (as the host-read equality test above)
        got = [r.token_ids for r in eng.generate(PROMPTS_HR, max_new_tokens=5, ignore_eos=True)]
        assert eng.decode_paths["host_read"] > 0
        got_logits = list(eng.decoded)
        got_policy = eng.experts.cache.policy
        got_counts = {k: eng.experts.cache.counters[k] for k in ("host_reads", "promotions", "evictions", "hits")}
        from runmap.cli.options import placement_line
        from runmap.conformance.schemas import load_schemas

        doc = eng.telemetry()
        assert load_schemas().validate_document(doc, "telemetry") == []
        assert doc["placement"]["costs"]["host_read_gb_s"] == 2.0
        assert placement_line(eng).startswith("expert placement host-read (chosen by auto: the CPU site's 1.0 GB/s")
    finally:
        eng.close()
    ref = record_decode(Engine.from_pack(pack, expert_placement="host-read", **kw))
    try:
        ref._prefiller = None
        want = [r.token_ids for r in ref.generate(PROMPTS_HR, max_new_tokens=5, ignore_eos=True)]
        assert got == want
        assert len(got_logits) == len(ref.decoded) > 0 and all(torch.equal(a, b)
                                                                 for a, b in zip(got_logits, ref.decoded))
        # the same policy (its half-life too) decides the same promotions: the logits alone could not tell, host and
        # device rows holding the same bytes
        asked = ref.telemetry()["placement"]  # host-read by name: its read rate measured on a GPU, never on the CPU
        assert asked.get("requested") is None and (asked["host_read_gb_s"] is None if test_device == "cpu"
                                                    else asked["host_read_gb_s"] > 0)
        want_policy = ref.experts.cache.policy
        assert got_policy.name == want_policy.name and getattr(got_policy, "rate", None) == getattr(want_policy, "rate",
                                                                                                    None)
        assert got_counts == {k: ref.experts.cache.counters[k] for k in got_counts} and got_counts["promotions"] > 0
    finally:
        ref.close()


PROMPTS_HR = ["the cache holds", "experts read from the host"]


def test_auto_never_chooses_host_read_where_that_placement_cannot_run(packs):
    from runmap.engine.engine import Engine, EngineError

    pack, cfg = packs["tiny-olmoe"]
    costs = PlacementCosts(h2d_gb_s=1.0, cpu_gb_s=1.0, row_bytes=100, source="test", host_read_gb_s=9.0)
    for kw in (dict(executor="reference"),  # host-read runs on the grouped executor only
               dict(executor="grouped", emulate_link_gb_s=5.0)):  # an emulated link paces copies, not the reads
        eng = Engine.from_pack(pack, device="cpu", resident=cfg.top_k, max_batch=1, max_seq_len=48, warm_up=False,
                               cache_contract="v2", expert_placement="auto", placement_costs=costs, **kw)
        try:
            d = eng.telemetry()["placement"]
            assert d["mode"] == "auto" and d["costs"]["host_read_gb_s"] is None and eng.experts.host_rows is None
        finally:
            eng.close()
    with pytest.raises(EngineError, match="cannot be emulated"):
        Engine.from_pack(pack, executor="grouped", device="cpu", resident=cfg.top_k, cache_contract="v2",
                         expert_placement="host-read", emulate_link_gb_s=5.0)


def test_the_host_read_rate_is_measured_on_distinct_experts_and_a_policy_changes_only_before_requests(packs,
                                                                                                      test_device):
    """measure_host_read_gb_s runs the executor over the host rows (plumbing on the CPU: a positive, finite rate);
    replace_policy refuses once a request was admitted."""
    from runmap.engine.engine import Engine
    from runmap.residency.cache import CacheConfigError

    pack, cfg = packs["tiny-olmoe"]
    eng = Engine.from_pack(pack, executor="grouped", device=test_device, resident=cfg.top_k, max_batch=1,
                           max_seq_len=48, cache_contract="v2", warm_up=False)  # v2: the mapping on a GPU
    try:
        calls = []
        moe = eng.experts.moe

        def spy(executor, x, ids, gw, storage, table, layout, **kw):
            calls.append((ids.tolist(), int(table.min()), kw["host_rows"].shape))
            return moe(executor, x, ids, gw, storage, table, layout, **kw)

        eng.experts.moe = spy
        rate = eng.experts.measure_host_read_gb_s(repeats=3)
        eng.experts.moe = moe
        assert np.isfinite(rate) and rate > 0 and len(calls) == 4
        timed = [tuple(ids[0]) for ids, _, _ in calls[1:]]
        assert len({e for t in timed for e in t}) == min(3 * cfg.top_k, cfg.num_experts)  # no expert read twice
        cache = eng.experts.cache
        assert all(lo == cache.rows_per_layer and shape[0] == cfg.num_experts for _, lo, shape in calls)  # all host
        cache.replace_policy("lfu-decay")
        assert cache.policy.name == "lfu-decay"
        eng.generate(["one request"], max_new_tokens=1)
        with pytest.raises(CacheConfigError, match="before the first request"):
            cache.replace_policy("lru")
    finally:
        eng.close()
