"""The engine on packed tiny synthetic checkpoints (runmap synth + runmap pack, built once per session).

* reference executor == transformers' own model (FP32, dequantized experts, FP16-rounded non-routed
  weights): prefill logits, 32 decode steps through the KV cache, top-k ids of every layer;
* each Triton executor == the reference executor within the kernel tolerance (short prompts: interpreter);
* full and partial residency give the same tokens; telemetry reports the regime, hits and misses.
"""
import json

import pytest
import torch

from runmap.arch.config import load_preset
from runmap.engine.engine import Engine, EngineError
from runmap.format.packfile import PackReader
from test_model import assert_same_routes, close
from test_model_support import RouteRecorder, build_packs, hf_reference

PRESETS = ["tiny-olmoe", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral"]


@pytest.fixture(scope="session")
def packs(tmp_path_factory):
    return build_packs(tmp_path_factory)


def run_steps(eng, prompt, n_decode, teacher=None):
    """Prefill (all positions) then n_decode greedy steps (or the ``teacher`` tokens).
    Returns (list of float32 logits: (T, V) then (V,) per step, tokens fed, route log per forward)."""
    eng.model.route_log = []
    logs, outs, fed = [], [], []
    dev = eng.device
    pad = torch.zeros(1, dtype=torch.long, device=dev)
    with torch.inference_mode():
        eng.experts.begin()
        try:
            out = eng.prefill(torch.tensor([prompt], device=dev), pad, all_logits=True)[0]
            outs.append(out.cpu())
            logs.append(eng.model.route_log)
            tok = out[-1].argmax()
            for s in range(n_decode):
                if teacher is not None:
                    tok = torch.tensor(teacher[s], device=dev)
                fed.append(int(tok))
                eng.model.route_log = []
                out = eng.decode(tok.view(1), len(prompt) + s, pad)[0]
                outs.append(out.cpu())
                logs.append(eng.model.route_log)
                tok = out.argmax()
        finally:
            eng.experts.end()
            eng.model.route_log = None
    return outs, fed, logs


@pytest.mark.parametrize("preset", PRESETS)
def test_reference_executor_matches_transformers(packs, preset):
    eng = Engine.from_pack(packs[preset], executor="reference", device="cpu", max_batch=1, max_seq_len=64)
    prompt = [7, 100, 33, 250, 9, 12, 480, 77, 301, 5, 64]
    outs, fed, logs = run_steps(eng, prompt, 32)
    with PackReader(packs[preset]) as r:
        ref = hf_reference(r.config, r.nonrouted, r.read_expert_rows, r.layout)
    rec = RouteRecorder(ref)
    with torch.no_grad():
        o = ref(input_ids=torch.tensor([prompt]), use_cache=True)
        close(outs[0], o.logits[0], f"{preset} prefill")
        assert_same_routes(logs[0], rec.take(), f"{preset} prefill")
        past = o.past_key_values
        for s, tok in enumerate(fed):
            o = ref(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            close(outs[s + 1], o.logits[0, -1], f"{preset} decode step {s}")
            assert_same_routes(logs[s + 1], rec.take(), f"{preset} decode step {s}")


TRITON_PROMPT = [11, 250, 3]


@pytest.fixture(scope="session")
def reference_runs(packs):
    """Per preset: the reference executor's logits, fed tokens and routes for TRITON_PROMPT + 2 steps."""
    return {p: run_steps(Engine.from_pack(packs[p], executor="reference", device="cpu", max_batch=1,
                                          max_seq_len=16), TRITON_PROMPT, 2) for p in PRESETS}


@pytest.mark.parametrize("executor", ["scalar", "grouped", "topk-fused"])
@pytest.mark.parametrize("preset", PRESETS)
def test_triton_executors_match_reference(packs, reference_runs, preset, executor, test_device):
    """Each Triton executor on the test device (the interpreter in CI; compiled kernels and fused ops with
    RUNMAP_TEST_DEVICE=cuda) against the reference executor on the CPU, teacher-forced on the reference's tokens. On
    CUDA the decode steps run eagerly: a replayed graph keeps no per-layer route log to compare (graph steps are
    compared with eager ones in test_chained_launches_change_no_token and tests/test_segment_decode.py)."""
    prompt = TRITON_PROMPT
    ref_outs, fed, ref_logs = reference_runs[preset]
    eager = {"cuda_graphs": False, "segments": False} if test_device == "cuda" else {}
    eng = Engine.from_pack(packs[preset], executor=executor, device=test_device, max_batch=1, max_seq_len=16, **eager)
    outs, _, logs = run_steps(eng, prompt, 2, teacher=fed)
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        # kernel tolerance: fp16 intermediate rounding of the W4A16 paths vs the FP32 reference
        err, bound = (a - b).abs().max().item(), 1e-2 * b.abs().max().item() + 2e-3
        assert err <= bound, f"{preset} {executor} forward {i}: max |diff| {err:.3g} > {bound:.3g}"
    for la, lb in zip(logs, ref_logs):
        assert_same_routes(la, lb, f"{preset} {executor}")


@pytest.mark.parametrize("preset", PRESETS)
def test_partial_residency_gives_the_same_tokens_and_reports_misses(packs, preset, tmp_path):
    cfg, _ = load_preset(preset)
    prompts = ["the cat sat on", "a b"]
    full = Engine.from_pack(packs[preset], executor="reference", device="cpu", max_batch=2, max_seq_len=64)
    part = Engine.from_pack(packs[preset], executor="reference", device="cpu", max_batch=2, max_seq_len=64,
                            resident=cfg.top_k)
    a = full.generate(prompts, max_new_tokens=6, ignore_eos=True)
    b = part.generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    tf, tp = full.telemetry(), part.telemetry()
    assert tf["regime"] == "full" and tf["misses"] == 0 and tf["resident_per_layer"] == [cfg.num_experts] * 2
    assert tp["regime"] == "partial" and tp["resident_per_layer"] == [cfg.top_k] * 2
    startup = cfg.num_layers * cfg.top_k * part.experts.cache.row_bytes  # rows published at startup
    assert tp["misses"] > 0 and tp["bytes_h2d"] == startup + tp["misses"] * part.experts.cache.row_bytes
    assert tp["generations"] > 1 and 0 < tp["hit_rate"] < 1
    for name, o in tp["observations"].items():
        assert o["status"] == "OBSERVED" and o["value"] == 0, name


def test_engine_rejects_bad_arguments(packs):
    with pytest.raises(EngineError, match="unknown executor"):
        Engine.from_pack(packs["tiny-olmoe"], executor="fast", device="cpu")
    with pytest.raises(EngineError, match=r"resident=9 must be in \[4, 8\]"):
        Engine.from_pack(packs["tiny-olmoe"], resident=9, device="cpu")
    # the real lower bound is top_k (one token's routed experts), not 1
    with pytest.raises(EngineError, match=r"resident=3 must be in \[4, 8\]: at least top_k=4"):
        Engine.from_pack(packs["tiny-olmoe"], resident=3, device="cpu")
    with pytest.raises(EngineError, match="fp16"):
        Engine.from_pack(packs["tiny-olmoe"], resident=4, expert_format="fp16", device="cpu")
    with pytest.raises(EngineError, match="max_group=2 is below top_k=4"):
        Engine.from_pack(packs["tiny-olmoe"], resident=6, max_group=2, device="cpu")
    with pytest.raises(EngineError, match="unknown fused ops"):
        Engine.from_pack(packs["tiny-olmoe"], fused=("bogus",), device="cpu")


def test_fp16_baseline_matches_int4_reference(packs):
    prompt = [[5, 9, 300, 2, 44]]
    a = Engine.from_pack(packs["tiny-qwen2-moe"], executor="reference", device="cpu", max_seq_len=32)
    b = Engine.from_pack(packs["tiny-qwen2-moe"], expert_format="fp16", device="cpu", max_seq_len=32)
    la, lb = a.logits(prompt[0]), b.logits(prompt[0])
    close(lb, la, "fp16 baseline vs reference executor")
    assert b.telemetry()["expert_format"] == "fp16"
    assert b.telemetry()["executor"] == "torch-fp16"  # what ran, not the executor argument it ignored
    assert json.dumps(b.telemetry())  # serializable


def test_fp16_baseline_verifies_expert_hashes(packs, tmp_path):
    import shutil

    from runmap.format.packfile import PackError, PackReader

    bad = tmp_path / "corrupt"
    shutil.copytree(packs["tiny-olmoe"], bad)
    with PackReader(bad) as r:
        entry = r.manifest["layers"][1]
    path = bad / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 5] ^= 0xFF  # one flipped byte inside expert 0 of layer 1
    path.write_bytes(bytes(data))
    with pytest.raises(PackError, match="layer 1"):
        Engine.from_pack(bad, expert_format="fp16", device="cpu")


def test_close_releases_the_engine_and_later_calls_fail_clearly(packs):
    import weakref

    eng = Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", max_batch=1, max_seq_len=16)
    eng.generate([[5, 6, 7]], max_new_tokens=2)
    cache = weakref.ref(eng.experts.cache)  # owns the device rows
    eng.close()
    eng.close()  # idempotent
    import gc

    gc.collect()
    assert cache() is None, "the expert cache (and its device rows) is still referenced after close()"
    for call in (lambda: eng.generate([[5, 6]], max_new_tokens=1), lambda: eng.logits([5, 6]), eng.telemetry):
        with pytest.raises(EngineError, match="is closed"):
            call()


# ---- the typed interface the benchmark drives -----------------------------------------------------------

def test_run_returns_a_typed_generation_and_stats_are_typed(packs):
    from runmap.engine.generation import GenerationRun
    from runmap.engine.telemetry import EngineStats

    cfg = load_preset("tiny-olmoe")[0]
    eng = Engine.from_pack(packs["tiny-olmoe"], executor="reference", resident=cfg.top_k, device="cpu", max_batch=2,
                           max_seq_len=32)
    s0 = eng.stats()
    assert isinstance(s0, EngineStats) and s0.has_cache and s0.regime == "partial" and s0.executor == "reference"
    run = eng.run([[5, 6, 7], [8, 9, 10, 11]], max_new_tokens=4, ignore_eos=True)
    assert isinstance(run, GenerationRun)
    assert run.batch == 2 and run.groups == 1 and run.new_tokens == 8 and run.prompt_tokens == 7
    assert [len(r.token_ids) for r in run.results] == [4, 4]
    assert run.prefill_tok_s == pytest.approx(7 / run.prefill_s)
    assert run.decode_tok_s == pytest.approx((8 - 2) / run.decode_s)
    assert eng.last_timing == run.timing_dict()
    s1 = eng.stats()
    d = s1.since(s0)
    assert d.runs == 1 and d.misses > 0 and d.bytes_h2d == d.misses * eng.experts.cache.row_bytes
    assert d.h2d_seconds > 0
    # the telemetry document is built from the same figures, schema unchanged
    tel = eng.telemetry()
    assert (tel["hits"], tel["misses"], tel["bytes_h2d"]) == (s1.hits, s1.misses, s1.bytes_h2d)
    assert tel["resident_bytes"] == s1.resident_bytes and tel["observations"] == dict(s1.observations)
    from runmap.conformance.schemas import validate_document

    assert validate_document(json.loads(json.dumps(tel)), "telemetry") == []


def test_stats_copy_no_weights(packs, monkeypatch):
    # a snapshot reads sizes, never tensors: dataclasses.astuple once deep-copied the whole non-routed model per
    # call (on the GPU that cost its size in device memory, and an out-of-memory error under --gpu-budget)
    import copy

    eng = Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", max_batch=1, max_seq_len=16)
    w = eng.model.w
    expected = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in [
        w.embed, w.final_norm, w.lm_head, w.inv_freq,
        *(getattr(lw, f) for lw in w.layers for f in vars(lw) if isinstance(getattr(lw, f), torch.Tensor))]}.values())

    def no_copy(*a, **k):
        raise AssertionError("deepcopy during stats()")

    monkeypatch.setattr(copy, "deepcopy", no_copy)
    assert eng.stats().nonrouted_bytes == w.nbytes() == expected


