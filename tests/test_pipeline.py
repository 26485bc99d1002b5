"""The Snakemake pipeline on the embedded default, in a scratch copy of the workflow:
first run builds and validates everything; a second run does nothing; a new block size repacks and
reruns only what depends on the packs; a new seed rebuilds the checkpoints.

Every stage and rule of the default runs on the default's two models, with smaller budgets where a stage
measures rather than wires (TEST_CONFIG: 30 contract examples, kernel cases at M = 1 and 3, 2 IFEval
prompts, an 8-configuration campaign without the interpreter-bound topk-fused runs): what this module
tests is the pipeline (what runs, in what order, what a change reruns), and each stage's full budget is
tested by its own tests. That halves the CPU time of the build test (about 70 CPU-seconds instead of 140
on the 2-core development machine): three copies of it run at once beside a loop of test_cli_inputs and
test_kernels (load average about 10 on 2 cores) took 176 s for the first snakemake call, inside the 300 s
each call may take, where with the default budgets all three ran into that limit."""
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from runmap.conformance.schemas import load_schemas

REPO_ROOT = Path(__file__).resolve().parent.parent

MODELS = ["tiny-olmoe", "tiny-qwen2-moe"]


def pipeline_env(workdir: Path) -> dict:
    """`runmap` of this interpreter first on PATH, importing the package from the scratch copy (so that a
    source edited there is the code the rules run and list as inputs)."""
    env = dict(os.environ, PYTHONPATH=str(workdir))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


# Smaller budgets for the stages that measure (see the module docstring); merged over the default config.
TEST_CONFIG = {
    "contract": {"examples": 30},  # the mutants keep the default budget (the slowest is caught at its 644th example)
    "kernels": {"m": [1, 3]},
    "ifeval": {"limit": 2, "max_new_tokens": 4, "batch_size": 2},
    "campaign": "specs/campaigns/pipeline-test.yaml",
}


def _test_campaign() -> dict:
    """The default campaign with one batch size, shorter lengths, one repeat and no topk-fused group (in
    the interpreter its 4 configurations took 41 of the campaign's 66 s)."""
    import yaml

    spec = yaml.safe_load((REPO_ROOT / "specs/campaigns/default.yaml").read_text())
    spec["name"] = "pipeline-test"
    spec["description"] = "the default campaign, smaller: written by tests/test_pipeline.py into its scratch copy"
    spec["defaults"] = {**spec["defaults"], "repeats": 1}
    spec["groups"] = [{**g, "batch": 1, "prompt_len": 4, "decode_len": 2} for g in spec["groups"]
                      if "topk-fused" not in g.get("executors", [])]
    return spec


def snakemake(workdir: Path, *args: str, config: str | None = "pipeline-test.yaml", cores: int | None = 2,
              env: dict | None = None, timeout: int = 300, diagnostics: Callable[[], str] = lambda: "") -> str:
    """``python -m snakemake -c<cores> --configfile=<config> *args`` in ``workdir`` (``cores`` / ``config`` None:
    that option is left out, e.g. for a profile's executor) -> its output, stderr and stdout together (Snakemake
    logs to stderr; every rule sends its own output to its log). ``env`` defaults to pipeline_env(workdir).

    The one runner of a real Snakemake for the pipeline tests (this module's, test_pipeline_gpu.py's,
    test_slurm.py's). It runs in its own process group: on a timeout every job it started is killed with it, not
    left running, and the test fails. A timeout or a non-zero exit fails the test with the output's tail, the
    tails of the rule logs (results/logs) and of the SLURM job logs (.snakemake/slurm_logs) and ``diagnostics()``
    (the SLURM test's daemon logs)."""
    argv = [sys.executable, "-m", "snakemake"]
    argv += [f"-c{cores}"] if cores is not None else []
    argv += [f"--configfile={config}"] if config is not None else []
    proc = subprocess.Popen([*argv, *args], cwd=workdir, env=pipeline_env(workdir) if env is None else env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"snakemake {' '.join(args)} took longer than {timeout} s:\n{out[-4000:]}\n"
                    f"{_run_logs(workdir)}\n{diagnostics()}")
    if proc.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{out[-4000:]}\n"
                    f"{_run_logs(workdir)}\n{diagnostics()}")
    return out


def _run_logs(workdir: Path) -> str:
    """The tails of the logs a snakemake run left: each rule's, and each SLURM job's."""
    logs = sorted(workdir.glob("results/logs/**/*.log")) + sorted(workdir.glob(".snakemake/slurm_logs/**/*.log"))
    return "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs)


