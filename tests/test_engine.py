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

PRESETS = ["tiny-olmoe", "tiny-qwen2-moe"]


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
def test_triton_executors_match_reference(packs, reference_runs, preset, executor):
    prompt = TRITON_PROMPT
    ref_outs, fed, ref_logs = reference_runs[preset]
    eng = Engine.from_pack(packs[preset], executor=executor, device="cpu", max_batch=1, max_seq_len=16)
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
    with pytest.raises(EngineError, match=r"resident=9 must be in \[1, 8\]"):
        Engine.from_pack(packs["tiny-olmoe"], resident=9, device="cpu")
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