def test_fp16_stats_have_no_cache(packs):
    eng = Engine.from_pack(packs["tiny-olmoe"], expert_format="fp16", device="cpu", max_batch=1, max_seq_len=16)
    st = eng.stats()
    assert not st.has_cache and st.executor == "torch-fp16" and st.misses == 0 and st.resident_bytes > 0
    assert {o["status"] for o in st.observations.values()} == {"UNKNOWN"}
    assert eng.host_source is None
    with pytest.raises(EngineError, match="executor override"):
        eng.logits([5, 6, 7], executor="reference")


def test_shared_host_source_gives_the_same_tokens(packs):
    """host_source=: a second engine of the same pack reuses the first one's host source (no second read and
    hash pass), decodes the same tokens, and still observes its own closed reader."""
    from runmap.format.packfile import PackClosedError

    pk = packs["tiny-olmoe"]
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44]]
    fresh = Engine.from_pack(pk, executor="reference", resident=4, device="cpu", max_batch=2, max_seq_len=16)
    want = [r.token_ids for r in fresh.generate(prompts, max_new_tokens=4)]
    a = Engine.from_pack(pk, executor="reference", device="cpu", max_batch=2, max_seq_len=16)
    b = Engine.from_pack(pk, executor="reference", resident=4, device="cpu", max_batch=2, max_seq_len=16,
                         host_source=a.host_source)
    assert b.host_source is a.host_source and fresh.host_source is not a.host_source
    assert [r.token_ids for r in b.generate(prompts, max_new_tokens=4)] == want
    st = b.stats()
    assert st.misses > 0 and st.observations["request_hash_work"]["value"] == 0
    host = b.host_source
    assert len(host.watched_readers) == 1
    second, _ = host.watched_readers[0]
    assert st.observations["request_pack_reads"]["value"] == 0
    with pytest.raises(PackClosedError):
        second.read_expert_rows(0)
    assert "1 refused read attempts" in b.stats().observations["request_pack_reads"]["source"]
    second.bytes_read += 7  # a read that got through would be counted
    assert b.stats().observations["request_pack_reads"]["value"] == 7


