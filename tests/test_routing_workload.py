"""Routing workloads (runmap/workload): the calibrated model against its published hit rates, the replay
simulators, route traces, and the engine imposing and recording routes."""
import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from runmap.cli.main import main as cli
from runmap.engine.engine import Engine, EngineError
from runmap.engine.model import imposed_weights
from runmap.workload import calibration, replay
from runmap.workload.routing import RoutingError, parse_routing
from runmap.workload.trace import RouteTrace, TraceError, read_trace, write_trace
from test_model_support import build_packs


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return build_packs(tmp_path_factory)


# ---- the calibrated model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(calibration.PUBLISHED_LRU))
def test_calibrated_lru_curve_matches_published_points(family):
    """On seeds other than the fit's, every published point is met within the fit's tolerance."""
    f = calibration.family_params(family)
    pts = calibration.PUBLISHED_LRU[family]
    curve = calibration.lru_curve(f.params, f.num_experts, f.top_k, list(pts), layers=8, streams=2, seed=2)
    for c, v in pts.items():
        assert abs(curve[c] - v) <= calibration.TOLERANCE, f"{family} at {c}: {curve[c]:.3f} vs published {v}"


def test_calibrated_streams_route_distinct_valid_experts_and_are_seeded():
    f = calibration.family_params("olmoe")
    a = calibration.simulate(f.params, 64, 8, layers=2, tokens=50, streams=1, seed=5)
    b = calibration.simulate(f.params, 64, 8, layers=2, tokens=50, streams=1, seed=5)
    c = calibration.simulate(f.params, 64, 8, layers=2, tokens=50, streams=1, seed=6)
    assert a == b and a != c
    for steps in a:
        for s in steps:
            assert len(s) == 8 == len(set(s)) and all(0 <= e < 64 for e in s)
    assert len(a) == 2 and len(a[0]) == 50


def test_more_reuse_means_more_hits():
    base = calibration.RoutingParams(sigma=0.3, reuse=0.1, recall=0.1, window=8)
    more = calibration.RoutingParams(sigma=0.3, reuse=0.7, recall=0.1, window=8)
    lo = calibration.lru_curve(base, 64, 8, [16], layers=2, streams=1)[16]
    hi = calibration.lru_curve(more, 64, 8, [16], layers=2, streams=1)[16]
    assert hi > lo + 0.1


# ---- replay ------------------------------------------------------------------------------------------------

def test_replay_by_hand():
    steps = [[1, 2], [2, 3], [1, 4], [2, 3]]
    # LRU of 2: [1,2] miss miss; [2,3] hit, miss (evict 1); [1,4] miss miss; [2,3] miss miss
    assert replay.lru_hits(steps, 2) == (1, 8)
    # Belady of 3: [1,2] m m; [2,3] hit, miss -> {1,2,3}; [1,4] hit, miss 4, which must evict 2 or 3 (both
    # needed next, 1 and 4 being in use); [2,3] one hit, one miss: 3 hits. LRU of 3 is as good here: it evicts 2
    # at [1,4] (2 and 3 were last used together; the tie goes to the lower id) and hits 3 at the end.
    assert replay.belady_hits(steps, 3) == (3, 8)
    assert replay.lru_hits(steps, 3) == (3, 8)
    assert replay.lru_hits(steps, 4) == (4, 8)  # only cold misses: 4 distinct experts
    assert replay.lru_hits(steps, 4, warmup=2) == (3, 4)  # {1,2,3} warm: [1,4] hit miss, [2,3] hit hit


step_lists = st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(steps=step_lists, cap=st.integers(4, 12))
def test_belady_is_never_beaten(steps, cap):
    b, n = replay.belady_hits(steps, cap)
    for fn in (replay.lru_hits, replay.lfu_decay_hits):
        h, n2 = fn(steps, cap)
        assert n2 == n and h <= b
    distinct = len({e for s in steps for e in s})
    if cap >= 12:  # everything fits: only cold misses
        assert b == n - distinct == replay.lru_hits(steps, cap)[0]


# ---- traces -------------------------------------------------------------------------------------------------

def _trace(E=10, steps=(5, 3)):
    rng = np.random.default_rng(0)
    streams = [np.stack([np.stack([rng.permutation(E)[:2] for _ in range(3)]) for _ in range(n)]) for n in steps]
    return RouteTrace("olmoe", 3, E, 2, "model", streams, [2, 1])


