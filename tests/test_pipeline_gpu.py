"""The pipeline's GPU mode (issue 21 item 1) on a CPU host with two faked GPUs (RUNMAP_GPU_SLOTS=0,1):
one gpu=1 job per campaign group and per IFEval shard, each on a GPU slot of its own, an aggregate job per
campaign, and reruns of only what changed or is missing. The default (CPU) pipeline is test_pipeline.py's."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_pipeline import _ignore, job_counts, pipeline_env, reasons, snakemake

REPO_ROOT = Path(__file__).resolve().parent.parent
CAMPAIGN = "gpu-test"
SPEC = f"specs/campaigns/{CAMPAIGN}.yaml"
IFEVAL_SUMMARY = "results/ifeval/tiny-olmoe-b256/score/summary.json"
TARGETS = ("results/report.md", IFEVAL_SUMMARY)

CONFIG = {
    "models": ["tiny-olmoe"],
    "campaign": SPEC,
    "ifeval": {"limit": 6, "max_new_tokens": 4, "batch_size": 2, "executor": "reference", "shards": 3},
    "gpu": {"enabled": True, "mem_mb": 2000, "runtime_min": 20, "slot_wait_s": 120},
}

CAMPAIGN_SPEC = {
    "name": CAMPAIGN,
    "description": "two groups of the default campaign on one tiny model: written by tests/test_pipeline_gpu.py",
    "device": "cpu",
    "defaults": {"repeats": 1, "warmup": 0, "warmup_new_tokens": 1, "policy": "lru", "seed": 0},
    "models": {"tiny-olmoe": {"preset": "tiny-olmoe", "checkpoint": "results/checkpoints/tiny-olmoe",
                              "pack": "results/packs/tiny-olmoe-b256"}},
    "groups": [
        {"name": "baseline-fp16-experts", "kind": "engine-fp16", "why": "the baseline, in a job of its own",
         "models": ["tiny-olmoe"], "batch": 1, "prompt_len": 4, "decode_len": 2},
        {"name": "residency-reference", "kind": "engine", "why": "ratios to a baseline another job measured",
         "models": ["tiny-olmoe"], "resident": [4, "full"], "executors": ["reference"], "batch": 1,
         "prompt_len": 4, "decode_len": 2},
    ],
}


def _snakemake(workdir: Path, *args: str, config="gpu-test.yaml") -> str:
    """test_pipeline.snakemake with two faked GPU slots (and their lock directory), no CUDA_VISIBLE_DEVICES."""
    env = pipeline_env(workdir)
    env.update(RUNMAP_GPU_SLOTS="0,1", RUNMAP_GPU_LOCK_DIR=str(workdir / "gpu-locks"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return snakemake(workdir, *args, config=config, env=env, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipeline_gpu") / "repo"
    shutil.copytree(REPO_ROOT, d, ignore=_ignore, symlinks=True)
    (d / "gpu-test.yaml").write_text(yaml.safe_dump(CONFIG))
    (d / SPEC).write_text(yaml.safe_dump(CAMPAIGN_SPEC, sort_keys=False))
    return d


def _job_blocks(out: str) -> list[tuple[str, str]]:
    blocks = re.split(r"^(?:local)?rule (\w+):\s*$", out, flags=re.M)
    return list(zip(blocks[1::2], blocks[2::2]))


def test_plan_declares_gpu_jobs_and_the_default_stays_cpu(workdir):
    out = _snakemake(workdir, "-n", "-p", *TARGETS)
    counts = job_counts(out)
    assert {k: counts.get(k) for k in ("bench_group", "ifeval_generate_shard", "ifeval_merge", "bench", "report")} == \
        {"bench_group": 2, "ifeval_generate_shard": 3, "ifeval_merge": 1, "bench": 1, "report": 1}, out[-3000:]
    gpu_rules = {"bench_group", "ifeval_generate_shard"}
    for rule, body in _job_blocks(out):
        res = re.search(r"^\s*resources: (.*)$", body, re.M)[1]
        if rule in gpu_rules:
            assert "gpu=1" in res and "mem_mb=2000" in res and "runtime=20" in res, (rule, res)
            assert "runmap gpu-slot --wait-s 120 -- runmap " in body, (rule, body)
        else:
            assert "gpu=" not in res and "runmap gpu-slot" not in body, (rule, body)
    assert re.search(r"runmap bench \S+ --group residency-reference --out results/bench-parts/gpu-test/"
                     r"residency-reference --overwrite", out)
    assert re.search(r"runmap ifeval generate .*--shard 2/3", out)
    assert re.search(r"runmap bench \S+ --aggregate results/bench-parts/gpu-test/baseline-fp16-experts "
                     r"results/bench-parts/gpu-test/residency-reference --out results/campaigns", out)

    # the embedded default (CPU): one bench job, one generate job, no GPU resources, no slot allocator
    default = _snakemake(workdir, "-n", "-p", config="specs/pipeline/default.yaml")
    counts = job_counts(default)
    assert counts["bench"] == 1 and counts["ifeval_generate"] == 1
    assert "bench_group" not in counts and "ifeval_generate_shard" not in counts
    assert "gpu=" not in default and "runmap gpu-slot" not in default


def test_gpu_jobs_run_on_their_slots_then_rerun_only_what_changed(workdir):
    res = workdir / "results"
    out = _snakemake(workdir, *TARGETS, "--resources", "gpu=2")  # targets first: --resources takes several values
    counts = job_counts(out)
    assert counts["bench_group"] == 2 and counts["ifeval_generate_shard"] == 3, out[-3000:]

    gpu_logs = sorted((res / "logs/campaigns" / CAMPAIGN).glob("*.log")) + \
        sorted((res / "logs/ifeval").glob("*-generate-*-of-3.log"))
    assert len(gpu_logs) == 5
    for log in gpu_logs:
        m = re.search(r"runmap gpu-slot: pid \d+ runs on GPU slot (\d) \(slots 0,1", log.read_text())
        assert m and m[1] in ("0", "1"), log

    camp = res / "campaigns" / CAMPAIGN
    summary = json.loads((camp / "campaign.json").read_text())
    assert [p["dir"].rsplit("/", 1)[1] for p in summary["parts"]] == ["baseline-fp16-experts", "residency-reference"]
    assert len(summary["done"]) == 3 and summary["failed"] == [] and summary["skipped"] == []
    records = [json.loads(p.read_text()) for p in sorted((camp / "records").glob("*.json"))]
    assert len(records) == 3 and len({r["run_id"] for r in records}) == 2  # two jobs, two runs
    for r in records:
        if r["kind"] == "engine":  # the baseline was measured by the other job: still paired
            assert r["ratios"]["decode_vs_engine-fp16"]["status"] == "OBSERVED", r["ratios"]
            part = json.loads((res / "bench-parts" / CAMPAIGN / "residency-reference" / CAMPAIGN / "records" /
                               f"{r['id']}.json").read_text())
            assert part["ratios"]["decode_vs_engine-fp16"]["status"] == "UNKNOWN"  # its own job had no baseline
    proc = subprocess.run([sys.executable, "-m", "runmap.cli", "validate", str(camp), str(res / "ifeval")],
                          capture_output=True, text=True, cwd=workdir, env=pipeline_env(workdir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    merged = json.loads((res / "ifeval/tiny-olmoe-b256/answers.jsonl.meta.json").read_text())
    assert [m["index"] for m in merged["merged_from"]] == [1, 2, 3]
    assert json.loads((workdir / IFEVAL_SUMMARY).read_text())["prompt_level"]["strict"]["total"] == 6
    assert (res / "report.md").is_file()

    assert "Nothing to be done" in _snakemake(workdir, "-n", *TARGETS)

    # editing one group reruns that group's job (and the joins after it), not the other group, not IFEval
    spec = yaml.safe_load((workdir / SPEC).read_text())
    spec["groups"][1]["decode_len"] = 3
    (workdir / SPEC).write_text(yaml.safe_dump(spec, sort_keys=False))
    out = _snakemake(workdir, "-n", *TARGETS)
    assert job_counts(out) == {"bench_group": 1, "bench": 1, "report": 1}, out[-3000:]
    assert "residency-reference" in reasons(out)["bench_group"][0] or "params" in reasons(out)["bench_group"][0].lower()
    assert "bench-parts/gpu-test/residency-reference" in out and "bench-parts/gpu-test/baseline-fp16-experts" \
        not in out.split("rule bench_group:", 1)[1].split("rule ", 1)[0]

    # what a run in which shard 2's job failed leaves: no output of that job (Snakemake removes it) and none of
    # the joins after it; the next run reruns that shard alone (not 1 and 3) and the joins
    shutil.rmtree(res / "ifeval/tiny-olmoe-b256/shards/2-of-3")
    shutil.rmtree(res / "ifeval/tiny-olmoe-b256/score")
    for name in ("answers.jsonl", "answers.jsonl.meta.json"):
        (res / "ifeval/tiny-olmoe-b256" / name).unlink()
    out = _snakemake(workdir, "-n", IFEVAL_SUMMARY)
    assert job_counts(out) == {"ifeval_generate_shard": 1, "ifeval_merge": 1, "ifeval_score": 1}, out[-3000:]
    assert "shards/2-of-3/answers.jsonl" in out