def test_host_source_of_another_pack_is_refused(packs):
    other = Engine.from_pack(packs["tiny-qwen2-moe"], executor="reference", device="cpu", max_batch=1, max_seq_len=8)
    with pytest.raises(EngineError, match="pack identity"):
        Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", host_source=other.host_source)


def test_logits_overrides_are_for_one_call_and_skip_experts_zeroes_the_experts(packs):
    pk = packs["tiny-olmoe"]
    eng = Engine.from_pack(pk, executor="topk-fused", device="cpu", max_batch=1, max_seq_len=16)
    prompt = [5, 9, 300, 2]
    ref = Engine.from_pack(pk, executor="reference", device="cpu", max_batch=1, max_seq_len=16).logits(prompt)
    assert torch.equal(eng.logits(prompt, executor="reference"), ref)
    assert eng.experts.executor == "topk-fused" and eng.stats().executor == "topk-fused"
    close(eng.logits(prompt), ref, "topk-fused vs reference")
    with pytest.raises(EngineError, match="unknown executor"):
        eng.logits(prompt, executor="fast")
    skip = Engine.from_pack(pk, executor="reference", device="cpu", max_batch=1, max_seq_len=16, skip_experts=True)
    assert skip.stats().skip_experts and not eng.stats().skip_experts
    assert not torch.equal(skip.logits(prompt), ref)
    assert skip.stats().misses == 0 and skip.host_source is not None


