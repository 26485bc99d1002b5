"""profiles/slurm (issue 21 item 2, dry-run part): the profile parses, pins its plugin as an optional dependency,
and plans the GPU-mode pipeline with each GPU job's gpu / memory / runtime request. With
snakemake-executor-plugin-slurm importable the dry run goes through the profile as is (executor slurm);
without it (a plain `pip install -e .`) the same profile minus its `executor` line is used, which still checks every
other key as a Snakemake option. No job is submitted here: tests/test_slurm.py submits the tiny pipeline through the
profile to a real one-node SLURM."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILE = REPO_ROOT / "profiles" / "slurm" / "config.yaml"
GPU_RULES = {"bench_group", "ifeval_generate_shard"}
HAVE_PLUGIN = importlib.util.find_spec("snakemake_executor_plugin_slurm") is not None


def _profile() -> dict:
    return yaml.safe_load(PROFILE.read_text())


def test_profile_parses_and_requests_gpus_the_plugins_way():
    prof = _profile()
    assert prof["executor"] == "slurm"
    # the plugin turns resource gpu=N into --gpus=N and refuses gpu and gres together: no gres on GPU rules
    for rule, res in prof.get("set-resources", {}).items():
        assert "gres" not in res and "gpu" not in res, rule  # gpu=1 comes from the rules themselves
    rules = set()
    for f in (REPO_ROOT / "workflow" / "rules").glob("*.smk"):
        rules |= set(re.findall(r"^\s*rule (\w+):", f.read_text(), re.M))
    assert set(prof.get("set-resources", {})) <= rules  # no typo'd rule name silently ignored
    assert {"mem_mb", "runtime"} <= set(prof["default-resources"])


def test_plugin_is_pinned_as_an_optional_dependency_only():
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert meta["optional-dependencies"]["slurm"] == ["snakemake-executor-plugin-slurm==2.8.0"]
    assert not any("slurm" in d for d in meta["dependencies"])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("profiles")
    for name in ("Snakefile", "workflow", "specs", "schemas", "profiles"):
        src = REPO_ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, d / name)
    if not HAVE_PLUGIN:  # the same profile, run by the local executor: every other key is still checked
        prof = _profile()
        del prof["executor"]
        (d / "profiles" / "slurm" / "config.yaml").write_text(yaml.safe_dump(prof))
    return d


def test_dry_run_plans_gpu_jobs_with_their_requests(workdir):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/slurm", "-n",
                           "--configfile", "specs/pipeline/gpu-tiny.yaml"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Using profile profiles/slurm" in out
    stats = out.split("Job stats:", 1)[1]
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", stats, re.M)}
    assert counts["bench_group"] == 4 and counts["ifeval_generate_shard"] == 2 and counts["bench"] == 1
    blocks = re.split(r"^(?:local)?rule (\w+):\s*$", out, flags=re.M)
    seen = set()
    for rule, body in zip(blocks[1::2], blocks[2::2]):
        res = dict(kv.split("=", 1) for kv in re.search(r"^\s*resources: (.*)$", body, re.M)[1].split(", "))
        if rule in GPU_RULES:
            seen.add(rule)
            # specs/pipeline/gpu-tiny.yaml's gpu section, and the profile's cpus for GPU jobs
            assert (res["gpu"], res["mem_mb"], res["runtime"], res["cpus_per_task"]) == ("1", "16000", "60", "8"), res
        else:
            assert "gpu" not in res and res["mem_mb"] == "8000" and res["cpus_per_task"] == "2", (rule, res)
    assert seen == GPU_RULES