@pytest.mark.parametrize("E", [10, 300])
def test_trace_round_trip(tmp_path, E):
    t = _trace(E)
    p = write_trace(tmp_path / "t.routes.json", t)
    r = read_trace(p)
    assert (r.num_layers, r.num_experts, r.top_k, r.prompt_tokens) == (3, E, 2, [2, 1])
    assert all(np.array_equal(a, b) for a, b in zip(r.streams, t.streams))


@pytest.mark.parametrize("corrupt, needle", [
    (lambda d: d["streams"][0].update(steps=9), "holds"),
    (lambda d: d.update(num_experts=3), "names expert"),
    (lambda d: d.update(schema="other"), "schema"),
    (lambda d: d["streams"][1].update(prompt_tokens=7), "prompt_tokens"),
])
def test_bad_trace_is_one_clear_error(tmp_path, corrupt, needle):
    d = _trace().to_dict()
    corrupt(d)
    p = tmp_path / "bad.routes.json"
    p.write_text(json.dumps(d))
    with pytest.raises(TraceError, match=needle) as e:
        read_trace(p)
    assert str(e.value).count(str(p)) == 1, str(e.value)  # the file named once


def test_routing_names():
    assert parse_routing("model").kind == "model"
    assert parse_routing("calibrated", default_family="olmoe").family == "olmoe"
    assert parse_routing("calibrated:mixtral").name == "calibrated:mixtral"
    assert parse_routing("trace:x.json").path == "x.json"
    for bad in ("", "calibrated:nope", "trace:", "modelx", "model:1"):
        with pytest.raises(RoutingError):
            parse_routing(bad)


# ---- the engine -----------------------------------------------------------------------------------------------

def test_imposed_weights_keep_the_routers_total():
    torch.manual_seed(0)
    h, r = torch.randn(5, 16).half(), torch.randn(12, 16)
    ids = torch.stack([torch.randperm(12)[:3] for _ in range(5)])
    for norm in (False, True):
        w = imposed_weights(h, r, ids, 3, norm)
        probs = torch.softmax(h.float() @ r.T, -1)
        own = torch.ones(5) if norm else torch.topk(probs, 3).values.sum(-1)
        assert torch.allclose(w.sum(-1), own, atol=1e-6)
        ratio = w / probs.gather(1, ids)  # proportional to the router's probabilities
        assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-qwen2-moe"])
def test_calibrated_routing_is_imposed_recorded_and_residency_invariant(packs, preset):
    prompts = [[5, 9, 1, 4, 7, 2], [8, 3]]
    kw = dict(executor="reference", device="cpu", max_batch=2, max_seq_len=32, routing="calibrated",
              routing_seed=4, record_routes=True)
    full = Engine.from_pack(packs[preset], **kw)
    E, k, L = full.cfg.num_experts, full.cfg.top_k, full.cfg.num_layers
    part = Engine.from_pack(packs[preset], resident=k, **kw)
    own = Engine.from_pack(packs[preset], executor="reference", device="cpu", max_batch=2, max_seq_len=32,
                           record_routes=True)
    outs = [e.generate(prompts, max_new_tokens=5) for e in (full, part, own)]
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]  # same draws, any residency
    tf, tp, to = full.routes.trace(), part.routes.trace(), own.routes.trace()
    assert tf.routing == f"calibrated:{full.cfg.arch}" and to.routing == "model"
    for a, b in zip(tf.streams, tp.streams):
        assert np.array_equal(a, b)
    # steps per stream: its real prompt tokens, then one per decode forward pass (4 after the first token)
    assert [s.shape for s in tf.streams] == [(6 + 4, L, k), (2 + 4, L, k)]
    assert tf.prompt_tokens == [6, 2]
    # the workload, not the router, chose them: the calibrated trace differs from the model's own routes
    assert any(not np.array_equal(np.sort(a, -1), np.sort(b, -1)) for a, b in zip(tf.streams, to.streams))
    # the same workload drawn again directly gives the same ids
    from runmap.workload.routing import ImposedRouting

    w = ImposedRouting(parse_routing("calibrated", default_family=full.cfg.arch), num_layers=L, num_experts=E,
                       top_k=k, seed=4)
    w.begin(2)
    real = np.array([[True] * 6, [False] * 4 + [True] * 2])
    first = w.draw(real)  # (L, 8, k): row 0's six prompt tokens, then row 1's two
    assert np.array_equal(first[:, :6].transpose(1, 0, 2), tf.streams[0][:6])
    assert np.array_equal(first[:, 6:].transpose(1, 0, 2), tf.streams[1][:2])
    # partial residency saw misses; the replay of what ran is reported
    rp = part.routes.replay_decode(part.resident)
    assert 0 < rp["lru"] <= rp["belady"] <= 1 and rp["decode_steps"] == 4


