"""llama.cpp as a peer (issue 25 item 5): llama-bench's JSON output -> records, and the pre-tokenizer answer.

* a hand-written llama-bench ``-o json`` sample (the fields of the pinned llama.cpp's llama-bench: full GPU and
  --n-cpu-moe 8, tg128 at batch 1) becomes one record per test, with n_cpu_moe, tok/s mean / stdev / samples,
  the command, the model and build facts, and the records validate against schemas/llama-cpp-bench.schema.json
  where `runmap validate` finds them (results/llama-cpp/**/records/);
* input that is not llama-bench's JSON (not JSON, markdown, a dict, an empty list, a missing or unmeasured field)
  gives one LlamaBenchError naming the file and what is wrong; benchmarks/llama_cpp_records.py writes the good
  files' records, prints one line for a bad file and exits 1;
* synthetic_pre_tokenizer answers "gpt-2" for the synthetic tokenizer runmap synth writes (ByteLevel, GPT-2 regex,
  no normalizer, BPE) and refuses a checkpoint that is not synthetic or splits text otherwise.
Under a second; no llama.cpp needed (tests/test_llama_cpp_convert.py runs the converter itself).
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from runmap.bench.llama_cpp import (KIND, PRE_TOKENIZER, RECORD_VERSION, LlamaBenchError, PreTokenizerError,
                                    records_from_batched_bench, records_from_llama_bench, synthetic_pre_tokenizer)
from runmap.conformance.schemas import validate_document

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "llama_cpp_records.py"


def _row(n_cpu_moe: int, avg_ts: float, stddev_ts: float, samples: list[float]) -> dict:
    """One test as the pinned llama-bench prints it with -o json (every field, in its order)."""
    return {
        "build_commit": "0c1e570", "build_number": 0,
        "cpu_info": "INTEL(R) XEON(R) PLATINUM 8568Y+", "gpu_info": "NVIDIA H200", "backends": "CUDA",
        "model_filename": "/tmp/runmap-llama/olmoe-1b-7b-0924-Q4_K_M.gguf", "model_type": "olmoe A1.7B Q4_K - Medium",
        "model_size": 4212186112, "model_n_params": 6919161856, "n_batch": 1, "n_ubatch": 1, "n_threads": 8,
        "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99,
        "n_cpu_moe": n_cpu_moe, "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False, "flash_attn": 1,
        "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "auto",
        "lazy_mode": "auto", "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True,
        "fit_target": 0, "fit_min_ctx": 0, "n_prompt": 0, "n_gen": 128, "n_depth": 0,
        "test_time": "2026-12-02T09:00:00Z", "avg_ns": int(128e9 / avg_ts), "stddev_ns": 1000000,
        "avg_ts": avg_ts, "stddev_ts": stddev_ts,
        "samples_ns": [int(128e9 / s) for s in samples], "samples_ts": samples,
    }


SAMPLE = [_row(0, 601.25, 3.1, [598.0, 600.5, 604.9, 603.1, 599.8]),
          _row(8, 175.4, 7.9, [166.2, 170.0, 178.1, 180.3, 182.4])]
COMMAND = ("/tmp/runmap-llama/build/bin/llama-bench -m /tmp/runmap-llama/olmoe-1b-7b-0924-Q4_K_M.gguf "
           "-p 0 -n 128 -b 1 -ngl 99 -fa 1 -ncmoe 8 -o json")
CONTEXT = {
    "preset": "olmoe-1b-7b-0924", "arch": "olmoe", "num_layers": 16, "experts_per_layer": 64, "top_k": 8,
    "quant": "Q4_K_M",
    "gguf": {"file": "olmoe-1b-7b-0924-Q4_K_M.gguf", "bytes": 4224000000, "converted_from": "bf16 GGUF",
             "converter": "convert_hf_to_gguf.py via benchmarks/llama_cpp_convert.py", "pre_tokenizer": "gpt-2"},
    "workload": {"weights": "synthetic", "seed": 0, "init": "routing", "routing": "model",
                 "tokens": "llama-bench tg: random token ids", "note": "speed only"},
    "llama_cpp": {"package": "llama-cpp-python", "version": "0.3.36",
                  "sdist_sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
                  "commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
                  "build_flags": ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DGGML_CUDA_FA=ON"]},
    "created_utc": "2026-12-02T09:01:00Z",
}


def test_a_llama_bench_sample_becomes_one_record_per_test():
    recs = records_from_llama_bench(json.dumps(SAMPLE, indent=2), command=COMMAND, context=CONTEXT, source="s.json")
    assert [r["config"]["n_cpu_moe"] for r in recs] == [0, 8]
    full, ncmoe8 = recs
    assert full["kind"] == KIND == "llama.cpp" and full["record_version"] == RECORD_VERSION
    assert full["id"] == "olmoe-1b-7b-0924__llama.cpp__q4_k_m__tg128__b1__ncmoe0"
    assert ncmoe8["id"].endswith("__ncmoe8") and ncmoe8["config"]["expert_layers_on_cpu"] == 8
    assert full["timing"]["tok_s"] == {"mean": 601.25, "stdev": 3.1, "samples": [598.0, 600.5, 604.9, 603.1, 599.8]}
    assert ncmoe8["timing"]["tok_s"]["mean"] == 175.4 and ncmoe8["timing"]["tok_s"]["stdev"] == 7.9
    c = full["config"]
    assert (c["test"], c["prompt_len"], c["decode_len"], c["batch"], c["n_batch"], c["repeats"]) == ("tg128", 0, 128, 1, 1, 5)
    assert c["n_gpu_layers"] == 99 and c["flash_attn"] == 1 and c["n_threads"] == 8
    assert full["model"]["quant"] == "Q4_K_M" and full["model"]["model_size_bytes"] == 4212186112
    assert full["model"]["pre_tokenizer"] == "gpt-2" and full["model"]["gguf_bytes"] == 4224000000
    assert full["llama_cpp"]["build_commit"] == "0c1e570" and full["llama_cpp"]["backends"] == "CUDA"
    assert full["llama_cpp"]["commit"] == CONTEXT["llama_cpp"]["commit"]
    assert full["device"]["gpu"] == "NVIDIA H200"
    assert full["workload"]["routing"] == "model" and full["workload"]["weights"] == "synthetic"
    assert full["command"] == COMMAND and full["raw"] == SAMPLE[0]
    assert records_from_llama_bench(SAMPLE, command=COMMAND, context=CONTEXT) == recs  # parsed list or text


BATCHED_COMMAND = ("/tmp/runmap-llama/build/bin/llama-batched-bench -m /tmp/runmap-llama/olmoe-1b-7b-0924-Q4_K_M.gguf "
                   "-c 4096 -b 512 -ub 512 -npp 32 -ntg 128 -npl 8 -ngl 99 -fa on -ncmoe 12 --output-format jsonl")
BATCHED_OUT = """llama_model_loader: loaded meta data with 31 key-value pairs
main: n_kv_max = 4096, n_batch = 512, n_ubatch = 512, flash_attn = 1
{"n_kv_max": 4096, "n_batch": 512, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99, \
"n_threads": 16, "n_threads_batch": 16, "pp": 32, "tg": 128, "pl": 8, "n_kv": 1280, "t_pp": 0.031, \
"speed_pp": 8258.1, "t_tg": 2.048, "speed_tg": 500.0, "t": 2.079, "speed": 615.7}
llama_perf_context_print:        load time =     812.22 ms
"""


def test_a_batched_bench_line_becomes_a_record_of_its_batch_with_llama_bench_model_facts():
    (rec,) = records_from_batched_bench(BATCHED_OUT, command=BATCHED_COMMAND, context=CONTEXT, model_row=SAMPLE[0])
    assert rec["id"] == "olmoe-1b-7b-0924__llama.cpp__q4_k_m__tg128__pl8__ncmoe12"
    c = rec["config"]
    assert (c["n_cpu_moe"], c["expert_layers_on_cpu"], c["batch"], c["decode_len"], c["n_depth"], c["repeats"]) == \
        (12, 12, 8, 128, 32, 1)
    assert rec["timing"]["tok_s"] == {"mean": 500.0, "stdev": 0.0, "samples": [500.0]}
    assert rec["timing"]["seconds_tg"] == 2.048 and rec["command"] == BATCHED_COMMAND
    assert rec["model"]["model_size_bytes"] == SAMPLE[0]["model_size"]
    assert validate_document(rec, "llama-cpp-bench") == []


@pytest.mark.parametrize("text, says", [
    ("llama_model_loader: nothing measured\n", "no result line"),
    ('{"speed_tg": 5.0, "pl": 8}\n', "missing field"),
    (BATCHED_OUT.replace('"speed_tg": 500.0', '"speed_tg": 0'), "not a measured generation rate"),
    ('{"speed_tg": 5.0, oops\n', "not JSON"),
])
def test_bad_batched_bench_output_gives_one_clear_error(text, says):
    with pytest.raises(LlamaBenchError, match=says):
        records_from_batched_bench(text, command=BATCHED_COMMAND, context=CONTEXT, model_row=SAMPLE[0])


def test_the_records_validate_where_runmap_validate_finds_them(tmp_path):
    from runmap.atomic import write_json
    from runmap.conformance.schemas import load_schemas, validate_file, validate_tree

    d = tmp_path / "results" / "llama-cpp" / "h200" / "records"
    for rec in records_from_llama_bench(SAMPLE, command=COMMAND, context=CONTEXT):
        write_json(d / f"{rec['id']}.json", rec)
    files = sorted(d.glob("*.json"))
    assert len(files) == 2
    for f in files:
        assert [s.name for s in load_schemas().matching(f)] == ["llama-cpp-bench.schema.json"]
        assert validate_file(f) == []
    report = validate_tree(tmp_path / "results")
    assert not report.warnings and len(report.checked) == 2 and all(not r.violations for r in report.checked)
    bad = json.loads(files[0].read_text())
    bad["config"]["n_cpu_moe"] = -1
    bad["kind"] = "engine"
    files[0].write_text(json.dumps(bad))
    assert {v.json_path for v in validate_file(files[0])} == {"$.kind", "$.config.n_cpu_moe"}


def _without(field):
    rows = copy.deepcopy(SAMPLE)
    del rows[1][field]
    return json.dumps(rows)


def _with(field, value):
    rows = copy.deepcopy(SAMPLE)
    rows[0][field] = value
    return rows


MARKDOWN = "| model | size | params | backend | ngl | test | t/s |\n| --- | --- | --- | --- | --- | --- | --- |\n"


@pytest.mark.parametrize("data, says", [
    ("", "not JSON"),
    (MARKDOWN, "not JSON (line 1 column 1"),
    (json.dumps({"avg_ts": 1.0}), "expected a JSON list of tests"),
    ("[]", "an empty list: llama-bench ran no test"),
    (_without("avg_ts"), "test 1: missing field(s) avg_ts"),
    (_without("n_cpu_moe"), "test 1: missing field(s) n_cpu_moe"),
    (json.dumps([1, 2]), "test 0: expected a JSON object, got int"),
    (_with("avg_ts", 0.0), "test 0: avg_ts 0.0"),
    (_with("samples_ts", []), "test 0: samples_ts []"),
    (_with("n_cpu_moe", "8"), "test 0: field n_cpu_moe is '8', expected int"),
    (_with("n_gen", 0), "n_prompt 0 and n_gen 0: no test"),
])
def test_bad_input_gives_one_clear_error(data, says):
    with pytest.raises(LlamaBenchError) as e:
        records_from_llama_bench(data, command=COMMAND, context=CONTEXT, source="runs/ncmoe-8.json")
    msg = str(e.value)
    assert msg.startswith("runs/ncmoe-8.json: ") and says in msg, msg
    assert "\n" not in msg


def test_the_context_and_command_are_required():
    with pytest.raises(ValueError, match="context lacks quant"):
        records_from_llama_bench(SAMPLE, command=COMMAND, context={k: v for k, v in CONTEXT.items() if k != "quant"})
    with pytest.raises(ValueError, match="command must be"):
        records_from_llama_bench(SAMPLE, command=" ", context=CONTEXT)


def test_the_records_script_keeps_going_past_a_bad_file(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "ncmoe-0.json").write_text(json.dumps(SAMPLE[:1]))
    (runs / "ncmoe-0.cmd").write_text(COMMAND.replace("-ncmoe 8", "-ncmoe 0") + "\n")
    (runs / "ncmoe-4.json").write_text("main: error: failed to load model\n")
    (runs / "ncmoe-4.cmd").write_text(COMMAND.replace("-ncmoe 8", "-ncmoe 4") + "\n")
    (runs / "batched-ncmoe-12.jsonl").write_text(BATCHED_OUT)
    (runs / "batched-ncmoe-12.cmd").write_text(BATCHED_COMMAND + "\n")
    source = tmp_path / "RUNMAP_SOURCE.json"
    source.write_text(json.dumps({"package": "llama-cpp-python", "version": "0.3.36",
                                  "sdist_sha256": CONTEXT["llama_cpp"]["sdist_sha256"],
                                  "llama_cpp_commit": CONTEXT["llama_cpp"]["commit"]}))
    out = tmp_path / "results" / "llama-cpp" / "t" / "records"
    r = subprocess.run([sys.executable, str(SCRIPT), "--preset", "olmoe-1b-7b-0924", "--gguf", str(tmp_path / "x.gguf"),
                        "--quant", "Q4_K_M", "--source", str(source), "--build-flags=-DGGML_CUDA=ON -DGGML_CUDA_FA=ON",
                        "--out-dir", str(out), str(runs / "batched-ncmoe-12.jsonl"), str(runs / "ncmoe-0.json"),
                        str(runs / "ncmoe-4.json")],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    skipped = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert len(skipped) == 1 and "ncmoe-4.json: not JSON" in skipped[0]
    (batched_file,) = out.glob("*__pl8__*.json")  # its model facts from the llama-bench run, given after it
    assert json.loads(batched_file.read_text())["config"]["batch"] == 8
    (rec_file,) = out.glob("*__b1__*.json")
    rec = json.loads(rec_file.read_text())
    assert rec["config"]["n_cpu_moe"] == 0 and rec["command"].endswith("-ncmoe 0 -o json")
    assert rec["config"]["num_layers"] == 16 and rec["config"]["experts_per_layer"] == 64
    assert rec["llama_cpp"]["build_flags"] == ["-DGGML_CUDA=ON", "-DGGML_CUDA_FA=ON"]
    assert rec["model"]["gguf_bytes"] is None  # the GGUF is not on this machine
    from runmap.conformance.schemas import validate_file
    assert validate_file(rec_file) == []


# --- the pre-tokenizer answer ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synthetic_tokenizer_dir(tmp_path_factory):
    """config.json and the tokenizer files of a tiny synthetic OLMoE checkpoint (no weights: not needed here)."""
    from runmap.arch.config import load_preset
    from runmap.synth.tokenizer import write_tokenizer

    cfg = load_preset("tiny-olmoe")[0]
    d = tmp_path_factory.mktemp("synth-tok")
    write_tokenizer(cfg, d)
    hf = cfg.to_hf_dict()
    hf["runmap_synthetic"] = {"seed": 0, "expert_layout": "per-expert", "generator_device": "cpu"}
    (d / "config.json").write_text(json.dumps(hf))
    return d


def test_the_synthetic_tokenizer_is_answered_gpt2(synthetic_tokenizer_dir):
    assert synthetic_pre_tokenizer(synthetic_tokenizer_dir) == PRE_TOKENIZER == "gpt-2"


def _copy_with(src: Path, dst: Path, config=None, tokenizer=None) -> Path:
    dst.mkdir()
    c = json.loads((src / "config.json").read_text())
    t = json.loads((src / "tokenizer.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(c) if config else c))
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer(t) if tokenizer else t))
    return dst


def _drop(d, key):
    d.pop(key)
    return d


@pytest.mark.parametrize("config, tokenizer, says", [
    (lambda c: _drop(c, "runmap_synthetic"), None, "not a runmap synthetic checkpoint"),
    (None, lambda t: {**t, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}}, "pre_tokenizer type 'Metaspace'"),
    (None, lambda t: {**t, "pre_tokenizer": {**t["pre_tokenizer"], "use_regex": False}}, "without use_regex"),
    (None, lambda t: {**t, "pre_tokenizer": {**t["pre_tokenizer"], "add_prefix_space": True}}, "add_prefix_space"),
    (None, lambda t: {**t, "normalizer": {"type": "NFC"}}, "a normalizer (NFC)"),
    (None, lambda t: {**t, "model": {**t["model"], "type": "Unigram"}}, "model 'Unigram', not BPE"),
])
def test_other_tokenizers_are_refused(synthetic_tokenizer_dir, tmp_path, config, tokenizer, says):
    d = _copy_with(synthetic_tokenizer_dir, tmp_path / "ck", config, tokenizer)
    with pytest.raises(PreTokenizerError, match=says.replace("(", r"\(").replace(")", r"\)")):
        synthetic_pre_tokenizer(d)


def test_a_missing_tokenizer_is_refused(tmp_path):
    with pytest.raises(PreTokenizerError, match="cannot read"):
        synthetic_pre_tokenizer(tmp_path)