@pytest.mark.parametrize("resident", [4, None])
def test_a_read_back_of_leased_rows_during_a_request_is_observed(packs, resident):
    """Partial and full residency: the executor runs inside the cache's copy monitor, so an executor that
    copied an expert row to the host would make expert_d2h_bytes non-zero (and the clean run observes 0)."""
    pack = packs["tiny-olmoe"]
    clean = Engine.from_pack(pack, executor="reference", resident=resident, device="cpu")
    clean.generate([[1, 2, 3]], max_new_tokens=2)
    obs = clean.stats().observations["expert_d2h_bytes"]
    assert obs["status"] == "OBSERVED" and obs["value"] == 0
    clean.close()

    eng = Engine.from_pack(pack, executor="reference", resident=resident, device="cpu")
    real = eng.experts.moe

    def leaky(executor, x, ids, gw, storage, table, layout, **kw):
        storage[0].clone()  # a deliberate copy of one leased row into host memory (on a GPU: .cpu())
        return real(executor, x, ids, gw, storage, table, layout, **kw)

    eng.experts.moe = leaky
    eng.generate([[1, 2, 3]], max_new_tokens=2)
    obs = eng.stats().observations["expert_d2h_bytes"]
    assert obs["status"] == "OBSERVED" and obs["value"] > 0, obs
    eng.close()


