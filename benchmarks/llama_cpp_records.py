"""llama-bench's JSON output -> llama.cpp peer records (`schemas/llama-cpp-bench.schema.json`), one per test.

Each RUN.json is what `llama-bench ... -o json` printed; RUN.cmd beside it holds the command line (the script
that ran llama-bench writes both). A RUN.jsonl is what `llama-batched-bench ... --output-format jsonl` printed
(several sequences decoded at once); its model and build facts come from the first llama-bench run given. The model facts come from the preset, the build facts from the unpacked
source's RUNMAP_SOURCE.json and --build-flags. A file that is not llama-bench output is reported with one line
and the others are still written (exit status 1 then).

    PYTHONPATH=. python3 benchmarks/llama_cpp_records.py --preset olmoe-1b-7b-0924 --gguf G.gguf --quant Q4_K_M \\
        --source SRC/RUNMAP_SOURCE.json --build-flags="-DGGML_CUDA=ON ..." --out-dir OUT/records RUN.json ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runmap.arch.config import load_preset
from runmap.atomic import write_json
from runmap.bench.llama_cpp import PRE_TOKENIZER, LlamaBenchError, records_from_batched_bench, records_from_llama_bench
from runmap.provenance import utc_timestamp

TOKENS = "llama-bench tg: random token ids (std::rand() % n_vocab), one per decode step"


def context_for(args) -> dict:
    cfg, _ = load_preset(args.preset)
    src = json.loads(Path(args.source).read_text())
    gguf = Path(args.gguf)
    return {
        "preset": args.preset, "arch": cfg.arch, "num_layers": cfg.num_layers,
        "experts_per_layer": cfg.num_experts, "top_k": cfg.top_k, "quant": args.quant,
        "gguf": {"file": gguf.name, "bytes": gguf.stat().st_size if gguf.is_file() else None,
                 "converted_from": args.converted_from, "converter": "convert_hf_to_gguf.py via benchmarks/llama_cpp_convert.py",
                 "pre_tokenizer": args.pre_tokenizer},
        "workload": {
            "weights": "synthetic", "seed": args.seed, "init": args.init, "routing": "model", "tokens": TOKENS,
            "note": (f"runmap synth --preset {args.preset} --seed {args.seed} --init {args.init} (the campaign's "
                     "checkpoint), converted by llama.cpp's own converter; llama.cpp runs the checkpoint's own "
                     "router (our 'model' routing), not a calibrated or replayed workload; speed only, outputs "
                     "are no model's"),
        },
        "llama_cpp": {"package": src["package"], "version": src["version"], "sdist_sha256": src["sdist_sha256"],
                      "commit": src["llama_cpp_commit"], "build_flags": args.build_flags.split()},
        "created_utc": utc_timestamp(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="llama-bench -o json outputs (.json) and llama-batched-bench "
                   "--output-format jsonl outputs (.jsonl), RUN.cmd beside each")
    p.add_argument("--preset", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default="routing", choices=["hf", "routing"])
    p.add_argument("--gguf", required=True, help="the GGUF llama-bench ran (its size is recorded)")
    p.add_argument("--quant", required=True, help="e.g. Q4_K_M")
    p.add_argument("--converted-from", default=None, help="what llama-quantize read, e.g. 'bf16 GGUF'")
    p.add_argument("--pre-tokenizer", default=PRE_TOKENIZER)
    p.add_argument("--source", required=True, help="RUNMAP_SOURCE.json of the unpacked llama.cpp source")
    p.add_argument("--build-flags", default="", help="the CMake -D flags, one string; give it as --build-flags=\"...\" (a value starting with - is read as an option otherwise)")
    p.add_argument("--out-dir", required=True, type=Path)
    args = p.parse_args(argv)
    ctx = context_for(args)
    failed = 0
    rows = []
    model_row = None  # llama-batched-bench prints no model or build facts: the first llama-bench test's
    for run in sorted(args.runs, key=lambda r: r.suffix == ".jsonl"):  # llama-bench runs first
        cmd_file = run.with_suffix(".cmd")
        try:
            command = cmd_file.read_text().strip() if cmd_file.is_file() else ""
            if not command:
                raise LlamaBenchError(f"{cmd_file}: missing or empty (the llama-bench command line)")
            if run.suffix == ".jsonl":
                if model_row is None:
                    raise LlamaBenchError(f"{run}: no llama-bench run of the same GGUF gave the model facts")
                records = records_from_batched_bench(run.read_text(), command=command, context=ctx,
                                                     model_row=model_row, source=str(run))
            else:
                records = records_from_llama_bench(run.read_text(), command=command, context=ctx, source=str(run))
                model_row = model_row or records[0]["raw"]
        except (OSError, LlamaBenchError) as e:
            print(f"SKIPPED {e}", flush=True)
            failed += 1
            continue
        for rec in records:
            write_json(args.out_dir / f"{rec['id']}.json", rec)
            rows.append(rec)
    print(f"{'id':62s} {'batch':>5s} {'ncmoe':>5s} {'tok/s':>8s} {'stdev':>6s}")
    for rec in sorted(rows, key=lambda r: (r["config"]["test"], r["config"]["batch"], r["config"]["n_cpu_moe"])):
        t, c = rec["timing"]["tok_s"], rec["config"]
        print(f"{rec['id']:62s} {c['batch']:5d} {c['n_cpu_moe']:5d} {t['mean']:8.1f} {t['stdev']:6.1f}")
    print(f"{len(rows)} records in {args.out_dir}, {failed} file(s) skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
