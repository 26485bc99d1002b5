"""benchmarks/serve_load.py on the CPU: the load benchmark of `runmap serve` over the tiny synthetic OLMoE pack
(reference executor), with two client counts and 3 s windows.

What is checked: the record is written under serve/load/, is claimed by schemas/serve-load.schema.json and
validates; its numbers agree with each other (tokens generated, the server's count against the clients'
count, p99 >= p50, every client completed requests, no errors, ratio = served / offline at the batch of the
client count); the table is printed and the plot written; the offline measurement, which runs on the
server's own engine between scheduler steps, leaves the server answering a greedy request exactly as before
(the record's first_request.answer_unchanged_at_end);
--help explains, and bad input gets one line and exit status 1 or 2, no traceback. About 45 s on two idle cores.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "serve_load.py"
CLIENTS = (1, 3)
MAX_TOKENS = 8
DURATION_S = 3.0
MAX_PROMPT_TOKENS = 100  # below the tiny tokenizer's median IFEval prompt: some prompts must be passed over


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """Only the tiny OLMoE pack (build_packs of test_model_support builds every preset)."""
    from runmap.arch.config import load_preset
    from runmap.format.pack import pack_checkpoint
    from runmap.synth.checkpoint import write_synthetic

    root = tmp_path_factory.mktemp("serve-load-pack")
    ck = write_synthetic(load_preset("tiny-olmoe")[0], root / "ck", seed=3)
    pack_checkpoint(ck, root / "pk", device="cpu")
    return root / "pk"


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=_env(), timeout=timeout)


@pytest.fixture(scope="module")
def bench_run(pack, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-load") / "results" / "serve" / "load" / "tiny.json"
    png = out.with_suffix(".png")
    r = _run("--packed", pack, "--out", out, "--plot", png, "--executor", "reference", "--device", "cpu",
             "--clients", ",".join(map(str, CLIENTS)), "--duration-s", DURATION_S, "--max-tokens", MAX_TOKENS,
             "--max-seq-len", 256, "--max-prompt-tokens", MAX_PROMPT_TOKENS, "--num-prompts", 8, "--offline-repeats", 2, "--client-procs", 2,
             "--label", "cpu test")
    assert r.returncode == 0, r.stdout + r.stderr
    return {"proc": r, "out": out, "png": png, "rec": json.loads(out.read_text())}


def test_the_record_validates_against_its_schema(bench_run):
    from runmap.conformance.schemas import load_schemas, validate_file

    claimed = [s.name for s in load_schemas().matching(bench_run["out"])]
    assert claimed == ["serve-load.schema.json"], claimed
    assert validate_file(bench_run["out"]) == []
    assert not [p for p in bench_run["out"].parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_record_names_the_workload_pack_residency_and_command(bench_run, pack):
    rec = bench_run["rec"]
    assert rec["command"].startswith("python3 benchmarks/serve_load.py --packed ")
    assert rec["pack"]["dir"] == str(pack) and rec["pack"]["arch"] == "olmoe"
    assert rec["residency"] == {"regime": "full", "resident": 8, "num_experts": 8, "asked": "full"}
    w = rec["workload"]
    assert w["max_tokens"] == MAX_TOKENS and w["clients"] == list(CLIENTS) and w["num_prompts"] == 8
    assert w["prompt_source"] == "data/ifeval/input_data.jsonl" and w["client"].startswith("openai ")
    assert 1 <= w["prompt_tokens"]["min"] <= w["prompt_tokens"]["max"] <= MAX_PROMPT_TOKENS
    assert w["max_prompt_tokens"] == MAX_PROMPT_TOKENS and w["prompts_skipped_too_long"] > 0
    assert rec["server"]["host"] == "127.0.0.1" and rec["server"]["max_batch"] == max(CLIENTS)
    assert rec["label"] == "cpu test" and rec["complete"] is True
    first = rec["server"]["first_request"]
    assert first["error"] is None and 0 < first["ttft_s"] <= first["e2e_s"] and 0 < first["completion_tokens"] <= MAX_TOKENS
    # the offline runs share the served engine: the first request sent again at the end gets the same answer
    assert first["answer_unchanged_at_end"] is True


def test_the_numbers_of_each_point_agree(bench_run):
    rec = bench_run["rec"]
    assert [p["clients"] for p in rec["points"]] == list(CLIENTS)
    for p in rec["points"]:
        c = p["clients"]
        assert p["errors"] == 0, p["error_samples"]
        assert p["duration_s"] == pytest.approx(DURATION_S, abs=0.3)
        assert p["generated_tokens"] > 0 and p["tok_s"] == pytest.approx(p["generated_tokens"] / p["duration_s"])
        # the server's counter and the clients' usage agree up to the tokens in flight at the window's edges
        assert abs(p["client_tokens"] - p["generated_tokens"]) <= 0.1 * p["generated_tokens"] + c * MAX_TOKENS
        assert p["requests"] >= c and p["requests_started"] >= p["requests"]
        assert p["completion_tokens_per_request"]["max"] <= MAX_TOKENS
        for key in ("ttft_s", "itl_s"):
            d = p[key]
            assert d["n"] > 0 and 0 <= d["p50"] <= d["p99"] <= d["max"], (key, d)
        assert p["ttft_s"]["n"] >= p["requests"]
        off = p["offline"]
        assert off["batch"] == c and off["ignore_eos"] is True and off["repeats"] == 2
        assert off["new_tokens"] == c * MAX_TOKENS  # EOS ignored: every row decodes max_tokens
        assert off["decode_tok_s"]["min"] <= off["decode_tok_s"]["median"] <= off["decode_tok_s"]["max"]
        assert p["ratio_to_offline"] == pytest.approx(p["tok_s"] / off["decode_tok_s"]["median"])
        assert 0 < p["mean_running_rows"] <= c
        assert p["ratio_to_offline_e2e"] == pytest.approx(p["tok_s"] / off["e2e_tok_s"]["median"])
        assert p["kernel_compiles"] is None  # on the CPU nothing is compiled: not observed, not zero
        e = p["engine_thread"]
        # the engine thread's time accounts for the window (the sampling edges aside) and it did run the requests
        parts = [e[k] for k in ("admit_s", "step_s", "stats_s", "calls_s", "idle_s")]
        assert all(v >= 0 for v in parts) and sum(parts) == pytest.approx(p["duration_s"], abs=0.5)
        # the offline measurement runs through Scheduler.call after the window, not in it
        assert e["calls_s"] < 0.5 * p["duration_s"]
        assert e["step_s"] > 0 and e["admit_s"] > 0 and e["steps"] > 0
        # a join in progress at either edge of the window may be counted by one and not the other
        assert 1 <= e["joins"] <= e["admitted"] and abs(e["queue_wait_s"]["n"] - e["admitted"]) <= 2 * c
        # the default join mode (whole): no join ran beside or inside the decode steps
        assert e["interleaved_joins"] == e["concurrent_joins"] == e["mixed_joins"] == 0
        assert 0 <= e["queue_wait_s"]["p50"] <= e["queue_wait_s"]["max"]
        # the host's CPU over the window: the benchmark's process and the clients worked, and the clients came back
        cpu, gap = p["cpu_s"], p["client_gap_s"]
        assert cpu["bench_process"] > 0 and cpu["client_processes"] > 0 and cpu["engine_process"] is None
        assert gap["n"] >= 1 and 0 <= gap["p50"] <= gap["max"] < p["duration_s"]
    assert rec["server"]["kernel_compiles_after_ready"] is None
    assert rec["targets"]["checks"] == []  # neither 8 nor 32 clients ran


def test_the_table_and_the_plot(bench_run):
    out = bench_run["proc"].stdout
    assert "clients" in out and "ratio" in out and f"wrote {bench_run['out']}" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in {str(c) for c in CLIENTS}]
    # the main table, the engine thread's share of each window, then the host's cores and the clients' turnaround: a
    # row per client count in each
    n = len(CLIENTS)
    assert [r[0] for r in rows] == [str(c) for c in CLIENTS] * 3
    assert "engine thread:" in out and all(len(r) == 10 for r in rows[n:2 * n])
    assert "host cores" in out and all(len(r) == 6 for r in rows[2 * n:])
    assert bench_run["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _module():
    spec = importlib.util.spec_from_file_location("serve_load_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_explains_what_is_measured():
    r = _run("--help", timeout=60)
    assert r.returncode == 0, r.stderr
    for words in ("--clients", "--duration-s", "--resident", "ratio_to_offline", "time to first token",
                  "inter-token latency", "127.0.0.1", "Exit status"):
        assert words in r.stdout, words


@pytest.mark.parametrize("args, status, message", [
    (["--packed", "{tmp}", "--out", "{tmp}/r.json"], 1, "not a runmap pack"),
    (["--packed", "{pack}", "--out", "{tmp}"], 1, "is a directory"),
    (["--packed", "{pack}", "--out", "{tmp}/r.json", "--prompts", "{tmp}/none.jsonl"], 1, "cannot read"),
    (["--packed", "{pack}", "--out", "{tmp}/r.json", "--num-prompts", "100000"], 1, "has only"),
    (["--packed", "{pack}", "--out", "{tmp}/file/r.json"], 1, "cannot create"),
    (["--packed", "{pack}", "--out", "{tmp}/r.json", "--clients", "1,x"], 2, "comma-separated client counts"),
    (["--packed", "{pack}", "--out", "{tmp}/r.json", "--clients", "8,8"], 2, "repeat"),
    (["--packed", "{pack}", "--out", "{tmp}/r.json", "--duration-s", "0"], 2, "> 0"),
])
def test_bad_input_gets_one_line(pack, tmp_path, args, status, message, capsys):
    mod = _module()  # in this process: a subprocess per case would import torch each time
    (tmp_path / "file").write_text("a file, not a folder")
    argv = [a.format(tmp=tmp_path, pack=pack) for a in args]
    try:
        rc = mod.main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == status, err
    assert message in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("serve_load")]) == 1, err
    assert not (tmp_path / "r.json").exists()
