""".ci/run: runs README command (2) as written, and never passes without running tests."""
from pathlib import Path
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


TEST_COMMAND = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[slurm]' && "
                "TRITON_INTERPRET=1 python -m pytest -q -n 2 --dist loadfile")


def readme_with(cmd: str) -> str:
    return f"# x\n\n<!-- test-command -->\n```\n{cmd}\n```\n<!-- /test-command -->\n\n```\nother block\n```\n"


def ci(tmp_path, cmd: str | None, files: dict[str, str] = {}):
    (tmp_path / ".ci").mkdir(exist_ok=True)
    shutil.copy2(REPO_ROOT / ".ci/run", tmp_path / ".ci/run")
    (tmp_path / "README.md").write_text(readme_with(cmd) if cmd is not None else "# no markers\n")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    p = subprocess.run(["bash", str(tmp_path / ".ci/run")], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_readme_test_command_is_the_documented_one():
    text = (REPO_ROOT / "README.md").read_text()
    block = text.split("<!-- test-command -->", 1)[1].split("<!-- /test-command -->", 1)[0]
    assert block.strip().strip("`").strip() == TEST_COMMAND


def test_passing_tests_pass(tmp_path):
    rc, out = ci(tmp_path, f"{sys.executable} -m pytest -q -p no:cacheprovider t_ok.py",
                 {"t_ok.py": "def test_ok():\n    assert 1 + 1 == 2\n"})
    assert rc == 0, out
    assert "1 passed" in out


def test_failing_tests_fail(tmp_path):
    rc, out = ci(tmp_path, f"{sys.executable} -m pytest -q -p no:cacheprovider t_bad.py",
                 {"t_bad.py": "def test_bad():\n    assert 1 + 1 == 3\n"})
    assert rc == 1 and "failed with exit status 1" in out


def test_no_tests_collected_fails(tmp_path):
    (tmp_path / "empty").mkdir()
    rc, out = ci(tmp_path, f"{sys.executable} -m pytest -q -p no:cacheprovider empty")
    assert rc == 5 and "collected no tests" in out


@pytest.mark.parametrize("cmd, why", [(None, "has no command"), ("   ", "has no command"), ("true", "does not run pytest")])
def test_missing_or_non_test_command_fails(tmp_path, cmd, why):
    rc, out = ci(tmp_path, cmd)
    assert rc == 1 and why in out
