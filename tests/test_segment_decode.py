"""Partial-residency decode as a chain of segments cut at each routing decision (runmap/engine/engine.py
SegmentDecoder). On the CPU the chain runs without graphs (segments="eager"); it must compute exactly what the
per-call path computes, lease for lease; on CUDA (RUNMAP_TEST_DEVICE=cuda) the captured chain must too."""
import numpy as np
import pytest
import torch

from runmap.engine.engine import Engine
from test_model_support import build_packs


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return build_packs(tmp_path_factory)


@pytest.mark.parametrize("preset, routing", [("tiny-olmoe", "calibrated"), ("tiny-qwen2-moe", "model")])
def test_segment_chain_equals_the_per_call_path(packs, preset, routing, test_device):
    seg_mode = True if test_device == "cuda" else "eager"  # the CPU runs the chain without graphs
    executor = "grouped" if test_device == "cuda" else "reference"  # the interpreter is slow; the chain is the same
    # max_group = max(k, min(k*B, resident // 2)) = k: batch 1 takes the chain with one lease per layer (batch 2 the
    # grouped chain, whose leases differ from the per-call path's token groups: the tests below)
    resident = 6 if preset == "tiny-olmoe" else 4  # of 8 (top-4) / of 6 (top-2)
    runs = {}
    for segments in (False, seg_mode):
        eng = Engine.from_pack(packs[preset], executor=executor, device=test_device, resident=resident, max_batch=2,
                               max_seq_len=48, routing=routing, record_routes=True, segments=segments)
        assert eng.use_segments == bool(segments)
        out = [[r.token_ids for r in eng.generate([[5, 9, 1, 4, 7]], max_new_tokens=6)]]
        st = eng.stats()
        runs[bool(segments)] = (out, st.hits, st.misses, eng.routes.trace())
        if segments:
            assert not eng._segments[1].grouped and eng.decode_paths["chain"] == 5
    (a, ha, ma, ta), (b, hb, mb, tb) = runs[False], runs[True]
    assert a == b and ma == mb
    # the same lookups; on CUDA the warm-up before a capture runs the chain twice more (hits, never new misses)
    assert hb == ha if test_device != "cuda" else hb >= ha
    for x, y in zip(ta.streams, tb.streams):
        assert np.array_equal(x, y)


def _teacher_forced(eng, prompts, teacher):
    """float32 (steps, B, V): the logits of each decode step of ``prompts`` (left-padded) fed ``teacher``'s tokens."""
    dev, B = eng.device, len(prompts)
    P = max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)
    tokens = torch.tensor([[eng.pad_id] * (P - len(p)) + p for p in prompts], device=dev)
    steps = []
    with torch.inference_mode():
        eng._begin_group(prompts)
        eng.experts.begin()
        try:
            eng.prefill(tokens, pad)
            for s, row in enumerate(zip(*teacher)):
                steps.append(eng.decode(torch.tensor(row, device=dev), P + s, pad).float().cpu().clone())
        finally:
            eng.experts.end()
    return torch.stack(steps)


def test_teacher_forced_logits_of_the_chain_equal_full_residency(packs, test_device):
    """Item 7: partial residency through the segment chain gives full residency's logits at every step."""
    seg_mode = True if test_device == "cuda" else "eager"
    executor = "grouped" if test_device == "cuda" else "reference"
    prompt, teacher = [5, 9, 1, 4, 7, 2], [3, 8, 8, 1, 6, 2, 9, 4]
    logits = {}
    for resident in (None, 4):
        eng = Engine.from_pack(packs["tiny-olmoe"], executor=executor, device=test_device, resident=resident,
                               max_batch=1, max_seq_len=48, segments=seg_mode)
        logits[resident] = _teacher_forced(eng, [prompt], [teacher])  # (steps, 1, V)
        if resident is not None:
            assert 1 in eng._segments and eng.stats().misses > 0
    full, part = logits[None], logits[4]
    assert torch.allclose(full, part, atol=1e-3 * full.abs().max().item(), rtol=0), (full - part).abs().max()


