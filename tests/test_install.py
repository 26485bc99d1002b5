"""Both installs work from a directory unrelated to the repository: a regular (non-editable) install,
whose specs, schemas and data ship as package data, and the editable one the README's command makes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run(cmd, cwd, env, timeout=300):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def regular_install(tmp_path_factory):
    """The package installed the regular way (a wheel built from the source tree) into its own folder;
    dependencies come from the current environment."""
    target = tmp_path_factory.mktemp("site")
    build_isolation = []
    try:
        import setuptools  # noqa: F401  (the build backend; without it pip builds in an isolated env)

        build_isolation = ["--no-build-isolation"]
    except ImportError:
        pass
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *build_isolation, "--target",
          str(target), str(REPO_ROOT)], cwd=tmp_path_factory.mktemp("build"), env=dict(os.environ), timeout=600)
    env = dict(os.environ, PYTHONPATH=str(target), TRITON_INTERPRET="1")
    return target, env


def test_regular_install_holds_the_namespace_and_the_package_data(regular_install):
    target, _ = regular_install
    assert not (target / "kernels").exists(), "a top-level 'kernels' package was installed"
    assert (target / "runmap" / "kernels" / "executors.py").is_file()
    assert (target / "runmap" / "kernels" / "cpu_native.c").is_file()  # the cpu-native site compiles it on first use
    assert (target / "runmap" / "specs" / "architecture.yaml").is_file()
    assert (target / "runmap" / "specs" / "models" / "tiny-olmoe.yaml").is_file()
    assert (target / "runmap" / "schemas" / "manifest.schema.json").is_file()
    assert (target / "runmap" / "data" / "ifeval" / "input_data.jsonl").is_file()
    assert all((target / "runmap" / "serve" / "static" / f).is_file() for f in ("index.html", "app.js", "style.css"))


def test_regular_install_synth_pack_validate_generate_from_an_unrelated_directory(regular_install, tmp_path):
    target, env = regular_install
    work = tmp_path / "elsewhere"
    work.mkdir()
    run = lambda *args: _run([sys.executable, "-m", "runmap", *args], cwd=work, env=env)  # noqa: E731
    where = _run([sys.executable, "-c", "import runmap, runmap.kernels.registry as r, runmap.resources as s; "
                  "print(runmap.__file__); print(r.__file__); print(s.SPECS_DIR)"], cwd=work, env=env).stdout.split()
    assert all(w.startswith(str(target)) for w in where), where
    run("synth", "--no-progress", "--preset", "tiny-olmoe", "--seed", "1", "ckpt")
    run("pack", "--no-progress", "ckpt", "pack")
    out = run("validate", "pack")
    assert "CONFORMANT" in out.stdout
    gen = run("generate", "--packed", "pack", "--prompt", "hello", "--max-new-tokens", "3", "--executor", "reference",
              "--device", "cpu", "--telemetry", str(tmp_path / "telemetry.json"))
    assert (tmp_path / "telemetry.json").is_file()
    assert gen.stdout.strip() != "" or "tok/s" in gen.stderr


def test_editable_install_runs_from_an_unrelated_directory(tmp_path):
    """The README's `pip install -e .`: the subpackage runmap.kernels resolves to the top-level kernels/."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = _run([sys.executable, "-c", "import runmap.kernels.registry as r, runmap.resources as s; print(r.__file__); "
              "print(s.SCHEMAS_DIR)"], cwd=tmp_path, env=env)
    kernels_file, schemas_dir = p.stdout.split()
    assert Path(kernels_file) == REPO_ROOT / "kernels" / "registry.py"
    assert Path(schemas_dir) == REPO_ROOT / "schemas"
    out = _run([sys.executable, "-m", "runmap", "validate", str(REPO_ROOT / "specs")], cwd=tmp_path, env=env)
    assert "CONFORMANT" in out.stdout
