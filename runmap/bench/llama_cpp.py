"""llama.cpp as a peer in the H200 campaign (issue 25 item 5): its records, and how its converter is told which
pre-tokenizer our synthetic tokenizer uses.

``benchmarks/llama_cpp_h200.sh`` builds llama.cpp from the pinned `llama-cpp-python` sdist's source
(``benchmarks/llama_cpp_source.py``), converts the campaign's synthetic checkpoint to GGUF Q4_K_M with llama.cpp's
own converter, runs ``llama-bench`` full-GPU and with ``--n-cpu-moe N``, and turns llama-bench's JSON output
(``-o json``: a list of one object per test) into one record per test with :func:`records_from_llama_bench`
(``schemas/llama-cpp-bench.schema.json``, ``kind: "llama.cpp"``).

The pre-tokenizer check. ``convert_hf_to_gguf.py`` encodes a fixed text with the checkpoint's tokenizer, hashes
the token ids and looks the hash up in a list of known tokenizers, to write ``tokenizer.ggml.pre`` (the regex
llama.cpp splits text with before BPE); an unknown hash is refused (``NotImplementedError: BPE pre-tokenizer was
not recognized``). The synthetic tokenizer (``runmap/synth/tokenizer.py``) learns its own merges, so its hash is
in no list. Its pre-tokenizer is ``tokenizers``' ByteLevel with ``use_regex`` (GPT-2's split regex), no
normalizer, a BPE model: exactly what llama.cpp's ``gpt-2`` pre-tokenizer type implements (the same regex as
``olmo``, the real OLMoE's). :func:`synthetic_pre_tokenizer` checks those properties in the checkpoint's
``tokenizer.json`` and answers ``"gpt-2"``; ``benchmarks/llama_cpp_convert.py`` gives that answer to the
converter only when its own hash lookup fails, and only for a runmap synthetic checkpoint. The answer changes no
weight and no routing: llama-bench's generation test feeds random token ids and never tokenizes text.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

RECORD_VERSION = "llama-cpp-bench-v1"
KIND = "llama.cpp"
PRE_TOKENIZER = "gpt-2"
# What each llama-bench JSON object must carry for a record (the other fields are kept under raw).
REQUIRED_FIELDS = {
    "build_commit": str, "model_filename": str, "model_type": str, "model_size": int, "model_n_params": int,
    "n_batch": int, "n_threads": int, "n_gpu_layers": int, "n_cpu_moe": int, "n_prompt": int, "n_gen": int,
    "avg_ts": (int, float), "stddev_ts": (int, float), "samples_ts": list,
}
CONTEXT_KEYS = ("preset", "arch", "num_layers", "experts_per_layer", "top_k", "quant", "gguf", "workload",
                "llama_cpp", "created_utc")


class LlamaBenchError(ValueError):
    """llama-bench output that cannot become records: one message naming the source and what is wrong."""


class PreTokenizerError(ValueError):
    """A checkpoint whose tokenizer is not one the synthetic pre-tokenizer answer applies to."""


def synthetic_pre_tokenizer(checkpoint: str | Path) -> str:
    """The ``tokenizer.ggml.pre`` value for a runmap synthetic checkpoint (``PRE_TOKENIZER``), after checking that
    it is one (``runmap_synthetic`` in config.json) and that its tokenizer.json splits text the way llama.cpp's
    ``gpt-2`` type does: ByteLevel pre-tokenizer with GPT-2's regex, no prefix space, no normalizer, BPE model.
    Raises PreTokenizerError saying which property is missing."""
    ck = Path(checkpoint)
    try:
        config = json.loads((ck / "config.json").read_text())
        tok = json.loads((ck / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PreTokenizerError(f"{ck}: cannot read config.json / tokenizer.json: {e}") from e
    if "runmap_synthetic" not in config:
        raise PreTokenizerError(f"{ck}: not a runmap synthetic checkpoint (no runmap_synthetic in config.json); "
                                "the converter's own pre-tokenizer check applies")
    pre = tok.get("pre_tokenizer") or {}
    problems = []
    if pre.get("type") != "ByteLevel":
        problems.append(f"pre_tokenizer type {pre.get('type')!r}, not ByteLevel")
    if pre.get("use_regex", True) is not True:
        problems.append("ByteLevel without use_regex (no GPT-2 split)")
    if pre.get("add_prefix_space", False) is not False:
        problems.append("ByteLevel with add_prefix_space")
    if tok.get("normalizer") is not None:
        problems.append(f"a normalizer ({(tok['normalizer'] or {}).get('type')})")
    if (tok.get("model") or {}).get("type") != "BPE":
        problems.append(f"model {(tok.get('model') or {}).get('type')!r}, not BPE")
    if problems:
        raise PreTokenizerError(f"{ck}/tokenizer.json: not GPT-2's byte-level pre-tokenization: {'; '.join(problems)}")
    return PRE_TOKENIZER


def llama_bench_test_name(n_prompt: int, n_gen: int) -> str:
    """llama-bench's name of a test: tg128, pp512, pp512+tg128."""
    if n_prompt and n_gen:
        return f"pp{n_prompt}+tg{n_gen}"
    return f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_row(row, i: int, source: str) -> None:
    where = f"{source}: test {i}"
    if not isinstance(row, dict):
        raise LlamaBenchError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in row]
    if missing:
        raise LlamaBenchError(f"{where}: missing field(s) {', '.join(missing)} (is this llama-bench -o json output?)")
    for k, t in REQUIRED_FIELDS.items():
        v = row[k]
        if not isinstance(v, t) or isinstance(v, bool):
            raise LlamaBenchError(f"{where}: field {k} is {v!r}, expected {getattr(t, '__name__', 'a number')}")
    if row["n_gen"] < 0 or row["n_prompt"] < 0 or row["n_gen"] + row["n_prompt"] == 0:
        raise LlamaBenchError(f"{where}: n_prompt {row['n_prompt']} and n_gen {row['n_gen']}: no test")
    if not _number(row["avg_ts"]) or row["avg_ts"] <= 0 or not _number(row["stddev_ts"]) or row["stddev_ts"] < 0:
        raise LlamaBenchError(f"{where}: avg_ts {row['avg_ts']!r} / stddev_ts {row['stddev_ts']!r}: not a measured rate")
    samples = row["samples_ts"]
    if not samples or not all(_number(s) and s > 0 for s in samples):
        raise LlamaBenchError(f"{where}: samples_ts {samples!r}: expected one positive rate per repetition")


