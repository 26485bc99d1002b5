"""`runmap ifeval generate` with the real engine on a tiny synthetic pack, then `runmap ifeval score`."""
import json

import pytest

from runmap.ifeval import generate as G
from runmap.cli.main import main
from runmap.conformance.schemas import validate_file

pytest.importorskip("runmap.engine.engine", reason="runmap/engine/engine.py (the engine helper's module) not present")


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("ifeval_pack")
    assert main(["synth", "--preset", "tiny-olmoe", str(d / "ckpt"), "--no-progress"]) == 0
    assert main(["pack", str(d / "ckpt"), str(d / "pack")]) == 0
    return d / "pack"


def _generate(pack, out, *extra):
    return main(["ifeval", "generate", "--packed", str(pack), "--out", str(out), "--executor", "reference",
                 "--max-new-tokens", "4", "--model-name", "tiny-olmoe", "--no-progress", *extra])


def test_generate_resume_and_score_with_the_engine(tiny_pack, tmp_path):
    out = tmp_path / "answers.jsonl"
    assert _generate(tiny_pack, out, "--limit", "2", "--batch-size", "2") == 0
    first = out.read_text()
    # a rerun over more prompts keeps the two answers byte for byte and adds only the third
    assert _generate(tiny_pack, out, "--limit", "3", "--batch-size", "2") == 0
    assert out.read_text().startswith(first)
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["key"] for r in recs[2:]] == [G.read_prompts(G.DEFAULT_INPUTS, 3)[2].key]
    assert all(1 <= r["new_tokens"] <= 4 and r["finish_reason"] for r in recs)
    meta = json.loads(G.sidecar_path(out).read_text())
    assert meta["status"] == "complete" and len(meta["sessions"]) == 2
    assert meta["executor"] == "reference" and meta["regime"] == "full" and meta["resident"] == 8
    assert meta["model"] == {**meta["model"], "name": "tiny-olmoe", "arch": "olmoe"}
    assert meta["generation"]["greedy"] is True and meta["generation"]["chat"] is True
    assert meta["max_seq_len"] >= 4 and meta["sessions"][0]["engine_timing"]["new_tokens"] > 0
    assert validate_file(G.sidecar_path(out), "ifeval-generation") == []
    assert validate_file(out, "ifeval-responses") == []

    subset = tmp_path / "inputs.jsonl"
    subset.write_text("".join(G.DEFAULT_INPUTS.read_text().splitlines(keepends=True)[:3]))
    assert main(["ifeval", "score", "--inputs", str(subset), "--responses", str(out), "--out",
                 str(tmp_path / "score"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "score" / "summary.json").read_text())
    assert summary["generation"]["executor"] == "reference" and summary["generation"]["model"]["name"] == "tiny-olmoe"
    assert summary["prompt_level"]["strict"]["total"] == 3
    assert validate_file(tmp_path / "score" / "summary.json", "ifeval-summary") == []


def test_answers_are_the_engines_greedy_chat_output(tiny_pack, tmp_path):
    from runmap.engine.engine import Engine

    out = tmp_path / "answers.jsonl"
    assert _generate(tiny_pack, out, "--limit", "1", "--batch-size", "1") == 0
    rec = json.loads(out.read_text())
    eng = Engine.from_pack(tiny_pack, executor="reference", max_batch=1)
    want = eng.generate([rec["prompt"]], max_new_tokens=4, temperature=0.0, chat=True)[0]
    assert rec["response"] == want.text and rec["new_tokens"] == len(want.token_ids)


def test_max_seq_len_too_small_is_refused(tiny_pack, tmp_path, capsys):
    assert _generate(tiny_pack, tmp_path / "a.jsonl", "--limit", "1", "--max-seq-len", "3") == 1  # bad input: exit 1 (2 is for usage errors)
    assert "--max-seq-len 3 <" in capsys.readouterr().err


def test_prompt_plus_answer_beyond_the_models_positions_is_refused(tiny_pack, tmp_path, capsys):
    # the tiny preset has max_position_embeddings 1024
    assert _generate(tiny_pack, tmp_path / "a.jsonl", "--limit", "1", "--max-new-tokens", "1100") == 1
    assert "exceeds the model's max_position_embeddings (1024)" in capsys.readouterr().err


def test_not_a_pack_is_refused(tmp_path, capsys):
    assert _generate(tmp_path, tmp_path / "a.jsonl", "--limit", "1") == 1
    assert "no manifest.json" in capsys.readouterr().err
