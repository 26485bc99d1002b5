"""IFEval sharding (issue 21 item 4): `generate --shard I/N` + `ifeval merge` equal the unsharded run, prompt by
prompt, and the merge refuses shards that are not one complete split of one configuration."""
import json
import shutil

import pytest

from runmap.cli.main import main
from runmap.conformance.schemas import validate_file
from runmap.ifeval import generate as G
from runmap.ifeval.shard import parse_shard, select_shard

LIMIT = 9  # 3 shards of 3 prompts


def test_split_partitions_every_selection():
    prompts = G.read_prompts(G.DEFAULT_INPUTS)
    assert len(prompts) == 541
    for n in (1, 2, 3, 7, 541):
        parts = [select_shard(prompts, i, n) for i in range(1, n + 1)]
        keys = [p.key for part in parts for p in part]
        assert sorted(keys) == sorted(p.key for p in prompts)  # each prompt in exactly one shard
        assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced
    # depends on the set of prompts only: the same split whatever the file order
    shuffled = list(reversed(prompts))
    assert {p.key for p in select_shard(shuffled, 2, 3)} == {p.key for p in select_shard(prompts, 2, 3)}


@pytest.mark.parametrize("text", ["0/3", "4/3", "3", "a/b", "1/0"])
def test_bad_shard_argument_is_one_line(text):
    with pytest.raises(G.IFEvalGenerateError, match="--shard"):
        parse_shard(text)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("runmap.engine.engine")
    d = tmp_path_factory.mktemp("ifeval_shard")
    assert main(["synth", "--preset", "tiny-olmoe", str(d / "ckpt"), "--no-progress"]) == 0
    assert main(["pack", str(d / "ckpt"), str(d / "pack")]) == 0
    inputs = d / "inputs.jsonl"
    inputs.write_text("".join(G.DEFAULT_INPUTS.read_text().splitlines(keepends=True)[:LIMIT]))

    def gen(out, *extra):
        return main(["ifeval", "generate", "--packed", str(d / "pack"), "--inputs", str(inputs), "--out", str(out),
                     "--executor", "reference", "--max-new-tokens", "6", "--model-name", "tiny-olmoe",
                     "--no-progress", *extra])

    # the unsharded run batches all 9 prompts together; the shards batch 3 (and 2+1) other prompts together
    assert gen(d / "full" / "answers.jsonl", "--batch-size", "9") == 0
    for i in (1, 2, 3):
        assert gen(d / f"shard{i}" / "answers.jsonl", "--batch-size", "2", "--shard", f"{i}/3") == 0
    # a shard made with other settings, for the mismatch test
    assert gen(d / "other2" / "answers.jsonl", "--batch-size", "2", "--max-new-tokens", "5", "--shard", "2/3") == 0
    return d, inputs, gen


def _shards(d, *names):
    return [str(d / n / "answers.jsonl") for n in names]


def _score(inputs, answers, out):
    assert main(["ifeval", "score", "--inputs", str(inputs), "--responses", str(answers), "--out", str(out),
                 "--no-progress"]) == 0
    return [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]