def records_from_llama_bench(data, *, command: str, context: dict, source: str = "llama-bench output") -> list[dict]:
    """One ``llama-cpp-bench-v1`` record per test of llama-bench's ``-o json`` output.

    data: the JSON text, or the parsed list. command: the llama-bench command line that printed it. context: what
    llama-bench does not know (keys CONTEXT_KEYS): preset, arch, num_layers, experts_per_layer, top_k (the model),
    quant (GGUF quantization, e.g. Q4_K_M), gguf ({file, bytes, converted_from, converter, pre_tokenizer}),
    workload ({weights, seed, init, routing, tokens, note}), llama_cpp ({package, version, sdist_sha256, commit,
    build_flags}), created_utc. Raises LlamaBenchError (one message) on output that is not llama-bench's."""
    missing = [k for k in CONTEXT_KEYS if k not in context]
    if missing:
        raise ValueError(f"records_from_llama_bench: context lacks {', '.join(missing)}")
    if not isinstance(command, str) or not command.strip():
        raise ValueError("records_from_llama_bench: command must be the llama-bench command line")
    if isinstance(data, (str, bytes)):
        try:
            rows = json.loads(data)
        except json.JSONDecodeError as e:
            raise LlamaBenchError(f"{source}: not JSON (line {e.lineno} column {e.colno}: {e.msg}); "
                                  "llama-bench must run with -o json and nothing else on stdout") from None
    else:
        rows = data
    if not isinstance(rows, list):
        raise LlamaBenchError(f"{source}: expected a JSON list of tests (llama-bench -o json), got {type(rows).__name__}")
    if not rows:
        raise LlamaBenchError(f"{source}: an empty list: llama-bench ran no test (see its stderr)")
    for i, row in enumerate(rows):
        _check_row(row, i, source)
    records = []
    for row in rows:
        test = llama_bench_test_name(row["n_prompt"], row["n_gen"])
        ncmoe = row["n_cpu_moe"]
        rid = f"{context['preset']}__llama.cpp__{context['quant'].lower()}__{test}__b{row['n_batch']}__ncmoe{ncmoe}"
        samples = [float(s) for s in row["samples_ts"]]
        records.append({
            "record_version": RECORD_VERSION,
            "kind": KIND,
            "id": re.sub(r"[^A-Za-z0-9_.+-]", "-", rid),
            "command": command,
            "created_utc": context["created_utc"],
            "config": {
                "preset": context["preset"], "arch": context["arch"], "num_layers": context["num_layers"],
                "experts_per_layer": context["experts_per_layer"], "top_k": context["top_k"],
                "n_cpu_moe": ncmoe,
                "expert_layers_on_cpu": min(max(ncmoe, 0), context["num_layers"]),
                "n_gpu_layers": row["n_gpu_layers"],
                "test": test, "prompt_len": row["n_prompt"], "decode_len": row["n_gen"],
                "n_depth": row.get("n_depth", 0), "batch": 1 if row["n_prompt"] == 0 else row["n_batch"],
                "n_batch": row["n_batch"], "n_ubatch": row.get("n_ubatch"), "n_threads": row["n_threads"],
                "flash_attn": row.get("flash_attn"), "type_k": row.get("type_k"), "type_v": row.get("type_v"),
                "repeats": len(samples),
            },
            "model": {
                "quant": context["quant"], "gguf_file": context["gguf"].get("file") or row["model_filename"],
                "gguf_bytes": context["gguf"].get("bytes"), "model_size_bytes": row["model_size"],
                "n_params": row["model_n_params"], "model_type": row["model_type"],
                "converted_from": context["gguf"].get("converted_from"),
                "converter": context["gguf"].get("converter"),
                "pre_tokenizer": context["gguf"].get("pre_tokenizer"),
            },
            "workload": context["workload"],
            "timing": {"tok_s": {"mean": float(row["avg_ts"]), "stdev": float(row["stddev_ts"]), "samples": samples},
                       "avg_ns": row.get("avg_ns"), "stddev_ns": row.get("stddev_ns")},
            "llama_cpp": {**context["llama_cpp"], "build_commit": row["build_commit"],
                          "build_number": row.get("build_number"), "backends": row.get("backends")},
            "device": {"gpu": row.get("gpu_info"), "cpu": row.get("cpu_info"), "devices": row.get("devices")},
            "test_time": row.get("test_time"),
            "raw": row,
        })
    return records