@pytest.mark.parametrize("preset, resident, prefetch", [("tiny-olmoe", 4, False), ("tiny-olmoe", 5, True),
                                                        ("tiny-olmoe", 6, False), ("tiny-qwen2-moe", 4, False),
                                                        ("tiny-qwen2-moe", 3, True)])
def test_a_batch_past_one_lease_runs_the_grouped_chain_with_full_residencys_logits(packs, test_device, preset,
                                                                                   resident, prefetch, monkeypatch):
    """A batch whose union may exceed one lease (top_k x B > max_group) decodes through the grouped chain: each layer's
    union in groups of at most max_group experts, resident ones first, each group leased and released in turn. Every
    routed pair is computed exactly once, so the teacher-forced logits equal full residency's at every step."""
    from runmap.engine.engine import SegmentDecoder

    seg_mode = True if test_device == "cuda" else "eager"
    executor = "grouped" if test_device == "cuda" else "reference"
    prompts = [[5, 9, 1, 4, 7, 2], [8, 3, 2], [6, 6, 1, 9]]
    teacher = [[3, 8, 8, 1, 6, 2, 9, 4], [1, 2, 3, 4, 5, 6, 7, 1], [9, 9, 2, 5, 3, 8, 1, 6]]
    seen, real = [], SegmentDecoder._expert_groups

    def groups(self, layer):
        out, cpu = real(self, layer)
        assert cpu == ()  # no CPU site here
        mapped = set(self.e.experts.cache.mapping(layer))
        assert [m for _, m in out] == [any(e not in mapped for e in g) for g, _ in out]
        seen.append((layer, [g for g, _ in out], np.unique(self.host_ids_np[layer]).tolist(), mapped))
        # the all-hit groups (first) share one request, each group that misses has its own
        requests.append(sum(m for _, m in out) + (not out[0][1]))
        return out, cpu
    run_groups, requests, admitted = SegmentDecoder._run_groups, [], []

    def counted(self, layer):
        before = self.e.experts.cache.counters["requests_admitted"]
        run_groups(self, layer)
        admitted.append(self.e.experts.cache.counters["requests_admitted"] - before)
    monkeypatch.setattr(SegmentDecoder, "_expert_groups", groups)
    monkeypatch.setattr(SegmentDecoder, "_run_groups", counted)
    full = _teacher_forced(Engine.from_pack(packs[preset], executor=executor, device=test_device, max_batch=3,
                                            max_seq_len=48), prompts, teacher)
    eng = Engine.from_pack(packs[preset], executor=executor, device=test_device, resident=resident, max_batch=3,
                           max_seq_len=48, segments=seg_mode, prefetch=prefetch)
    cache = eng.experts.cache
    assert eng.cfg.top_k * 3 > cache.max_group
    part = _teacher_forced(eng, prompts, teacher)
    assert eng.decode_paths["chain_groups"] == len(teacher[0]) and eng.decode_paths["per_call"] == 0
    assert torch.allclose(full, part, atol=1e-3 * full.abs().max().item(), rtol=0), (full - part).abs().max()
    assert eng.stats().misses > 0 and any(len(g) > 1 for _, g, _, _ in seen)  # some layer call ran several groups
    for layer, gs, union, mapped in seen:
        assert sorted(e for g in gs for e in g) == union  # each routed expert in exactly one group
        assert all(1 <= len(g) <= cache.max_group for g in gs)
        order = [e for g in gs for e in g]
        hits = [e in mapped for e in order]
        assert hits == sorted(hits, reverse=True)  # the experts resident at the decision come first
    assert admitted == requests and max(requests) > 1
    # no request outlives its layer call: nothing stays admitted or leased
    assert cache.counters["requests_released"] == cache.counters["requests_admitted"]
    assert not cache._requests and all(not sum(c.values()) for c in cache._leased)
    chain = eng._segments[3]
    assert chain.grouped and chain.groups_run == len(seen) + sum(len(g) - 1 for _, g, _, _ in seen)