def test_three_shards_merge_to_the_unsharded_run(runs, tmp_path):
    d, inputs, _ = runs
    metas = [json.loads(G.sidecar_path(d / f"shard{i}" / "answers.jsonl").read_text()) for i in (1, 2, 3)]
    assert [m["shard"]["index"] for m in metas] == [1, 2, 3] and [m["counts"]["prompts"] for m in metas] == [3, 3, 3]
    full_meta = json.loads(G.sidecar_path(d / "full" / "answers.jsonl").read_text())
    assert {m["max_seq_len"] for m in metas} == {full_meta["max_seq_len"]}  # the same engine shape as unsharded

    out = tmp_path / "merged" / "answers.jsonl"
    # shard files in any order
    assert main(["ifeval", "merge", "--inputs", str(inputs), "--out", str(out), *_shards(d, "shard3", "shard1", "shard2")]) == 0
    assert validate_file(out, "ifeval-responses") == []
    assert validate_file(G.sidecar_path(out), "ifeval-generation") == []
    merged_meta = json.loads(G.sidecar_path(out).read_text())
    assert merged_meta["status"] == "complete" and merged_meta["counts"] == {"prompts": LIMIT, "answered": LIMIT,
                                                                             "remaining": 0}
    assert [m["index"] for m in merged_meta["merged_from"]] == [1, 2, 3] and "shard" not in merged_meta

    def by_key(path):
        return {r["key"]: r for r in map(json.loads, path.read_text().splitlines())}

    full, merged = by_key(d / "full" / "answers.jsonl"), by_key(out)
    assert sorted(full) == sorted(merged) and len(full) == LIMIT
    for k in full:
        assert (merged[k]["response"], merged[k]["new_tokens"], merged[k]["finish_reason"]) == \
            (full[k]["response"], full[k]["new_tokens"], full[k]["finish_reason"]), k

    res_full = _score(inputs, d / "full" / "answers.jsonl", tmp_path / "score-full")
    res_merged = _score(inputs, out, tmp_path / "score-merged")
    assert res_merged == res_full  # per prompt, in input order: strict and loose follow lists
    s_full = json.loads((tmp_path / "score-full" / "summary.json").read_text())
    s_merged = json.loads((tmp_path / "score-merged" / "summary.json").read_text())
    for k in ("prompt_level", "instruction_level", "by_instruction", "by_category"):
        assert s_merged[k] == s_full[k]
    assert validate_file(tmp_path / "score-merged" / "summary.json", "ifeval-summary") == []


@pytest.mark.parametrize("names, message", [
    (("shard1", "shard3"), "shard(s) 2/3 missing"),
    (("shard1", "shard2", "shard2", "shard3"), "shard 2/3 given twice"),
    (("shard1", "other2", "shard3"), "generation.max_new_tokens is 5 but"),
    (("full",), "not a shard"),
])
def test_merge_refuses_an_incomplete_or_mixed_split(runs, tmp_path, capsys, names, message):
    d, inputs, _ = runs
    out = tmp_path / "answers.jsonl"
    assert main(["ifeval", "merge", "--inputs", str(inputs), "--out", str(out), *_shards(d, *names)]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and not G.sidecar_path(out).exists()  # nothing written


def test_merge_refuses_a_prompt_answered_twice_or_not_at_all(runs, tmp_path, capsys):
    d, inputs, _ = runs
    for i in (1, 2, 3):
        shutil.copytree(d / f"shard{i}", tmp_path / f"s{i}")
    lines = (tmp_path / "s3" / "answers.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "s3" / "answers.jsonl").write_text("".join(lines[1:]))  # shard 3 lost an answer
    out = tmp_path / "answers.jsonl"
    assert main(["ifeval", "merge", "--inputs", str(inputs), "--out", str(out), *_shards(tmp_path, "s1", "s2", "s3")]) == 1
    assert "the shards answer no prompt with key" in capsys.readouterr().err
    # ... and shard 2 carries an answer of shard 1's
    (tmp_path / "s3" / "answers.jsonl").write_text("".join(lines))
    first = (tmp_path / "s1" / "answers.jsonl").read_text().splitlines(keepends=True)[0]
    with open(tmp_path / "s2" / "answers.jsonl", "a") as f:
        f.write(first)
    assert main(["ifeval", "merge", "--inputs", str(inputs), "--out", str(out), *_shards(tmp_path, "s1", "s2", "s3")]) == 1
    assert "already answered at" in capsys.readouterr().err
    assert not out.exists()


def test_merge_refuses_other_inputs(runs, tmp_path, capsys):
    d, inputs, _ = runs
    other = tmp_path / "inputs.jsonl"
    other.write_text("".join(G.DEFAULT_INPUTS.read_text().splitlines(keepends=True)[:LIMIT + 1]))
    assert main(["ifeval", "merge", "--inputs", str(other), "--out", str(tmp_path / "a.jsonl"),
                 *_shards(d, "shard1", "shard2", "shard3")]) == 1
    assert "is not the inputs the shards answered" in capsys.readouterr().err
