"""IFEval generation IO: batching, resumability after crashes, torn lines, refusal to mix settings.

The engine is a small fake with the engine's generate API, so these tests need no model; the test
against the real engine on the tiny pack is in test_ifeval_engine.py.
"""
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from runmap.ifeval import generate as G
from runmap.conformance.schemas import validate_file

INPUTS = G.DEFAULT_INPUTS


@dataclass
class FakeResult:
    text: str
    token_ids: list
    finish_reason: str


class FakeEngine:
    """Deterministic answers; optionally raises ``exc`` on call number ``fail_on`` (0-based)."""

    def __init__(self, fail_on=None, exc=RuntimeError("simulated engine crash")):
        self.calls, self.fail_on, self.exc, self.last_timing = [], fail_on, exc, None

    def generate(self, prompts, *, max_new_tokens, temperature=0.0, chat=True, stop=()):
        assert temperature == 0.0 and chat is True and isinstance(stop, tuple)
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise self.exc
        self.calls.append(list(prompts))
        self.last_timing = {"prefill_s": 0.5, "decode_s": 1.5, "note": "ignored"}
        return [FakeResult(f"Answer {len(p)}: **{p[:12]}**", list(range(1 + len(p) % max_new_tokens)), "length")
                for p in prompts]

    def telemetry(self):
        return {"engine": "fake"}


def _meta():
    return {"model": {"name": "fake-model", "arch": "olmoe"}, "pack": {"path": "p", "manifest_sha256": "0" * 64, "content_sha256": "1" * 64},
            "executor": "grouped", "regime": "full", "resident": None,
            "inputs": {"path": str(INPUTS), "sha256": G.sha256_file(INPUTS), "limit": 10, "prompts": 10}}


def _run(out, engine, n=10, batch=4, max_new=16, meta=None, **kw):
    prompts = G.read_prompts(INPUTS, n)
    settings = G.GenerationSettings(max_new_tokens=max_new, batch_size=batch)
    return G.generate_answers(prompts, out, engine, settings, meta or _meta(), progress=False, **kw)


def _lines(out):
    return [json.loads(l) for l in Path(out).read_text().splitlines()]


def test_full_run_writes_every_answer_and_a_complete_sidecar(tmp_path):
    out, eng = tmp_path / "answers.jsonl", FakeEngine()
    meta = _run(out, eng)
    recs = _lines(out)
    prompts = G.read_prompts(INPUTS, 10)
    assert sorted(r["prompt"] for r in recs) == sorted(p.prompt for p in prompts)
    assert {r["key"] for r in recs} == {p.key for p in prompts}
    assert [len(c) for c in eng.calls] == [4, 4, 2]
    lengths = [len(p) for c in eng.calls for p in c]
    assert lengths == sorted(lengths, reverse=True)  # batches of similar length: longest first
    assert meta["status"] == "complete" and meta["counts"] == {"prompts": 10, "answered": 10, "remaining": 0}
    assert meta["sessions"][0]["engine_timing"] == {"prefill_s": 1.5, "decode_s": 4.5}
    assert meta["timing"]["new_tokens"] == sum(r["new_tokens"] for r in recs)
    assert json.loads(G.sidecar_path(out).read_text()) == meta
    assert validate_file(out, "ifeval-responses") == []
    assert validate_file(G.sidecar_path(out), "ifeval-generation") == []


def test_engine_crash_keeps_written_answers_and_rerun_skips_them(tmp_path):
    out = tmp_path / "answers.jsonl"
    with pytest.raises(RuntimeError, match="simulated"):
        _run(out, FakeEngine(fail_on=2))
    assert len(_lines(out)) == 8
    side = json.loads(G.sidecar_path(out).read_text())
    assert side["status"] == "failed" and side["counts"]["answered"] == 8 and "simulated" in side["sessions"][0]["error"]
    eng = FakeEngine()
    meta = _run(out, eng)
    done_before = {r["prompt"] for r in _lines(out)[:8]}
    assert [p for c in eng.calls for p in c] and not done_before & {p for c in eng.calls for p in c}
    assert len(_lines(out)) == 10 and len({r["prompt"] for r in _lines(out)}) == 10
    assert meta["status"] == "complete" and len(meta["sessions"]) == 2
    assert meta["sessions"][1]["skipped_already_answered"] == 8
    # a third run has nothing to do
    eng3 = FakeEngine()
    _run(out, eng3)
    assert eng3.calls == []


def test_keyboard_interrupt_is_recorded_and_loses_nothing(tmp_path):
    out = tmp_path / "answers.jsonl"
    with pytest.raises(KeyboardInterrupt):
        _run(out, FakeEngine(fail_on=1, exc=KeyboardInterrupt()))
    assert len(_lines(out)) == 4
    assert json.loads(G.sidecar_path(out).read_text())["status"] == "interrupted"