# ---- the workload's own prediction (next-layer prefetch under a routing workload) -----------------------------

@pytest.mark.parametrize("family", sorted(calibration.FAMILIES))
def test_the_calibrated_prediction_sees_only_the_past_and_beats_the_previous_token(family):
    """StreamSampler.predict draws nothing (the routes are the same with and without it), is a function of the stream
    before the step, and scores about as well as predicting the previous token's experts or better (over 399 steps
    of 8 layers, 0.98-1.05x of it on the seeds tried for every family: an approximation of the draw's odds)."""
    import copy

    f = calibration.family_params(family)
    pop = np.stack([calibration.popularity(f.params, f.num_experts, np.random.default_rng(50 + l)) for l in range(8)])
    a = calibration.StreamSampler(f.params, pop, f.top_k, np.random.default_rng(3))
    b = calibration.StreamSampler(f.params, pop, f.top_k, np.random.default_rng(3))
    ours = prev_only = 0.0
    prev = None
    for t in range(400):
        before = copy.deepcopy(a)
        pred = a.predict()
        assert pred.shape == (8, f.top_k) and all(len(set(r)) == f.top_k for r in pred.tolist())
        ids = a.next()
        assert np.array_equal(ids, b.next())  # predicting changed nothing that is drawn
        # a stream that drew something else at this step has the same prediction for it
        before.next()
        if t:
            ours += np.mean([len(set(p) & set(i)) for p, i in zip(pred.tolist(), ids.tolist())]) / f.top_k
            prev_only += np.mean([len(set(p) & set(i)) for p, i in zip(prev.tolist(), ids.tolist())]) / f.top_k
        prev = ids
    assert ours >= 0.97 * prev_only and ours / 399 > f.params.reuse


def test_the_imposed_prediction_is_made_before_each_draw_and_changes_no_route(tmp_path):
    from runmap.workload.routing import ImposedRouting

    spec = parse_routing("calibrated:olmoe")
    w, plain = (ImposedRouting(spec, num_layers=4, num_experts=64, top_k=8, seed=9) for _ in range(2))
    w.predicting = True
    real = np.array([[True] * 3, [False, True, True]])
    for ww in (w, plain):
        ww.begin(2)
    for step in range(4):
        r = real if step == 0 else np.ones((2, 1), dtype=bool)
        expect = [s.predict() for s in w._streams]  # each stream's prediction before this pass
        ids = w.draw(r)
        assert np.array_equal(ids, plain.draw(r)) and w.prediction.shape == ids.shape
        # every position of a row gets its stream's prediction from before the pass: in a prompt pass no position's
        # routing is known to the predictor (row 0's three positions, then row 1's two)
        rows = [0, 0, 0, 1, 1] if step == 0 else [0, 1]
        for n, b in enumerate(rows):
            assert np.array_equal(w.prediction[:, n], expect[b])
    # a trace predicts each stream's previous step, nothing at its first
    trace = RouteTrace(arch="olmoe", num_layers=2, num_experts=8, top_k=2, routing="calibrated:olmoe",
                       pack_identity=None, prompt_tokens=[0],
                       streams=[np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 2], [3, 4]]])])
    path = write_trace(tmp_path / "t.routes.json", trace)
    t = ImposedRouting(parse_routing(f"trace:{path}"), num_layers=2, num_experts=8, top_k=2)
    t.predicting = True
    t.begin(1)
    t.draw(np.ones((1, 2), dtype=bool))
    assert (t.prediction == -1).all()  # both positions of the first pass: the stream has no past yet
    t.draw(np.ones((1, 1), dtype=bool))
    assert np.array_equal(t.prediction[:, 0], [[4, 5], [6, 7]])  # the step before, never the one drawn