def test_the_chain_holds_one_request_per_step_and_gives_every_one_back(packs, test_device, monkeypatch):
    # one admission and one release per decode step (not per layer): the lease/release cost of a step is paid once
    from runmap.engine.engine import SegmentDecoder

    seg_mode = True if test_device == "cuda" else "eager"
    executor = "grouped" if test_device == "cuda" else "reference"
    eng = Engine.from_pack(packs["tiny-olmoe"], executor=executor, device=test_device, resident=6, max_batch=1,
                           max_seq_len=48, routing="calibrated", segments=seg_mode)
    cache = eng.experts.cache
    per_step, run = [], SegmentDecoder.run

    def counted(self, *a, **k):
        before = (cache.counters["requests_admitted"], cache.counters["requests_released"])
        out = run(self, *a, **k)
        per_step.append((cache.counters["requests_admitted"] - before[0],
                         cache.counters["requests_released"] - before[1]))
        return out

    eng.generate([[5, 9, 1, 4, 7]], max_new_tokens=7, ignore_eos=True)  # on CUDA: captures (warm-up chains) first
    monkeypatch.setattr(SegmentDecoder, "run", counted)
    eng.generate([[5, 9, 1, 4, 7]], max_new_tokens=7, ignore_eos=True)
    assert per_step == [(1, 1)] * 6  # six decode steps after the prefill's token, each one request in and out
    assert cache.counters["requests_released"] == cache.counters["requests_admitted"]
    assert not cache._requests and all(not sum(c.values()) for c in cache._leased)
    # each static table holds exactly the row table of the current generation's layer
    for layer in range(eng.cfg.num_layers):
        assert torch.equal(eng.experts.static_tables[layer].cpu(), cache._current.tables[layer].cpu())


@pytest.mark.parametrize("batch", [1, 2])
def test_a_failure_between_segments_leaves_no_lease_and_the_next_run_is_unchanged(packs, test_device, monkeypatch,
                                                                                   batch):
    # a miss transaction that fails in the middle of a step (after earlier layers of the step were leased): the
    # step's one request is released, nothing stays leased, and a later run computes what a fresh engine computes.
    # Batch 2 runs the grouped chain (top_k x 2 > max_group): the failing group's request is released as well.
    from runmap.residency.cache import ExpertCache, TransactionAborted

    seg_mode = True if test_device == "cuda" else "eager"
    executor = "grouped" if test_device == "cuda" else "reference"
    # the model's own routing: deterministic, so "unchanged" can be compared (a calibrated stream advances per run);
    # 4 of 8 resident, so that decode steps miss past layer 0
    kw = dict(executor=executor, device=test_device, resident=4, max_batch=batch, max_seq_len=48, routing="model",
              segments=seg_mode)
    prompt = [[5, 9, 1, 4, 7], [2, 7, 7, 3, 1]][:batch]
    fresh = Engine.from_pack(packs["tiny-olmoe"], **kw)
    want = [r.token_ids for r in fresh.generate(prompt, max_new_tokens=6, ignore_eos=True)]
    eng = Engine.from_pack(packs["tiny-olmoe"], **kw)
    eng.generate(prompt, max_new_tokens=6, ignore_eos=True)  # warm (on CUDA: captured)
    cache = eng.experts.cache
    from runmap.engine.engine import SegmentDecoder

    real, calls, in_chain, run = ExpertCache._transaction, [], [], SegmentDecoder.run

    def chain_step(self, *a, **k):  # a decode step of the segment chain (not the per-call prefill)
        in_chain.append(True)
        try:
            return run(self, *a, **k)
        finally:
            in_chain.pop()

    def failing(self, layer, *a, **k):
        if in_chain and layer > 0:  # not a step's first layer: its request already holds earlier layers' leases
            calls.append(layer)
            raise RuntimeError("injected copy failure")
        return real(self, layer, *a, **k)

    monkeypatch.setattr(SegmentDecoder, "run", chain_step)
    monkeypatch.setattr(ExpertCache, "_transaction", failing)
    with pytest.raises((TransactionAborted, RuntimeError)):
        eng.generate([[8, 3, 2, 6], [1, 5, 9, 9]][:batch], max_new_tokens=12, ignore_eos=True)
    assert eng._segments[batch].grouped == (batch == 2)
    assert calls and not cache._requests and all(not sum(c.values()) for c in cache._leased)
    assert cache.counters["requests_released"] == cache.counters["requests_admitted"]
    monkeypatch.setattr(ExpertCache, "_transaction", real)
    # an abort before publication leaves the cache serving (not FAULTED), on the generation it had
    again = Engine.from_pack(packs["tiny-olmoe"], **kw)
    if batch == 1:
        assert [r.token_ids for r in eng.generate(prompt, max_new_tokens=6, ignore_eos=True)] == want == \
            [r.token_ids for r in again.generate(prompt, max_new_tokens=6, ignore_eos=True)]
    else:  # the grouped chain's groups follow the cache's state, which differs: the same logits up to the sums' order
        teacher = [[3, 8, 8, 1, 6], [1, 2, 3, 4, 5]]
        after, fresh_logits = _teacher_forced(eng, prompt, teacher), _teacher_forced(again, prompt, teacher)
        assert torch.allclose(after, fresh_logits, atol=1e-3 * fresh_logits.abs().max().item(), rtol=0)


