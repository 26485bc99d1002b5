"""IFEval scorer: the known answer, determinism, offline use, strict input matching, the letter fix."""
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from runmap.ifeval import score as S
from runmap.cli.main import main

DATA = S.DATA_DIR
GPT4_INPUTS = DATA / "input_data_gpt4_20231107_145030.jsonl"
GPT4_RESPONSES = DATA / "input_response_data_gpt4_20231107_145030.jsonl"


@pytest.fixture(scope="module")
def known_answer_runs(tmp_path_factory):
    """Score the GPT-4 reference pair twice through the CLI."""
    outs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"score{i}")
        assert main(["ifeval", "score", "--inputs", str(GPT4_INPUTS), "--responses", str(GPT4_RESPONSES),
                     "--out", str(out), "--no-progress"]) == 0
        outs.append(out)
    return outs


def test_known_answer_gpt4(known_answer_runs):
    summary = json.loads((known_answer_runs[0] / "summary.json").read_text())
    got = {(level, mode): (summary[level][mode]["followed"], summary[level][mode]["total"])
           for level in ("prompt_level", "instruction_level") for mode in ("strict", "loose")}
    assert got == {
        ("prompt_level", "strict"): (417, 541), ("instruction_level", "strict"): (698, 834),
        ("prompt_level", "loose"): (431, 541), ("instruction_level", "loose"): (714, 834),
    }
    assert summary["prompt_level"]["strict"]["accuracy"] == pytest.approx(417 / 541, abs=1e-6)
    assert summary["generation"] is None  # the reference responses have no generation sidecar