@pytest.mark.parametrize("preset, batch", [("tiny-olmoe", 1), ("tiny-qwen2-moe", 2)])
def test_prefetch_under_a_calibrated_workload_changes_no_route_and_no_logit(packs, preset, batch):
    """Prefetch on under calibrated routing: the workload's own prediction moves experts (some prefetches are used),
    the routes are the ones drawn without prefetch, and the tokens equal full residency's. The segment chain runs
    eagerly on the CPU (batch 2 of tiny-qwen2-moe: the grouped chain)."""
    prompts = [[5, 9, 1, 4, 7, 2], [8, 3, 6]][:batch]
    kw = dict(executor="reference", device="cpu", max_batch=batch, max_seq_len=40, routing="calibrated",
              routing_seed=2, record_routes=True)
    full = Engine.from_pack(packs[preset], **kw)
    k = full.cfg.top_k
    runs = {}
    for prefetch in (False, True):
        eng = Engine.from_pack(packs[preset], resident=k + 1, prefetch=prefetch, segments="eager", **kw)
        runs[prefetch] = ([r.token_ids for r in eng.generate(prompts, max_new_tokens=12, ignore_eos=True)],
                          eng.routes.trace(), eng.experts.cache.counters)
        assert eng.imposed.predicting == prefetch
    want = [r.token_ids for r in full.generate(prompts, max_new_tokens=12, ignore_eos=True)]
    assert runs[True][0] == runs[False][0] == want
    for a, b in zip(runs[True][1].streams, runs[False][1].streams):
        assert np.array_equal(a, b)
    on = runs[True][2]
    assert on["prefetches"] > 0 and on["prefetch_used"] > 0 and runs[False][2]["prefetches"] == 0
    # a chain built while the workload is set aside (warm_up) has no prediction to move: no prediction buffer, so no
    # prefetch of whatever an unwritten buffer holds
    from runmap.engine.engine import SegmentDecoder

    saved, eng.imposed = eng.imposed, None
    assert SegmentDecoder(eng, batch, None, capture=False).host_pred is None
    eng.imposed = saved
    assert SegmentDecoder(eng, batch, None, capture=False).host_pred is not None


def test_trace_routing_replays_a_trace(packs, tmp_path):
    kw = dict(executor="reference", device="cpu", max_batch=1, max_seq_len=32, record_routes=True)
    a = Engine.from_pack(packs["tiny-olmoe"], routing="calibrated", **kw)
    a.generate([[5, 9, 1, 4]], max_new_tokens=4)
    p = write_trace(tmp_path / "a.routes.json", a.routes.trace())
    b = Engine.from_pack(packs["tiny-olmoe"], routing=f"trace:{p}", resident=4, **kw)
    b.generate([[5, 9, 1, 4]], max_new_tokens=4)
    assert np.array_equal(b.routes.trace().streams[0], a.routes.trace().streams[0])
    with pytest.raises(EngineError, match="trace of"):
        Engine.from_pack(packs["tiny-qwen2-moe"], routing=f"trace:{p}", **kw)


