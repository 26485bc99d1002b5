"""The IFEval stage's wiring in the Snakemake pipeline (dry runs: fast; the full run is in test_pipeline.py)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


TARGET = "results/ifeval/tiny-olmoe-b256/score/summary.json"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ifeval_pipeline")
    for name in ("Snakefile", "workflow", "specs", "schemas"):
        src = REPO_ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, d / name)
    return d


def dry_run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "-c1", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=120)


def test_default_config_chains_pack_generate_score(workdir):
    proc = dry_run(workdir, TARGET)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    jobs = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", out.split("Job stats:", 1)[1], re.M)}
    assert {k: v for k, v in jobs.items() if k != "total"} == {
        "synth_checkpoint": 1, "pack": 1, "ifeval_inputs": 1, "ifeval_generate": 1, "ifeval_score": 1}
    # the embedded default: 16 prompts, 32 new tokens, reference executor, the tiny model's pack
    assert "head -n 16 " in out
    gen = re.search(r"runmap ifeval generate .*", out)[0]
    for opt in ("--packed results/packs/tiny-olmoe-b256", "--max-new-tokens 32", "--batch-size 16",
                "--executor reference", "--model-name tiny-olmoe"):
        assert opt in gen
    assert "--resident" not in gen  # full residency unless configured
    score = re.search(r"runmap ifeval score .*", out)[0]
    assert "--responses results/ifeval/tiny-olmoe-b256/answers.jsonl" in score
    assert "--out results/ifeval/tiny-olmoe-b256/score" in score


def _with_ifeval(workdir: Path, name: str, section: str) -> str:
    """A config file: the embedded default plus an `ifeval` section (YAML flow mapping)."""
    text = (workdir / "specs/pipeline/default.yaml").read_text()
    text = re.sub(r"^ifeval:\n(?:  .*\n)*", "", text, flags=re.M) + f"ifeval: {section}\n"
    (workdir / name).write_text(text)
    return name


def test_config_overrides_reach_the_command(workdir):
    cfg = _with_ifeval(workdir, "gpu.yaml", "{limit: 541, max_new_tokens: 1280, batch_size: 64, executor: grouped, "
                                            "resident: 4}")
    proc = dry_run(workdir, TARGET, "--configfile", cfg)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    gen = re.search(r"runmap ifeval generate .*", out)[0]
    for opt in ("--max-new-tokens 1280", "--batch-size 64", "--executor grouped", "--resident 4"):
        assert opt in gen
    assert "head -n 541 " in out


@pytest.mark.parametrize("section, message", [
    ("{limit: 0}", "0 is less than the minimum of 1"),
    ("{executor: fastest}", "'fastest' is not one of"),
    ("{models: [tiny-olmoe-x]}", "ifeval.models names 'tiny-olmoe-x', which is not in models"),
])
def test_bad_ifeval_config_is_refused(workdir, section, message):
    cfg = _with_ifeval(workdir, "bad.yaml", section)
    proc = dry_run(workdir, TARGET, "--configfile", cfg)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