def test_full_residency_prefill_checks_its_routing_once_at_the_end_of_the_pass(packs, test_device):
    """Full residency, graph-safe executor: inside a prefill the executor runs without its per-layer host check
    (validate=False, as in a captured decode step) and the pass's ids are checked once at its end; a bad id
    still raises the host check's error naming token, slot and id before the pass's output is returned."""
    from runmap.kernels.common import KernelInputError

    # eager passes: on CUDA a captured prefill pass (runmap/engine/prefill_graph.py) replays without calling Python
    eng = Engine.from_pack(packs["tiny-olmoe"], executor="grouped", device=test_device, max_batch=1, max_seq_len=16,
                           cuda_graphs=False)
    seen = []
    real = eng.experts.moe

    def spy(executor, x, ids, gw, storage, table, layout, **kw):
        seen.append(kw.get("validate"))
        return real(executor, x, ids, gw, storage, table, layout, **kw)

    eng.experts.moe = spy
    prompt = [5, 9, 300, 2]
    with torch.inference_mode():
        eng.experts.begin()
        try:
            pad = torch.zeros(1, dtype=torch.long, device=eng.device)
            logits = eng.prefill(torch.tensor([prompt], device=eng.device), pad)
            assert seen == [False] * eng.cfg.num_layers and torch.isfinite(logits).all()
            # outside a pass the executor checks each call itself
            seen.clear()
            x = torch.randn(2, eng.cfg.hidden_size, device=eng.device).half()
            gw = torch.full((2, eng.cfg.top_k), 1.0 / eng.cfg.top_k, device=eng.device)
            ids = torch.arange(2 * eng.cfg.top_k, device=eng.device).reshape(2, eng.cfg.top_k) % eng.cfg.num_experts
            eng.experts(0, x, ids, gw)
            assert seen == [True]
            bad = ids.clone()
            bad[1, 0] = eng.cfg.num_experts  # not an expert id
            with pytest.raises(KernelInputError, match=rf"topk_ids\[1, 0\] = {eng.cfg.num_experts} is not an expert"):
                with eng.experts.checked_pass():
                    eng.experts(0, x, ids, gw)
                    y = eng.experts(1, x, bad, gw)  # no error yet: NaN rows for the bad pair, never another expert
                    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
            assert eng.experts._pass_ids is None
        finally:
            eng.experts.end()
    eng.close()


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-qwen3-moe"])
def test_a_prefill_in_chunks_equals_one_pass(packs, preset, test_device):
    """Later chunks of an unpadded prefill attend causally aligned to the lower right (on CUDA through torch's
    CausalBias in the flash kernel; with grouped KV heads through the mask): every position's logits and the KV
    cache equal one pass over the whole prompt, for chunk sizes that divide the prompt and that do not."""
    eng = Engine.from_pack(packs[preset], executor="grouped", device=test_device, max_batch=1, max_seq_len=32)
    prompt = [(7 * i + 3) % eng.cfg.vocab_size for i in range(13)]
    runs = []
    for chunk in (13, 4, 5, 1):
        eng.prefill_chunk = chunk
        with torch.inference_mode():
            eng.experts.begin()
            try:
                out = eng.prefill(torch.tensor([prompt], device=eng.device), torch.zeros(1, dtype=torch.long,
                                  device=eng.device), all_logits=True)[0]  # (T, V)
            finally:
                eng.experts.end()
        runs.append((chunk, out.float().cpu(), eng.kv.k[:, :1, :, :13].float().cpu().clone()))
    eng.close()
    _, whole, k_whole = runs[0]
    for chunk, out, k in runs[1:]:
        err = (out - whole).abs().max().item()
        assert err <= 2e-3 * whole.abs().max().item() + 1e-3, f"{preset} chunk {chunk}: logits differ by {err:.3g}"
        assert (k - k_whole).abs().max().item() <= 2e-3 * k_whole.abs().max().item() + 1e-3, f"chunk {chunk}: keys"