def test_two_runs_give_identical_bytes(known_answer_runs):
    a, b = known_answer_runs
    for name in ("results.jsonl", "summary.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_outputs_conform_to_schemas(known_answer_runs):
    from runmap.conformance.schemas import load_schemas, validate_file

    out = known_answer_runs[0]
    for name, schema in (("summary.json", "ifeval-summary"), ("results.jsonl", "ifeval-result")):
        assert validate_file(out / name, schema) == []
    # the vendored data files are claimed by the input / response schemas and conform
    for path, schema in ((GPT4_INPUTS, "ifeval-inputs"), (GPT4_RESPONSES, "ifeval-responses")):
        assert [s.name for s in load_schemas().matching(path)] == [schema + ".schema.json"]
        assert validate_file(path) == []


def test_results_are_consistent_with_summary(known_answer_runs):
    out = known_answer_runs[0]
    results = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(results) == 541
    inputs = [json.loads(l) for l in GPT4_INPUTS.read_text().splitlines()]
    assert [r["key"] for r in results] == [d["key"] for d in inputs]
    for r in results:
        for s, lo in zip(r["strict"]["follow_instruction_list"], r["loose"]["follow_instruction_list"]):
            assert lo or not s  # the response as is is one of the loose variants
        assert len(r["strict"]["follow_instruction_list"]) == len(r["instruction_id_list"])
    for mode in ("strict", "loose"):
        assert sum(v[mode]["followed"] for v in summary["by_instruction"].values()) == \
            summary["instruction_level"][mode]["followed"]
        assert sum(v[mode]["followed"] for v in summary["by_category"].values()) == \
            summary["instruction_level"][mode]["followed"]
    assert sum(v["total"] for v in summary["by_instruction"].values()) == 834
    assert len(summary["by_instruction"]) == 25


def test_scores_offline_without_any_download(tmp_path):
    """A fresh interpreter with sockets blocked and nltk.download refused still scores everything."""
    script = textwrap.dedent(f"""
        import socket, sys
        def refuse(*a, **k):
            raise OSError("network disabled by the test")
        socket.socket.connect = refuse
        socket.socket.connect_ex = refuse
        socket.create_connection = refuse
        socket.getaddrinfo = refuse
        import nltk, nltk.downloader
        def no_download(*a, **k):
            raise AssertionError("nltk.download was called")
        nltk.download = no_download
        nltk.downloader.download = no_download
        nltk.downloader.Downloader.download = no_download
        from runmap.cli.main import main
        rc = main(["ifeval", "score", "--inputs", {str(GPT4_INPUTS)!r}, "--responses", {str(GPT4_RESPONSES)!r},
                   "--out", {str(tmp_path / "out")!r}, "--no-progress"])
        # the checks only, not the package's dataset API (nltk may still import pandas where it is installed)
        heavy = sorted(m for m in ("datasets", "if_verifiable.api") if m in sys.modules)
        assert not heavy, heavy
        sys.exit(rc)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NLTK_DATA"}
    env["HOME"] = str(tmp_path)  # no ~/nltk_data to fall back on
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["prompt_level"]["strict"]["followed"] == 417
    assert summary["instruction_level"]["loose"]["followed"] == 714


def test_fresh_import_and_scoring_with_download_and_network_refused(monkeypatch, tmp_path):
    """Same as above in this process, with pytest's monkeypatch: the checker modules are imported anew
    (their import-time NLTK resource check included) while downloads and sockets raise."""
    import socket

    import nltk
    import nltk.downloader

    def refuse(*a, **k):
        raise AssertionError("network or download attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(nltk, "download", refuse)
    monkeypatch.setattr(nltk.downloader, "download", refuse)
    monkeypatch.setattr(nltk.downloader.Downloader, "download", refuse)
    monkeypatch.delenv("NLTK_DATA", raising=False)
    monkeypatch.setattr(nltk.data, "path", [p for p in nltk.data.path if "ifeval" not in p])
    for name in [m for m in sys.modules if m.split(".")[0] == S.CHECKER_MODULE.split(".")[0]]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(S, "_CHECKERS", None)
    results, summary = S.score_files(GPT4_INPUTS, GPT4_RESPONSES)
    assert (summary["prompt_level"]["strict"]["followed"], summary["instruction_level"]["loose"]["followed"]) == \
        (417, 714)


def test_nltk_resolves_to_the_vendored_tokenizer():
    import nltk

    S.load_checkers()
    found = Path(nltk.data.find("tokenizers/punkt_tab/english/").path).resolve()
    assert S.NLTK_DATA_DIR.resolve() in found.parents


def test_missing_vendored_nltk_data_is_a_clear_error(tmp_path):
    with pytest.raises(S.IFEvalError, match="punkt_tab"):
        S.configure_nltk(tmp_path)


# ---------------------------------------------------------------- response files that do not match


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    return path


@pytest.fixture()
def small_pair(tmp_path):
    """The first 6 reference prompts and their GPT-4 responses (as text lines)."""
    inputs = GPT4_INPUTS.read_text().splitlines()[:6]
    prompts = {json.loads(l)["prompt"] for l in inputs}
    responses = [l for l in GPT4_RESPONSES.read_text().splitlines() if json.loads(l)["prompt"] in prompts]
    assert len(responses) == 6
    return _write_lines(tmp_path / "inputs.jsonl", inputs), responses, tmp_path


def _score_error(inputs, responses_path, tmp_path, capsys) -> str:
    out = tmp_path / "out"
    rc = main(["ifeval", "score", "--inputs", str(inputs), "--responses", str(responses_path), "--out", str(out),
               "--no-progress"])
    assert rc == 1  # a bad input file is exit 1 like every subcommand (2: usage errors)
    assert not out.exists()  # nothing is written for a file that does not match
    return capsys.readouterr().err


def test_matching_small_pair_scores(small_pair):
    inputs, responses, tmp = small_pair
    results, summary = S.score_files(inputs, _write_lines(tmp / "r.jsonl", responses))
    assert summary["prompt_level"]["strict"]["total"] == 6 and len(results) == 6


def test_missing_response_names_the_input_line(small_pair, capsys):
    inputs, responses, tmp = small_pair
    key3 = json.loads(inputs.read_text().splitlines()[2])["key"]
    err = _score_error(inputs, _write_lines(tmp / "r.jsonl", responses[:2] + responses[3:]), tmp, capsys)
    assert f"key {key3} (inputs line 3)" in err and "no response for 1" in err


def test_extra_prompt_names_the_line(small_pair, capsys):
    inputs, responses, tmp = small_pair
    extra = json.dumps({"prompt": "A prompt that IFEval never asked.", "response": "x"})
    err = _score_error(inputs, _write_lines(tmp / "r.jsonl", responses[:4] + [extra] + responses[4:]), tmp, capsys)
    assert "r.jsonl:5:" in err and "extra prompt" in err


def test_malformed_line_names_the_line(small_pair, capsys):
    inputs, responses, tmp = small_pair
    err = _score_error(inputs, _write_lines(tmp / "r.jsonl", responses[:1] + ['{"prompt": "cut'] + responses[2:]),
                       tmp, capsys)
    assert "r.jsonl:2:" in err and "malformed JSON" in err


def test_duplicate_response_names_both_lines(small_pair, capsys):
    inputs, responses, tmp = small_pair
    err = _score_error(inputs, _write_lines(tmp / "r.jsonl", responses + responses[1:2]), tmp, capsys)
    assert "r.jsonl:7:" in err and "line 2" in err


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "p"}', "missing field 'response'"),
    ('{"prompt": 3, "response": "r"}', "field 'prompt' must be a string"),
    ('["prompt", "response"]', "expected a JSON object"),
    ("", "empty line"),
])
def test_bad_line_kinds(small_pair, capsys, bad, message):
    inputs, responses, tmp = small_pair
    err = _score_error(inputs, _write_lines(tmp / "r.jsonl", responses[:2] + [bad] + responses[2:]), tmp, capsys)
    assert "r.jsonl:3:" in err and message in err


def test_key_field_must_agree(small_pair, capsys):
    inputs, responses, tmp = small_pair
    rec = json.loads(responses[0])
    rec["key"] = -1
    err = _score_error(inputs, _write_lines(tmp / "r.jsonl", [json.dumps(rec)] + responses[1:]), tmp, capsys)
    assert "r.jsonl:1:" in err and "key -1" in err


def test_unknown_instruction_id_names_the_input_line(tmp_path):
    line = json.dumps({"key": 1, "prompt": "p", "instruction_id_list": ["made:up"], "kwargs": [{}]})
    with pytest.raises(S.IFEvalError, match=r"inputs.jsonl:1: unknown instruction id 'made:up'"):
        S.load_inputs(_write_lines(tmp_path / "inputs.jsonl", [line]), known_ids=S.load_checkers().classes)


# ---------------------------------------------------------------- the two determinism traps


def _letter_record(letter: str, n: int) -> S.InputRecord:
    return S.InputRecord(key=1, prompt="p", instruction_id_list=("keywords:letter_frequency",),
                         kwargs=({"letter": letter, "let_frequency": n, "let_relation": "at least"},), line=1)


def test_the_package_alone_would_pick_a_random_letter():
    """Why the wrapper exists: the unwrapped package check replaces '#' by a random a-z letter."""
    base = S.load_checkers().classes["keywords:letter_frequency"].__mro__[1]
    random.seed(1)
    inst = base("keywords:letter_frequency")
    inst.build_description(letter="#", let_frequency=4, let_relation="at least")
    assert inst._letter != "#"


@pytest.mark.parametrize("letter", ["#", "!"])
def test_letter_outside_a_to_z_is_counted_as_given(letter):
    checkers = S.load_checkers()
    text = f"one {letter} two {letter} three {letter} four {letter}."
    for _ in range(20):  # random would flip these on some draw
        assert S.score_prompt(checkers, _letter_record(letter, 4), text)["strict"]["follow_all_instructions"]
        assert not S.score_prompt(checkers, _letter_record(letter, 5), text)["strict"]["follow_all_instructions"]


def test_langdetect_is_seeded():
    import langdetect

    S.load_checkers()
    assert langdetect.DetectorFactory.seed == S.LANGDETECT_SEED


# ---------------------------------------------------------------- loose variants


@settings(max_examples=60)
@given(st.text(alphabet=st.sampled_from("ab *\n"), max_size=30))
def test_loose_variants(text):
    v = S.response_variants(text)
    assert len(v) == 8 and v[0] == text
    lines = text.split("\n")
    assert v[1] == "\n".join(lines[1:]).strip() and v[2] == "\n".join(lines[:-1]).strip()
    assert v[3] == "\n".join(lines[1:-1]).strip()
    assert v[4:] == [x.replace("*", "") for x in v[:4]] and all("*" not in x for x in v[4:])


def test_loose_accepts_a_response_whose_first_line_breaks_the_rule():
    checkers = S.load_checkers()
    rec = S.InputRecord(key=7, prompt="p", instruction_id_list=("change_case:english_lowercase",), kwargs=({},),
                        line=1)
    resp = "Sure! Here it is:\nthis whole answer is written in plain lowercase english words and nothing else."
    r = S.score_prompt(checkers, rec, resp)
    assert r["strict"]["follow_instruction_list"] == [False] and r["loose"]["follow_instruction_list"] == [True]


def test_empty_response_follows_nothing():
    checkers = S.load_checkers()
    rec = S.InputRecord(key=7, prompt="p", instruction_id_list=("punctuation:no_comma",), kwargs=({},), line=1)
    r = S.score_prompt(checkers, rec, "   \n ")
    assert r["strict"]["follow_instruction_list"] == [False] and r["loose"]["follow_instruction_list"] == [False]


def test_undetectable_language_counts_as_followed_and_logs_nothing(caplog):
    """As in the reference, a response whose language cannot be detected follows the language rule; the
    package's ERROR line for it (logged through the root logger) is silenced."""
    import logging

    checkers = S.load_checkers()
    rec = S.InputRecord(key=9, prompt="p", instruction_id_list=("language:response_language",),
                        kwargs=({"language": "de"},), line=1)
    with caplog.at_level(logging.DEBUG):
        r = S.score_prompt(checkers, rec, "12345 67 !!!")  # no letters: langdetect raises
    assert r["strict"]["follow_instruction_list"] == [True]
    assert not caplog.records, [x.getMessage()[:80] for x in caplog.records]
    assert S.score_prompt(checkers, rec, "This answer is plainly written in English.")["strict"][
        "follow_instruction_list"] == [False]


def test_responses_of_a_limited_generation_are_scored_on_its_prompts(tmp_path, capsys):
    """`ifeval generate --limit N` answers the first N prompts: score takes N from the sidecar (or --limit) and scores
    those prompts; without either, the missing answers are an error naming them."""
    inputs = [json.loads(l) for l in GPT4_INPUTS.read_text().splitlines()[:3]]
    by_prompt = {r["prompt"]: r for r in map(json.loads, GPT4_RESPONSES.read_text().splitlines())}
    responses = tmp_path / "answers.jsonl"
    responses.write_text("".join(json.dumps(by_prompt[r["prompt"]]) + "\n" for r in inputs))
    argv = ["ifeval", "score", "--inputs", str(GPT4_INPUTS), "--responses", str(responses), "--no-progress"]

    assert main(argv + ["--out", str(tmp_path / "none")]) == 1
    assert "no response for 538 input prompt(s)" in capsys.readouterr().err
    assert main(argv + ["--out", str(tmp_path / "flag"), "--limit", "3"]) == 0
    assert json.loads((tmp_path / "flag" / "summary.json").read_text())["inputs"]["prompts"] == 3
    S.sidecar_path(responses).write_text(json.dumps(
        {"status": "complete", "inputs": {"path": str(GPT4_INPUTS), "sha256": S.sha256_file(GPT4_INPUTS), "limit": 3}}))
    assert main(argv + ["--out", str(tmp_path / "sidecar")]) == 0
    summary = json.loads((tmp_path / "sidecar" / "summary.json").read_text())
    assert summary["inputs"]["prompts"] == 3 and summary["prompt_level"]["strict"]["total"] == 3
    flagged = json.loads((tmp_path / "flag" / "summary.json").read_text())
    assert summary["prompt_level"] == flagged["prompt_level"] and summary["inputs"]["limit"] == 3
    from runmap.conformance.schemas import validate_file

    assert validate_file(tmp_path / "flag" / "summary.json", "ifeval-summary") == []  # (limit recorded)
    assert main(argv + ["--out", str(tmp_path / "other"), "--limit", "2"]) == 1  # not what was generated
    assert "answer the first 3 prompts" in capsys.readouterr().err
    cut = tmp_path / "first-3.jsonl"  # the inputs cut to the generated prompts: the same prompts are scored
    cut.write_text("".join(GPT4_INPUTS.read_text().splitlines(keepends=True)[:3]))
    assert main(argv[:3] + [str(cut)] + argv[4:] + ["--out", str(tmp_path / "cut")]) == 0
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["prompt_level"] == summary["prompt_level"]