# What each line of llama-batched-bench's ``--output-format jsonl`` output carries that a record needs.
BATCHED_FIELDS = ("n_batch", "n_ubatch", "flash_attn", "n_gpu_layers", "n_threads", "pp", "tg", "pl", "t_tg",
                  "speed_tg")


def _n_cpu_moe_of(command: str) -> int:
    """The --n-cpu-moe / -ncmoe value of a llama.cpp command line (0 when absent: every expert on the GPU)."""
    m = re.search(r"(?:^|\s)(?:-ncmoe|--n-cpu-moe)[ =](\d+)(?:\s|$)", command)
    return int(m.group(1)) if m else 0


def records_from_batched_bench(text: str, *, command: str, context: dict, model_row: dict,
                               source: str = "llama-batched-bench output") -> list[dict]:
    """One record per (pp, tg, pl) line of ``llama-batched-bench --output-format jsonl``: ``pl`` sequences decoded
    together (config.batch = pl), tok/s = speed_tg (tokens of all sequences over the generation time: one timed
    pass, so samples holds that one rate and stdev is 0). llama-batched-bench prints neither the model's size nor
    the build, so ``model_row`` is a llama-bench ``-o json`` object of the same GGUF and build (the same run),
    checked like one. Other lines of the output (llama.cpp's log) are ignored; no result line is an error."""
    if not isinstance(command, str) or "batched-bench" not in command:
        raise ValueError("records_from_batched_bench: command must be the llama-batched-bench command line")
    _check_row(model_row, 0, f"{source} (model facts from llama-bench)")
    rows = []
    for ln, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LlamaBenchError(f"{source}: line {ln}: not JSON ({e.msg})") from None
        missing = [k for k in BATCHED_FIELDS if k not in row]
        if missing:
            raise LlamaBenchError(f"{source}: line {ln}: missing field(s) {', '.join(missing)}")
        if not _number(row["speed_tg"]) or row["speed_tg"] <= 0 or row["tg"] <= 0 or row["pl"] < 1:
            raise LlamaBenchError(f"{source}: line {ln}: speed_tg {row['speed_tg']!r}, tg {row['tg']!r}, pl "
                                  f"{row['pl']!r}: not a measured generation rate")
        rows.append(row)
    if not rows:
        raise LlamaBenchError(f"{source}: no result line (llama-batched-bench must run with --output-format jsonl)")
    ncmoe = _n_cpu_moe_of(command)
    base = {**model_row, "n_cpu_moe": ncmoe, "n_prompt": 0, "avg_ns": None, "stddev_ns": None}
    records = []
    for row in rows:
        rate = float(row["speed_tg"])
        one = records_from_llama_bench(
            [{**base, "n_batch": row["n_batch"], "n_ubatch": row["n_ubatch"], "n_threads": row["n_threads"],
              "n_gpu_layers": row["n_gpu_layers"], "n_gen": row["tg"], "flash_attn": int(row["flash_attn"]),
              "avg_ts": rate, "stddev_ts": 0.0, "samples_ts": [rate], "test_time": None}],
            command=command, context=context, source=source)[0]
        one["id"] = one["id"].replace(f"__b{row['n_batch']}__", f"__pl{row['pl']}__")
        # the generation runs after a pp-token prompt per sequence: llama-bench's "depth" of the test
        one["config"].update(batch=row["pl"], n_depth=row["pp"])
        one["timing"]["seconds_tg"] = float(row["t_tg"])
        one["raw"] = {"llama_batched_bench": row, "model_facts_from_llama_bench": model_row}
        records.append(one)
    return records