def test_cli_trace_then_replay(packs, tmp_path, capsys):
    tr, js = tmp_path / "g.routes.json", tmp_path / "replay.json"
    rc = cli(["generate", "--packed", str(packs["tiny-olmoe"]), "--prompt", "hello", "--max-new-tokens", "4",
              "--executor", "reference", "--device", "cpu", "--routing", "calibrated", "--resident", "4",
              "--trace", str(tr)])
    assert rc == 0 and read_trace(tr).routing == "calibrated:olmoe"
    assert cli(["replay", str(tr), "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert [r["resident"] for r in rows] == [4, 8]
    assert all(r["lru"] <= r["belady"] for r in rows)
    assert cli(["replay", str(tr), "--resident", "2"]) == 2  # below top_k
    assert cli(["replay", str(tmp_path / "missing.json")]) == 1
    with pytest.raises(SystemExit) as e:
        cli(["generate", "--packed", "x", "--prompt", "y", "--routing", "calibrated:nope"])
    assert e.value.code == 2


# ---- the bench --------------------------------------------------------------------------------------------------

def test_bench_records_name_their_routing_and_replay_what_ran(packs, tmp_path):
    from runmap.bench import campaign as bench
    from runmap.conformance.schemas import validate_document

    spec = {"name": "rt", "description": "routing", "device": "cpu",
            "defaults": {"repeats": 1, "warmup": 0, "routing": "calibrated"},
            "models": {"m": {"preset": "tiny-olmoe", "pack": str(packs["tiny-olmoe"])}},
            "groups": [{"name": "r", "kind": "engine", "models": ["m"], "resident": [4, "full"],
                        "executors": ["reference"], "batch": [2], "prompt_len": 4, "decode_len": 4}]}
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=False, command="pytest")
    assert not summary["failed"], summary["failed"]
    recs = {r["regime"]: r for r in bench.load_records(tmp_path / "rt")}
    for r in recs.values():
        assert validate_document({k: v for k, v in r.items() if k != "_path"}, "bench-record.schema.json") == []
        assert r["config"]["routing"] == "calibrated:olmoe" and r["routing"]["workload"] == "calibrated:olmoe"
        assert r["id"].endswith("__routing-calibrated-olmoe")
        assert r["record_version"] == "bench-record-v2"  # the marker of the decode-only per-token figures below
    part, full = recs["partial"]["routing"], recs["full"]["routing"]
    assert full["replay_lru_hit_rate"]["status"] == "UNSUPPORTED"
    assert part["replay_decode_steps"] == 3  # decode_len 4: three decode forward passes
    lru, bel = part["replay_lru_hit_rate"]["value"], part["replay_belady_hit_rate"]["value"]
    assert 0 < lru <= bel <= 1
    assert part["misses_per_token"]["value"] > 0
    # decode figures are the decode steps' alone: the prompt's misses (a cold cache) are counted apart
    cs, h2d = recs["partial"]["cache_stats"], recs["partial"]["h2d"]
    # one timed repeat; the decode steps made every token but each row's first (the prefill's)
    gen = recs["partial"]["timing"]["new_tokens"] - recs["partial"]["config"]["batch"]
    prefill_misses = cs["misses"]["value"] - cs["decode_misses"]["value"]
    assert prefill_misses > 0 and cs["decode_misses"]["value"] > 0
    assert part["misses_per_token"]["value"] == pytest.approx(cs["decode_misses"]["value"] / gen)
    assert cs["decode_hit_rate"]["value"] == pytest.approx(
        cs["decode_hits"]["value"] / (cs["decode_hits"]["value"] + cs["decode_misses"]["value"]))
    row = h2d["bytes"]["value"] // cs["misses"]["value"]  # every miss moves one row
    assert h2d["prefill_bytes"]["value"] == prefill_misses * row
    assert h2d["bytes_per_token"]["value"] * gen == pytest.approx(cs["decode_misses"]["value"] * row)
    # on the CPU there is no H2D link: the transfer bound says why it is unknown
    assert recs["partial"]["timing"]["transfer_bound_tok_s"]["status"] == "UNKNOWN"


def test_transfer_bound_formula():
    from runmap.bench import campaign as bench

    def rec(regime, tok_s, per_tok=None, link=None, routing="calibrated:olmoe"):
        obs = lambda v: {"status": "OBSERVED", "value": v}  # noqa: E731
        return {"run_id": "x", "kind": "engine", "regime": regime, "executor": "grouped",
                "config": {"model": "m", "batch": 1, "prompt_len": 4, "decode_len": 8, "routing": routing,
                           "skip_experts": False},
                "timing": {"decode_tok_s": {"median": tok_s}},
                "h2d": {"bytes_per_token": obs(per_tok) if per_tok is not None else {"status": "UNKNOWN"},
                        "link_gb_s": obs(link) if link else {"status": "UNSUPPORTED"}}, "ratios": {}}

    full, part, other = rec("full", 1000.0), rec("partial", 100.0, 50e6, 50.0), rec("partial", 10.0, 1e6, 50.0, "model")
    bench.attach_transfer_bounds([full, part, other])
    # 1 / (1 ms + 50 MB / 50 GB/s = 1 ms) = 500 tok/s; measured 100 -> 0.2 of it
    assert part["timing"]["transfer_bound_tok_s"]["value"] == pytest.approx(500.0)
    assert part["ratios"]["decode_vs_transfer_bound"]["value"] == pytest.approx(0.2)
    assert other["timing"]["transfer_bound_tok_s"]["status"] == "UNKNOWN"  # no full-residency twin with its routing


def test_an_ab_of_fused_ops_bounds_each_side_by_its_own_full_step():
    """Two full-residency records of one run differing only in config.fused: each partial record takes the full step
    of its own fused ops, whichever order the records come in."""
    from runmap.bench import campaign as bench

    obs = lambda v: {"status": "OBSERVED", "value": v}  # noqa: E731

    def rec(regime, tok_s, fused, per_tok=None):
        return {"run_id": "x", "kind": "engine", "regime": regime, "executor": "grouped",
                "config": {"model": "m", "batch": 1, "prompt_len": 4, "decode_len": 8, "routing": "calibrated:olmoe",
                           "skip_experts": False, "fused": fused},
                "timing": {"decode_tok_s": {"median": tok_s}},
                "h2d": {"bytes_per_token": obs(per_tok) if per_tok else {"status": "UNKNOWN"},
                        "link_gb_s": obs(50.0)}, "ratios": {}}

    without_imposed, with_imposed = ["attn", "norm", "router"], ["router", "norm", "imposed", "attn"]
    for order in (0, 1):
        fulls = [rec("full", 1000.0, without_imposed), rec("full", 500.0, list(reversed(with_imposed)))]
        a, b = rec("partial", 100.0, without_imposed, 50e6), rec("partial", 100.0, with_imposed, 50e6)
        bench.attach_transfer_bounds((fulls if order else fulls[::-1]) + [a, b])
        assert a["timing"]["transfer_bound_tok_s"]["value"] == pytest.approx(1 / 2e-3)  # 1 ms + 1 ms
        assert b["timing"]["transfer_bound_tok_s"]["value"] == pytest.approx(1 / 3e-3)  # 2 ms + 1 ms


def test_an_emulated_link_bounds_with_its_own_rate():
    """config.emulate_link_gb_s below the measured link: the bound uses the emulated rate and says so; above it,
    the measured link still bounds (an emulation never makes the link faster)."""
    from runmap.bench import campaign as bench

    def rec(regime, tok_s, emulate=None):
        obs = lambda v: {"status": "OBSERVED", "value": v}  # noqa: E731
        return {"run_id": "x", "kind": "engine", "regime": regime, "executor": "grouped",
                "config": {"model": "m", "batch": 1, "prompt_len": 4, "decode_len": 8, "routing": "calibrated:olmoe",
                           "skip_experts": False, "emulate_link_gb_s": emulate},
                "timing": {"decode_tok_s": {"median": tok_s}},
                "h2d": {"bytes_per_token": obs(10e6), "link_gb_s": obs(50.0)}, "ratios": {}}

    full, slow, fast = rec("full", 1000.0), rec("partial", 100.0, 10.0), rec("partial", 100.0, 80.0)
    bench.attach_transfer_bounds([full, slow, fast])
    # 1 / (1 ms + 10 MB / 10 GB/s = 1 ms) = 500 tok/s
    b = slow["timing"]["transfer_bound_tok_s"]
    assert b["value"] == pytest.approx(500.0) and b["source"].startswith("EMULATED link: 10 GB/s")
    # 1 / (1 ms + 10 MB / 50 GB/s = 0.2 ms): the measured link
    f = fast["timing"]["transfer_bound_tok_s"]
    assert f["value"] == pytest.approx(1 / 1.2e-3) and "source" not in f


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), decode_steps=st.integers(0, 4),
       extra=st.integers(0, 2), family=st.sampled_from(sorted(calibration.FAMILIES)))