def job_counts(out: str) -> dict[str, int]:
    """The 'Job stats' table of a snakemake run: rule -> number of jobs."""
    if "Job stats:" not in out:
        return {}
    table = out.split("Job stats:", 1)[1]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M) if m[1] not in ("total", "all")}


def mtimes(paths):
    return {p: p.stat().st_mtime_ns for p in paths}


def _generated() -> list[str]:
    """What the pipeline writes under results/ (.gitignore lists every such path: its results/ lines)."""
    lines = (REPO_ROOT / ".gitignore").read_text().splitlines()
    return [l.strip().rstrip("/") for l in lines if l.strip().startswith("results/")]


GENERATED = _generated()


def _ignore(dirpath, names):
    """Tool state, and every pipeline output a developer's tree may hold: a copied results/kernels/cpu.json
    or contract report would be taken as up to date and its stage skipped, so the test would time less
    than the pipeline it claims to run (and less than a fresh clone, as in CI, does)."""
    skip = {n for n in names if n.startswith(".") or n == "__pycache__" or n.endswith(".egg-info")}
    rel = Path(dirpath).resolve().relative_to(REPO_ROOT.resolve())
    return skip | {n for n in names if any(fnmatch.fnmatch((rel / n).as_posix(), g) for g in GENERATED)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch copy of the repository's working tree without tool state and generated pipeline data
    (rules may list source files as inputs, so the whole tree is copied, not just the workflow)."""
    d = tmp_path_factory.mktemp("pipeline") / "repo"
    shutil.copytree(REPO_ROOT, d, ignore=_ignore, symlinks=True)
    assert "results/kernels/cpu.json" in GENERATED and "results/checkpoints" in GENERATED
    for gen in GENERATED:
        assert not list(d.glob(gen)), gen
    import yaml

    (d / "pipeline-test.yaml").write_text(yaml.safe_dump(TEST_CONFIG))
    (d / TEST_CONFIG["campaign"]).write_text(yaml.safe_dump(_test_campaign(), sort_keys=False))
    return d


def reasons(out: str) -> dict[str, list[str]]:
    """rule -> the 'reason:' line of each of its jobs in a snakemake run log."""
    found: dict[str, list[str]] = {}
    blocks = re.split(r"^(?:local)?rule (\w+):\s*$", out, flags=re.M)
    for rule, body in zip(blocks[1::2], blocks[2::2]):
        r = re.search(r"^\s*reason: (.*)$", body, re.M)
        found.setdefault(rule, []).append(r[1] if r else "")
    return found


def test_pipeline_builds_then_is_idempotent_then_repacks_only(workdir):
    res = workdir / "results"

    out = snakemake(workdir)
    counts = job_counts(out)
    assert counts["synth_checkpoint"] == 2 and counts["pack"] == 2 and counts["conformance"] == 1, out[-3000:]
    summary = json.loads((res / "conformance/summary.json").read_text())
    assert load_schemas().validate_document(summary, "conformance") == []
    assert summary["conformant"] is True and summary["totals"]["files_failed"] == 0
    checked = {f["path"] for f in summary["files"]}
    for m in MODELS:
        assert f"results/packs/{m}-b256/manifest.json" in checked
        assert f"results/checkpoints/{m}/config.json" in checked
        assert json.loads((res / f"packs/{m}-b256/manifest.json").read_text())["block_size"] == 256
    assert "specs/architecture.yaml" in checked
    assert summary["warnings"] == []  # every JSON artifact of the default run is claimed by a schema
    for stage in ("checkpoints", "packs"):
        assert len(list((res / "logs" / stage).glob("*.log"))) == 2
    ckpt_files = [p for m in MODELS for p in (res / "checkpoints" / m).iterdir()]
    pack256 = [p for m in MODELS for p in (res / "packs" / f"{m}-b256").iterdir()]
    before = mtimes(ckpt_files + pack256)

    out = snakemake(workdir)
    assert "Nothing to be done" in out, out[-3000:]
    assert mtimes(ckpt_files + pack256) == before

    # A new block size: plan the whole default target (dry run), then build the new packs for real.
    # (Executing the whole default again would rerun the later stages that read the packs, which only
    # costs time: the plan below already shows exactly which jobs would run and why.)
    out = snakemake(workdir, "-n", "--config", "block_size=128")
    counts = job_counts(out)
    assert "synth_checkpoint" not in counts and counts["pack"] == 2 and counts["conformance"] == 1, out[-3000:]
    # every other planned job runs because of the new packs, never on its own account
    planned = reasons(out)
    assert {r: len(v) for r, v in planned.items() if r != "all"} == counts
    for rule, why in planned.items():
        if rule in ("pack", "all"):
            continue
        for r in why:
            assert ("b128" in r or "updated by another job" in r or "set of input files has changed" in r.lower()), (rule, r)
    out = snakemake(workdir, *(f"results/packs/{m}-b128" for m in MODELS), "--config", "block_size=128")
    assert job_counts(out) == {"pack": 2}, out[-3000:]
    assert mtimes(ckpt_files + pack256) == before  # the checkpoints (and the old packs) are untouched
    for m in MODELS:
        assert json.loads((res / f"packs/{m}-b128/manifest.json").read_text())["block_size"] == 128
    out = snakemake(workdir, "results/conformance/summary.json", "-n", "--config", "block_size=128")
    assert "pack" not in job_counts(out)  # the packs just built are up to date

    # a new seed changes the synthetic weights: Snakemake's params trigger rebuilds checkpoints and packs
    out = snakemake(workdir, "-n", "--config", "block_size=128", "seed=1")
    counts = job_counts(out)
    assert counts["synth_checkpoint"] == 2 and counts["pack"] == 2 and counts["conformance"] == 1, out[-3000:]


def test_editing_a_kernel_reruns_the_stages_that_run_kernels(workdir):
    """Every rule lists the code it runs as inputs (Snakefile code()), the kernels included: after an
    edit of one kernel source the plan reruns the kernel check, the bench and the IFEval generation (and
    what reads them), never the checkpoints or packs. Runs after the full build above."""
    assert "Nothing to be done" in snakemake(workdir, "-n")
    kernel = workdir / "kernels" / "grouped.py"
    kernel.write_text(kernel.read_text() + "\n# edited by the pipeline test\n")
    out = snakemake(workdir, "-n")
    planned = reasons(out)
    for rule in ("check_kernels", "bench", "ifeval_generate"):
        assert rule in planned, (rule, out[-3000:])
        assert any("kernels/grouped.py" in r for r in planned[rule]), (rule, planned[rule])
    assert "synth_checkpoint" not in planned and "pack" not in planned and "contract" not in planned, planned


def dry_run(workdir, *config):
    """``snakemake -n -c1 --config ...`` in ``workdir`` (the venv's bin first on PATH) -> CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "-c1", "--config", *config],
                          cwd=workdir, env=pipeline_env(workdir), capture_output=True, text=True, timeout=120)


def test_invalid_config_is_rejected_before_any_job(workdir):
    proc = dry_run(workdir, "block_size=255")
    assert proc.returncode != 0
    assert "block_size" in proc.stdout + proc.stderr and "multiple of 2" in proc.stdout + proc.stderr


def test_real_model_without_local_checkpoint_is_a_clear_error(workdir):
    proc = dry_run(workdir, "models=[olmoe-1b-7b-0924]")
    assert proc.returncode != 0
    assert "olmoe-1b-7b-0924" in proc.stderr + proc.stdout and "local checkpoint directory" in proc.stderr + proc.stdout


def test_the_readmes_real_checkpoint_command_plans_every_stage(workdir, tmp_path):
    """README "Running a real model" gives one pipeline command for a local checkpoint: as written (its checkpoint
    path pointed at a stand-in directory), its dry run plans the pack, the bench of the campaign it names and the
    report; without a campaign of those models the error names the specs that would do."""
    import shlex

    text = (REPO_ROOT / "README.md").read_text()
    line = next(ln.strip("`. ") for ln in text.splitlines()
                if ln.startswith("`snakemake") and "models=[olmoe-1b-7b-0924]" in ln)
    argv = shlex.split(line)
    assert argv[:4] == ["snakemake", "--cores", "all", "--config"], argv
    ckpt = tmp_path / "olmoe"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    config = [a.replace("/data/OLMoE-1B-7B-0924", str(ckpt)) for a in argv[4:]]
    assert any(a.startswith("campaign=") for a in config), config
    proc = dry_run(workdir, *config)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    planned = job_counts(proc.stdout)
    assert planned.get("pack") == 1 and planned.get("bench") == 1 and planned.get("report") == 1, planned
    no_campaign = [a for a in config if not a.startswith("campaign=")]
    proc = dry_run(workdir, *no_campaign)
    assert proc.returncode != 0
    assert "campaign=specs/campaigns/olmoe-real.yaml" in proc.stdout + proc.stderr, proc.stderr[-2000:]