def test_killed_process_loses_no_written_answer(tmp_path):
    """A process that dies abruptly (os._exit: no cleanup, no buffer flush) in its third batch."""
    out = tmp_path / "answers.jsonl"
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_ifeval_generate import FakeEngine, _run
        class Dying(FakeEngine):
            def generate(self, prompts, **kw):
                if len(self.calls) == 2:
                    os._exit(9)
                return super().generate(prompts, **kw)
        _run({str(out)!r}, Dying())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert len(_lines(out)) == 8
    eng = FakeEngine()
    _run(out, eng)
    assert sum(len(c) for c in eng.calls) == 2 and len(_lines(out)) == 10


def test_torn_last_line_is_cut_and_its_prompt_asked_again(tmp_path):
    out = tmp_path / "answers.jsonl"
    _run(out, FakeEngine(), n=5)
    # a crash in the middle of writing the 6th answer leaves half a line
    prompts6 = G.read_prompts(INPUTS, 6)
    torn = json.dumps({"key": prompts6[5].key, "prompt": prompts6[5].prompt, "response": "half"})[:40]
    with open(out, "a") as f:
        f.write(torn)
    eng = FakeEngine()
    _run(out, eng, n=6)
    assert eng.calls == [[prompts6[5].prompt]]
    text = out.read_text()
    assert text.endswith("\n") and len(_lines(out)) == 6


def test_unparsable_last_line_with_newline_is_dropped_too(tmp_path):
    out = tmp_path / "answers.jsonl"
    _run(out, FakeEngine(), n=5)
    with open(out, "ab") as f:
        f.write(b"\x00\x00\x00\n")  # zero-filled tail after a power loss
    eng = FakeEngine()
    _run(out, eng, n=6)
    assert sum(len(c) for c in eng.calls) == 1 and len(_lines(out)) == 6


def test_bad_line_before_the_end_is_an_error_naming_it(tmp_path):
    out = tmp_path / "answers.jsonl"
    _run(out, FakeEngine(), n=5)
    lines = out.read_text().splitlines()
    lines[1] = lines[1][:30]
    out.write_text("\n".join(lines) + "\n")
    with pytest.raises(G.IFEvalGenerateError, match=r"answers.jsonl:2: unreadable answer line"):
        _run(out, FakeEngine(), n=5)


def test_duplicate_answer_is_an_error(tmp_path):
    out = tmp_path / "answers.jsonl"
    _run(out, FakeEngine(), n=3)
    first = out.read_text().splitlines()[0]
    with open(out, "a") as f:
        f.write(first + "\n")
    with pytest.raises(G.IFEvalGenerateError, match=r"answers.jsonl:4: second answer"):
        _run(out, FakeEngine(), n=3)


def test_rerun_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "answers.jsonl"
    with pytest.raises(RuntimeError):
        _run(out, FakeEngine(fail_on=1))
    with pytest.raises(G.IFEvalGenerateError, match=r"generation.max_new_tokens: 16 -> 32"):
        _run(out, FakeEngine(), max_new=32)
    # a different batch size is fine (e.g. after running out of memory)
    _run(out, FakeEngine(), batch=3)
    assert len(_lines(out)) == 10


def test_answers_without_sidecar_are_refused(tmp_path):
    out = tmp_path / "answers.jsonl"
    _run(out, FakeEngine(), n=3)
    G.sidecar_path(out).unlink()
    with pytest.raises(G.IFEvalGenerateError, match="settings are unknown"):
        _run(out, FakeEngine(), n=3)


def test_answers_to_prompts_outside_the_selection_are_refused(tmp_path):
    out = tmp_path / "answers.jsonl"
    _run(out, FakeEngine(), n=6)
    with pytest.raises(G.IFEvalGenerateError, match=r"answers.jsonl:\d+: answer to a prompt that is not among"):
        _run(out, FakeEngine(), n=2)


def test_engine_returning_too_few_results_is_an_error(tmp_path):
    class Short(FakeEngine):
        def generate(self, prompts, **kw):
            return super().generate(prompts, **kw)[:-1]

    with pytest.raises(G.IFEvalGenerateError, match="3 results for 4 prompts"):
        _run(tmp_path / "a.jsonl", Short())


def test_read_prompts_limit_and_errors(tmp_path):
    assert [p.key for p in G.read_prompts(INPUTS, 3)] == [json.loads(l)["key"] for l in
                                                          INPUTS.read_text().splitlines()[:3]]
    assert len(G.read_prompts(INPUTS)) == 541
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"key": 1, "prompt": "a"}\n{"key": 2}\n')
    with pytest.raises(G.IFEvalGenerateError, match=r"in.jsonl:2:"):
        G.read_prompts(bad)
    with pytest.raises(G.IFEvalGenerateError, match="--limit"):
        G.read_prompts(INPUTS, 0)


