"""runmap.atomic: outputs appear whole or not at all."""
import sys

import pytest

from runmap import atomic


def _tree(d):
    return sorted((p.relative_to(d).as_posix(), p.read_text()) for p in d.rglob("*") if p.is_file())


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_replace_dir_swaps_in_the_new_tree_and_removes_the_old(tmp_path, monkeypatch, exchange):
    out, tmp = tmp_path / "pack", tmp_path / ".pack.tmp"
    out.mkdir()
    (out / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "manifest.json").write_text("new")
    if not exchange:
        monkeypatch.setattr(atomic, "exchange_paths", lambda a, b: False)
    atomic.replace_dir(tmp, out)
    assert _tree(out) == [("manifest.json", "new")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"], "no temporary or old directory left behind"


def test_replace_dir_into_a_new_path(tmp_path):
    tmp = tmp_path / ".x.tmp"
    tmp.mkdir()
    (tmp / "a").write_text("1")
    atomic.replace_dir(tmp, tmp_path / "x")
    assert _tree(tmp_path / "x") == [("a", "1")] and not tmp.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux-only")
def test_exchange_paths_is_atomic_swap_on_linux(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "f").write_text("A")
    (b / "f").write_text("B")
    if not atomic.exchange_paths(a, b):
        pytest.skip("this filesystem does not support RENAME_EXCHANGE (replace_dir falls back to two renames)")
    assert (a / "f").read_text() == "B" and (b / "f").read_text() == "A"
    with pytest.raises(OSError):
        atomic.exchange_paths(a, tmp_path / "missing")


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    import os

    target = tmp_path / "summary.json"
    dead = tmp_path / ".summary.json.999999999-abcd.tmp"  # no such PID: a writer killed mid-write
    dead.write_text("{half")
    live = tmp_path / f".summary.json.{os.getppid()}-abcd.tmp"  # a live writer's: kept
    live.write_text("{")
    other = tmp_path / ".other.json.999999999-abcd.tmp"  # another target's: not this write's business
    other.write_text("{")
    atomic.write_json(target, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other.name])
    assert target.read_text() == '{\n  "a": 1\n}\n'