def test_routes_drawn_ahead_are_the_routes_drawn_live(lengths, decode_steps, extra, family):
    """ImposedRouting.draw_ahead (a generate group's prompt and decode tokens, before the timed region): the passes
    then get exactly the ids a workload drawing live gives them, prefill (left-padded rows) and decode steps alike,
    and a pass past the drawn steps continues the same streams; a row count other than begin()'s is refused, and
    while predicting nothing is drawn ahead (a prediction reads the stream's state at its pass)."""
    from runmap.workload.routing import ImposedRouting, RoutingError, parse_routing

    spec = parse_routing(f"calibrated:{family}", default_family=family)
    live, ahead = (ImposedRouting(spec, num_layers=3, num_experts=16, top_k=2, seed=5) for _ in range(2))
    B, P = len(lengths), max(lengths)
    for r in (live, ahead):
        r.begin(B)
    ahead.draw_ahead([n + decode_steps for n in lengths])
    real = np.zeros((B, P), dtype=bool)
    for b, n in enumerate(lengths):
        real[b, P - n:] = True  # left padding, as generate_batch pads
    passes = [real] + [np.ones((B, 1), dtype=bool)] * (decode_steps + extra)
    for mask in passes:
        np.testing.assert_array_equal(ahead.draw(mask), live.draw(mask))
    with pytest.raises(RoutingError, match="rows"):
        ahead.draw_ahead([1] * (B + 1))
    pred = ImposedRouting(spec, num_layers=3, num_experts=16, top_k=2, seed=5)
    pred.predicting = True
    pred.begin(B)
    pred.draw_ahead([4] * B)
    assert all(len(q) == 0 for q in pred._ahead)