def test_generated_answers_score_and_carry_generation_metadata(tmp_path):
    """Generate for a subset, write that subset as the inputs, score: the summary records the run."""
    from runmap.ifeval import score as S

    out = tmp_path / "answers.jsonl"
    _run(out, FakeEngine(), n=10)
    subset = tmp_path / "inputs.jsonl"
    subset.write_text("".join(INPUTS.read_text().splitlines(keepends=True)[:10]))
    results, summary = S.score_files(subset, out)
    S.write_outputs(tmp_path / "score", results, summary)
    gen = summary["generation"]
    assert gen["model"]["name"] == "fake-model" and gen["executor"] == "grouped" and gen["regime"] == "full"
    assert gen["generation"]["max_new_tokens"] == 16 and gen["generation"]["greedy"] is True
    assert gen["status"] == "complete" and summary["prompt_level"]["strict"]["total"] == 10
    assert validate_file(tmp_path / "score" / "summary.json", "ifeval-summary") == []


def test_rerun_with_another_pack_or_executor_is_refused(tmp_path):
    out = tmp_path / "answers.jsonl"
    with pytest.raises(RuntimeError):
        _run(out, FakeEngine(fail_on=1))
    other_pack = _meta()
    other_pack["pack"] = {**other_pack["pack"], "content_sha256": "2" * 64}
    with pytest.raises(G.IFEvalGenerateError, match="pack.content_sha256"):
        _run(out, FakeEngine(), meta=other_pack)
    other_exec = {**_meta(), "executor": "scalar"}
    with pytest.raises(G.IFEvalGenerateError, match="executor: 'grouped' -> 'scalar'"):
        _run(out, FakeEngine(), meta=other_exec)
    # a re-made pack of the same content (new manifest bytes: timestamps) may continue the file
    same_content = _meta()
    same_content["pack"] = {**same_content["pack"], "manifest_sha256": "3" * 64, "path": "elsewhere"}
    _run(out, FakeEngine(), meta=same_content)
    assert len(_lines(out)) == 10


def test_pack_content_hash_ignores_timestamps_and_sees_expert_bytes():
    man = {"format": {"name": "runmap-qpack", "version": 1}, "created_utc": "2026-01-01T00:00:00Z",
           "timing": {"wall_s": 1.0}, "source": {"path": "/a", "files": [{"file": "x", "sha256": "ab"}]},
           "model": {"arch": "olmoe"}, "block_size": 256, "row_layout": {"row_bytes": 4},
           "nonrouted": {"file": "n", "dtype": "float16", "tensors": ["t"]},
           "layers": [{"layer": 0, "expert_sha256": ["e0", "e1"]}]}
    h = G.pack_content_sha256(man)
    again = {**man, "created_utc": "2027-01-01T00:00:00Z", "timing": {"wall_s": 9.0}, "compute_device": "cuda",
             "source": {**man["source"], "path": "/elsewhere"}}
    assert G.pack_content_sha256(again) == h
    changed = {**man, "layers": [{"layer": 0, "expert_sha256": ["e0", "e2"]}]}
    assert G.pack_content_sha256(changed) != h
    assert G.pack_content_sha256({**man, "block_size": 128}) != h


def test_score_refuses_incomplete_or_foreign_generation_metadata(tmp_path):
    from runmap.ifeval import score as S

    out = tmp_path / "answers.jsonl"
    _run(out, FakeEngine(), n=10)
    subset = tmp_path / "inputs.jsonl"
    subset.write_text("".join(INPUTS.read_text().splitlines(keepends=True)[:10]))
    side = G.sidecar_path(out)
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "status": "interrupted"}))
    with pytest.raises(S.IFEvalError, match="status is 'interrupted'"):
        S.score_files(subset, out)
    side.write_text(json.dumps({**meta, "inputs": {**meta["inputs"], "limit": None, "sha256": "f" * 64}}))
    with pytest.raises(S.IFEvalError, match="generated from other inputs"):
        S.score_files(subset, out)


def test_a_second_writer_is_refused(tmp_path):
    import fcntl

    out = tmp_path / "answers.jsonl"
    with open(out, "a") as other:  # stands for another generate process holding the file
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(G.IFEvalGenerateError, match="another `runmap ifeval generate` is writing"):
            _run(out, FakeEngine())
    _run(out, FakeEngine())  # lock released: fine
    assert len(_lines(out)) == 10