def test_warm_up_runs_every_size_class_and_leaves_nothing_counted(packs, test_device):
    """warm_up() runs one prefill per size class up to a chunk (the decoded-weights mode's first pass included) and
    a decode step of 1 and of max_batch rows; afterwards the engine's and the cache's counters are as before and the
    same prompt gives the same tokens as on an engine that never warmed up."""
    from runmap.engine.generation import prefill_warmup_shapes

    cold = Engine.from_pack(packs["tiny-olmoe"], executor="grouped", device=test_device, max_batch=2, max_seq_len=24)
    assert (cold.warm_up_s is not None) == (test_device == "cuda")  # by default on CUDA (full residency) only
    want = cold.generate([[5, 9, 300, 2]], max_new_tokens=4)[0].token_ids
    cold.close()
    eng = Engine.from_pack(packs["tiny-olmoe"], executor="grouped", device=test_device, max_batch=2, max_seq_len=24,
                           prefill_chunk=20, warm_up=False)
    assert eng.warm_up_s is None
    counters = dict(eng.experts.cache.counters)
    seen, decoded = [], []
    real_pieces, real_decode = eng.prefill_pieces, eng.decode
    eng.prefill_pieces = lambda tokens, pad, *a, **kw: seen.append(tokens.shape[1]) or real_pieces(tokens, pad, *a, **kw)
    eng.decode = lambda tokens, slot, pad: decoded.append(tokens.shape[0]) or real_decode(tokens, slot, pad)
    assert eng.warm_up() > 0 and eng.warm_up_s > 0
    eng.prefill_pieces, eng.decode = real_pieces, real_decode
    assert seen == [s[0] for s in prefill_warmup_shapes(max_seq_len=24, prefill_chunk=20, max_batch=1,
                                                          top_k=eng.cfg.top_k)]
    assert seen[0] == 1 and seen[-1] == 20 and decoded == [1, 2]
    # with CUDA graphs, one captured batch-1 prefill per length bucket within the chunk (runmap.engine.prefill_graph)
    if test_device == "cuda":
        assert list(eng._prefiller.passes) == [(1, 16, False, False, False)]
        assert all(st.graph is not None for st in eng._prefiller.passes.values())
    else:
        assert eng._prefiller is None
    assert eng.prefill_paths == dict.fromkeys(eng.prefill_paths, 0)
    assert dict(eng.experts.cache.counters) == counters
    assert eng.prefill_counts == dict.fromkeys(eng.prefill_counts, 0)
    assert eng.generate([[5, 9, 300, 2]], max_new_tokens=4)[0].token_ids == want
    eng.close()


@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-qwen2-moe"])
def test_the_decoded_weights_mode_matches_the_reference_executor_end_to_end(packs, preset, monkeypatch, test_device):
    """The grouped executor's decoded-weights mode (forced from 129 pairs instead of DEQUANT_MIN_PAIRS) through a
    whole 72-token prefill against the reference executor: every position whose routed experts are the reference's in
    every layer has its logits within the executors' tolerance. The mode multiplies fp16(q * scale), the weights of the
    INT4 loop's per-element-scale path, so a near-tie in a router may fall the other way than in the FP32 reference
    (tiny-olmoe: token 8, layer 1; the INT4 loop's tile-scale path keeps that one): such positions are excluded and
    counted, at most one in eight."""
    import runmap.kernels.grouped as grouped

    prompt = [(13 * i + 5) % 500 for i in range(72)]  # > 128 pairs at top-2: sorted runs
    outs, routes = {}, {}
    for name, executor, threshold in (("reference", "reference", grouped.DEQUANT_MIN_PAIRS),
                                      ("decoded", "grouped", 129)):
        monkeypatch.setattr(grouped, "DEQUANT_MIN_PAIRS", threshold)
        eng = Engine.from_pack(packs[preset], executor=executor, device=test_device, max_batch=1, max_seq_len=80)
        assert grouped.default_config(72 * eng.cfg.top_k, eng.device)["DEQUANT"] == (threshold == 129)
        o, _, logs = run_steps(eng, prompt, 0)
        outs[name], routes[name] = o[0], logs[0]  # (T, V) logits of every position; [(layer, ids (T, k))]
        eng.close()
    same = torch.ones(len(prompt), dtype=torch.bool)
    for (_, a), (_, b) in zip(routes["reference"], routes["decoded"]):
        same &= (a.sort(-1).values == b.sort(-1).values).all(-1)
    assert int((~same).sum()) <= len(prompt) // 8, f"{preset}: routes differ at {(~same).nonzero().flatten().tolist()}"
    ref, got = outs["reference"][same], outs["decoded"][same]
    err, bound = (got - ref).abs().max().item(), 1e-2 * ref.abs().max().item() + 2e-3
    assert err <= bound, f"{preset}: decoded mode max |diff| {err:.3g} > {bound:.3g} where the routes agree"


