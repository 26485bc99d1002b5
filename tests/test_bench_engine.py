"""The runner on the real engine (tiny synthetic pack, CPU, reference executor): records from the
engine's own telemetry, and engines after the first reuse the host source without changing outputs."""
from __future__ import annotations

import pytest

from runmap.bench import campaign as bench
from runmap.arch.config import load_preset
from runmap.format.pack import pack_checkpoint
from runmap.synth.checkpoint import write_synthetic
from runmap.conformance.schemas import validate_document


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    base = tmp_path_factory.mktemp("tinypack")
    ck = write_synthetic(load_preset("tiny-olmoe")[0], base / "ck", seed=3)
    return ck, pack_checkpoint(ck, base / "pk", device="cpu")


def _spec(ck, pk):
    return {
        "name": "eng", "description": "real engine", "device": "cpu",
        "defaults": {"repeats": 2, "warmup": 0},
        "models": {"m": {"preset": "tiny-olmoe", "pack": str(pk), "checkpoint": str(ck)}},
        "groups": [
            {"name": "fp16", "kind": "engine-fp16", "models": ["m"], "batch": 2, "prompt_len": 5, "decode_len": 3},
            {"name": "res", "kind": "engine", "models": ["m"], "resident": ["full", 4], "executors": ["reference"],
             "batch": 2, "prompt_len": 5, "decode_len": 3},
        ],
    }


def test_campaign_on_the_real_engine(tiny_pack, tmp_path):
    ck, pk = tiny_pack
    bench._HOST_SOURCES.clear()
    summary = bench.run_campaign(_spec(ck, pk), tmp_path, progress=False, measure_bandwidth=False, command="pytest")
    assert not summary["failed"] and len(summary["done"]) == 3
    recs = {r["id"]: r for r in bench.load_records(tmp_path / "eng")}
    for r in recs.values():
        r.pop("_path")
        assert validate_document(r, "bench-record") == []
        assert r["timing"]["new_tokens"] == 2 * 3, "EOS stopping is off: every row decodes decode_len tokens"
    full = recs["m__engine__reference__r8__b2__p5__d3"]
    part = recs["m__engine__reference__r4__b2__p5__d3"]
    assert full["cache_stats"]["misses"] == {"status": "OBSERVED", "value": 0}
    assert part["cache_stats"]["misses"]["value"] > 0 and part["h2d"]["bytes"]["value"] > 0
    assert {o["status"] for o in part["observations"].values()} <= {"OBSERVED", "UNKNOWN", "UNSUPPORTED"}
    assert part["engine"]["host_source"].startswith("reused") and full["engine"]["host_source"] == "built by this engine"
    assert part["cache"]["resident_bytes"]["value"] * 2 == full["cache"]["resident_bytes"]["value"]
    assert part["ratios"]["decode_vs_engine-fp16"]["status"] == "OBSERVED"
    assert part["config"]["block_size"] == 256


def test_shared_host_source_gives_the_same_tokens(tiny_pack):
    from runmap.engine.engine import Engine

    _, pk = tiny_pack
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44]]
    fresh = Engine.from_pack(pk, executor="reference", resident=4, device="cpu", max_batch=2, max_seq_len=16)
    want = [r.token_ids for r in fresh.generate(prompts, max_new_tokens=4)]
    bench._HOST_SOURCES.clear()
    with bench.shared_host_source(pk):
        a = Engine.from_pack(pk, executor="reference", device="cpu", max_batch=2, max_seq_len=16)
    with bench.shared_host_source(pk):
        b = Engine.from_pack(pk, executor="reference", resident=4, device="cpu", max_batch=2, max_seq_len=16)
    assert a.experts.cache.host is b.experts.cache.host
    assert [r.token_ids for r in b.generate(prompts, max_new_tokens=4)] == want
    tel = b.telemetry()
    assert tel["misses"] > 0 and tel["observations"]["request_hash_work"]["value"] == 0
    # the second engine's own (closed) reader is observed too: a read through it is seen, not lost
    host = b.experts.cache.host
    assert len(host.watched_readers) == 1
    second, _ = host.watched_readers[0]
    assert (tel["observations"]["request_pack_reads"]["status"], tel["observations"]["request_pack_reads"]["value"]) == \
        ("OBSERVED", 0)
    from runmap.format.packfile import PackClosedError

    with pytest.raises(PackClosedError):
        second.read_expert_rows(0)
    obs = b.telemetry()["observations"]["request_pack_reads"]
    assert "2 closed reader(s); 1 refused read attempts" in obs["source"]
    second.bytes_read += 7  # a read that got through would be counted
    assert b.telemetry()["observations"]["request_pack_reads"]["value"] == 7
    # outside the context the engine builds its own host source again
    c = Engine.from_pack(pk, executor="reference", resident=4, device="cpu", max_batch=2, max_seq_len=16)
    assert c.experts.cache.host is not b.experts.cache.host
    bench._HOST_SOURCES.clear()