def test_the_chain_times_its_miss_transactions_like_the_per_call_path(packs, test_device):
    """h2d_seconds (the denominator of a record's h2d.gb_s) grows with every miss transaction of a decode step
    run as a chain: before, only the per-call path timed its acquisitions while the cache counted the chain's
    bytes too, so bytes / seconds came out above the link's rate."""
    seg_mode = True if test_device == "cuda" else "eager"
    executor = "grouped" if test_device == "cuda" else "reference"
    eng = Engine.from_pack(packs["tiny-olmoe"], executor=executor, device=test_device, resident=4, max_batch=1,
                           max_seq_len=48, segments=seg_mode, routing="calibrated")
    dev = eng.device
    pad = torch.zeros(1, dtype=torch.long, device=dev)
    grew = 0
    with torch.inference_mode():
        eng._begin_group([[5, 9, 1, 4, 7]])  # one stream of the calibrated workload, as generate opens it
        eng.experts.begin()
        try:
            eng.prefill(torch.tensor([[5, 9, 1, 4, 7]], device=dev), pad)
            for s in range(12):
                misses, secs = eng.experts.cache.counters["misses"], eng.experts.h2d_seconds
                eng.decode(torch.tensor([3 + s], device=dev), 5 + s, pad)
                if eng.experts.cache.counters["misses"] > misses:
                    assert eng.experts.h2d_seconds > secs
                    grew += 1
                else:
                    assert eng.experts.h2d_seconds == secs
        finally:
            eng.experts.end()
    assert 1 in eng._segments and grew > 0  # the chain ran, and some of its steps missed


def test_a_failure_inside_a_capture_ends_the_capture(monkeypatch):
    """An error raised while a segment chain is being captured (an out-of-memory error under --gpu-budget's cap) must
    end the open capture before it propagates: a stream left capturing fails every later synchronize, the engine's
    close() included. Driven on the CPU with a stand-in for torch.cuda's stream and graph calls."""
    from runmap.engine import engine as engine_mod

    state = {"capturing": False, "ended": 0}

    class Graph:
        def capture_begin(self, pool=None):
            state["capturing"] = True

        def capture_end(self):
            state["ended"] += 1
            state["capturing"] = False
            raise RuntimeError("capture invalidated")  # what ending an invalidated capture raises

    class Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

    class Ctx:
        def __init__(self, s):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])

    dec = engine_mod.SegmentDecoder.__new__(engine_mod.SegmentDecoder)
    dec.e = type("E", (), {"device": torch.device("cpu")})()
    dec.pool, dec.capture_graphs, dec.grouped, dec.two_site = None, None, False, False
    dec._run_eager = lambda n_keys: None

    def oom(n_keys):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
    dec._forward = oom
    with pytest.raises(torch.OutOfMemoryError, match="stand-in"):
        dec._capture(8)
    assert state == {"capturing": False, "ended": 1}  # ended once, its own error swallowed, the OOM propagated
    assert dec.capture_graphs is None