def test_partial_residency_runs_without_the_decoded_mode_and_with_short_passes(packs, monkeypatch, test_device):
    """The decoded-weights mode's workspace (every expert of a layer in fp16) would take the memory partial residency
    keeps for experts: a partial engine's prefill never enters it, even past DEQUANT_MIN_PAIRS, and its passes
    default to the budget planner's chunk; a full-residency engine does both the other way."""
    import runmap.kernels.grouped as grouped
    from runmap.engine.budget import PREFILL_CHUNK_UNDER_BUDGET
    from runmap.engine.engine import PREFILL_CHUNK

    # the shortest prompt past a lowered threshold that is still a sorted pass (over DECODE_MAX_PAIRS = 128 pairs):
    # 33 tokens x top_k 4 = 132 pairs (the interpreter's time grows with the pairs)
    monkeypatch.setattr(grouped, "DEQUANT_MIN_PAIRS", grouped.DECODE_MAX_PAIRS + 1)
    entered = []
    real = grouped._dequant_stages
    monkeypatch.setattr(grouped, "_dequant_stages", lambda *a, **kw: entered.append(1) or real(*a, **kw))
    prompt = [(13 * i + 5) % 500 for i in range(33)]
    for resident, want_chunk, want_decoded in ((None, PREFILL_CHUNK, True), (4, PREFILL_CHUNK_UNDER_BUDGET, False)):
        eng = Engine.from_pack(packs["tiny-olmoe"], executor="grouped", resident=resident, device=test_device,
                               max_batch=1, max_seq_len=64)
        entered.clear()
        assert eng.prefill_chunk == want_chunk
        eng.generate([prompt], max_new_tokens=1)
        assert bool(entered) == want_decoded, (resident, entered)
        eng.close()


def test_logits_on_imposed_routes_replay_the_reported_ones_across_passes(packs):
    """logits(routes=) imposes (T, L, k) expert ids position by position, over several prefill passes: the routes
    logits_with_routes reported give the same logits (the router's own weights of the same ids); one changed
    expert at one position and layer changes that position from there on and no earlier one; a wrong shape is
    refused naming the expected one."""
    eng = Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", max_batch=1, max_seq_len=32,
                           prefill_chunk=5)
    prompt = [(11 * i + 4) % 500 for i in range(13)]
    own, routes = eng.logits_with_routes(prompt)  # (T, V), (T, L, k)
    assert routes.shape == (13, eng.cfg.num_layers, eng.cfg.top_k)
    again = eng.logits(prompt, routes=routes)
    assert torch.allclose(again, own, atol=1e-5, rtol=1e-5)
    moved = routes.clone()
    t = 7
    free = [e for e in range(eng.cfg.num_experts) if e not in routes[t, 0].tolist()]
    moved[t, 0, 0] = free[0]  # position 7 (second pass), layer 0: another expert
    other = eng.logits(prompt, routes=moved)
    assert torch.equal(other[:t], again[:t]) and not torch.allclose(other[t], again[t], atol=1e-3)
    with pytest.raises(EngineError, match=r"routes: shape \(12, 2, 2\), expected \(13, "):
        eng.logits(prompt, routes=routes[:12, :2, :2])
    assert eng.imposed is None and eng.routes is None  # restored
    eng.close()


@pytest.mark.parametrize("resident", [None, 5])
def test_chained_launches_change_no_token(packs, monkeypatch, test_device, resident):
    """Programmatic dependent launch (runmap.kernels.common.chained) changes when the decode chain's kernels start,
    never what they compute: greedy tokens of two rows, full residency (captured decode graphs) and partial residency
    (the segment chain), equal with RUNMAP_PDL=0 and 1. GPU only (Hopper): elsewhere nothing is chained."""
    if test_device != "cuda" or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs a CUDA device of compute capability 9.0 or later")
    from runmap.kernels import common

    tokens = {}
    try:
        for setting in ("0", "1"):
            monkeypatch.setenv(common.PDL_ENV, setting)
            common.reset_chained()
            eng = Engine.from_pack(packs["tiny-olmoe"], executor="grouped", device="cuda", max_batch=2,
                                   max_seq_len=64, resident=resident)
            try:
                assert common.chained(eng.device)["CHAINED"] == (setting == "1")
                run = eng.run([[5, 6, 7, 8, 9], [10, 11]], max_new_tokens=24, ignore_eos=True)
                tokens[setting] = [r.token_ids for r in run.results]
            finally:
                eng.close()
    finally:
        common.reset_chained()
    assert tokens["0"] == tokens["1"]


@pytest.mark.parametrize("graphs", [False, True])
def test_a_riding_shared_expert_changes_no_logit(packs, monkeypatch, test_device, graphs):
    """Fused op "shared" with "gemv": a one-token decode step computes Qwen2-MoE's shared expert inside the grouped
    executor's launches (runmap.kernels.grouped.SharedExpert) instead of shared_expert_one_row's two launches after
    them. Teacher-forced logits of both ways within fp16 rounding of each other, on the interpreter's fused ops in CI;
    on CUDA also through captured decode graphs (GraphDecoder passes the shared expert on)."""
    if graphs and test_device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    import runmap.kernels.fused_ops as fo
    import runmap.kernels.grouped as kg

    ref_outs, fed, _ = run_steps(Engine.from_pack(packs["tiny-qwen2-moe"], executor="reference", device="cpu",
                                                  max_batch=1, max_seq_len=16), TRITON_PROMPT, 3)
    calls = {"shared": 0, "one_row": 0}
    real_moe, real_one_row = kg.grouped_moe, fo.shared_expert_one_row

    def moe_spy(*a, shared=None, **kw):
        calls["shared"] += shared is not None
        return real_moe(*a, shared=shared, **kw)

    def one_row_spy(*a, **kw):
        calls["one_row"] += 1
        return real_one_row(*a, **kw)
    monkeypatch.setattr(kg, "grouped_moe", moe_spy)
    monkeypatch.setattr(fo, "shared_expert_one_row", one_row_spy)
    outs = {}
    for ops in (("gemv",), ("gemv", "shared")):
        for k in calls:
            calls[k] = 0
        eng = Engine.from_pack(packs["tiny-qwen2-moe"], executor="grouped", device=test_device, max_batch=1,
                               max_seq_len=16, fused=ops, cuda_graphs=graphs, segments=False)  # graphs: captured here
        eng.model.fused = frozenset(ops)  # the CPU build ignores fused ops: the interpreter runs them here
        at_build = dict(calls)  # the build's warm-up (and graph capture) ran steps of its own
        for k in calls:
            calls[k] = 0
        try:
            outs[ops], _, _ = run_steps(eng, TRITON_PROMPT, 3, teacher=fed)
        finally:
            eng.close()
        layers = eng.cfg.num_layers
        if not graphs:  # eager: every decode step's layers seen (a replayed graph calls no Python)
            assert calls == ({"shared": 3 * layers, "one_row": 0} if "shared" in ops else
                             {"shared": 0, "one_row": 3 * layers}), (ops, calls)
        else:  # seen when the build's warm-up captured the decode graphs
            assert at_build["shared" if "shared" in ops else "one_row"] >= layers, (ops, at_build)
            assert at_build["one_row" if "shared" in ops else "shared"] == 0, (ops, at_build)
    for i, (a, b, r) in enumerate(zip(outs[("gemv", "shared")], outs[("gemv",)], ref_outs)):
        err = (a - b).abs().max().item()
        assert err <= 2e-3 * b.abs().max().item() + 1e-3, f"forward {i}: riding vs two launches max |diff| {err:.3g}"
        err = (a - r).abs().max().item()
        assert err <= 1e-2 * r.abs().max().item() + 2e-3, f"forward {i}: against the reference max |diff| {err:.3g}"


def test_a_step_whose_experts_take_no_shared_expert_is_never_given_one():
    """The captured decode step's callback (GraphDecoder) passes a shared expert on only where the engine's experts
    take one: SkipExperts (skip_experts=True) and DenseFp16Experts have no rides_shared and no ``shared``, and a
    host-read step never rides. Without this the skip_experts variant failed at graph capture (a TypeError)."""
    from types import SimpleNamespace

    from runmap.engine.engine import GraphDecoder, HostReadDecoder, SkipExperts

    seen = []
    inner = SimpleNamespace(begin=lambda: None, end=lambda: None)
    dec = GraphDecoder.__new__(GraphDecoder)
    dec.e = SimpleNamespace(experts=SkipExperts(inner))
    x = torch.randn(1, 8).half()
    assert dec.rides_shared(1) is False
    assert torch.equal(dec._experts(0, x, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)), torch.zeros_like(x))
    dec.e = SimpleNamespace(experts=SimpleNamespace(rides_shared=lambda n: n == 1))
    assert dec.rides_shared(1) is True and dec.rides_shared(2) is False
    dec.e = SimpleNamespace(experts=lambda *a, **kw: seen.append(kw) or x)
    dec._experts(0, x, None, None)
    dec._experts(0, x, None, None, shared="s")
    assert seen == [{}, {"shared": "s"}]  # no keyword where no shared expert rides
    assert HostReadDecoder.__new__(HostReadDecoder).rides_shared(1) is False
