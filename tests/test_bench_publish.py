"""Publishing a campaign over an existing one, killed at every step: a campaign directory is always the old
campaign or the new one, byte for byte, never records without the campaign.json that describes them.

`_publish` (runmap/bench/campaign.py) runs in a forked child that sends itself SIGKILL on entering its N-th
filesystem-changing call (a rename, the atomic exchange, a link, a copy, a mkdir, an unlink, an rmdir: the
steps of shutil's copytree and rmtree included), for every N from 1 to the number an uninterrupted publish
makes; the child only touches files, so forking a process with torch imported is safe. Both ways of
publishing are killed: the atomic exchange (renameat2) and the two renames used where a filesystem lacks it,
whose one window without a campaign directory the next run closes (`recover_interrupted_publish`). After
each kill the next `run_campaign` finds the old or the new campaign, refuses to overwrite it without
`overwrite=True`, and with it publishes cleanly, leaving no hidden directory behind.
"""
import importlib
import os
import shutil
import signal
import stat
from pathlib import Path

import pytest

from runmap import atomic
from runmap.bench import campaign as bench
from test_bench_fakes import fake_factory, tiny_spec

# (module, attribute) of every call of the publish path that changes the filesystem
STEPS = [("os", "replace"), ("os", "rename"), ("os", "link"), ("os", "mkdir"), ("os", "unlink"), ("os", "rmdir"),
         ("os", "chmod"), ("shutil", "copy2"), ("runmap.atomic", "exchange_paths")]


def _files(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _run(root, spec, **kw):
    return bench.run_campaign(spec, root, engine_factory=fake_factory(), command="pytest", progress=False,
                              measure_bandwidth=False, **kw)


@pytest.fixture()
def campaigns(tmp_path):
    """An old campaign in work/t (with a README and a notes folder a run does not own), and a new run's
    finished output in src/t (other configurations, so its records differ)."""
    work, src = tmp_path / "work", tmp_path / "src"
    _run(work, tiny_spec())
    camp = work / "t"
    (camp / "README.md").write_text("evidence\n")
    (camp / "notes").mkdir()
    (camp / "notes" / "a.md").write_text("kept\n")
    os.chmod(camp, 0o755)
    new_spec = tiny_spec()
    new_spec["groups"] = new_spec["groups"][2:]
    _run(src, new_spec)
    old = _files(camp)
    new = {**_files(src / "t"), "README.md": b"evidence\n", "notes/a.md": b"kept\n"}
    assert old != new and set(old) - set(new)  # the old records a mix would show
    return work, src / "t", old, new


def _hooked(count, n_kill):
    for mod, attr in STEPS:
        obj = importlib.import_module(mod)
        orig = getattr(obj, attr)

        def hooked(*a, _orig=orig, **k):
            count[0] += 1
            if count[0] == n_kill:
                os.kill(os.getpid(), signal.SIGKILL)
            return _orig(*a, **k)

        setattr(obj, attr, hooked)


def _publish_in_child(src: Path, work: Path, n_kill: int) -> tuple[int, int]:
    """Fork; the child copies the finished output to its own temp directory (as run_campaign names it),
    then publishes it with the hooks armed. Returns (wait status, the steps it counted)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but file operations, then _exit
        code = 1
        try:
            os.close(r)
            tmp = work / f".t.partial-{os.getpid()}-x"
            shutil.copytree(src, tmp)
            count = [0]
            _hooked(count, n_kill)
            bench._publish(tmp, work / "t")
            os.write(w, str(count[0]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        counted = f.read()
    _, status = os.waitpid(pid, 0)
    return status, int(counted or 0)


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "two-renames"])
def test_publish_killed_at_every_step_leaves_the_old_or_the_new_campaign(campaigns, tmp_path, monkeypatch, exchange,
                                                                          capsys):
    work, src, old, new = campaigns
    camp = work / "t"
    if not exchange:
        monkeypatch.setattr(atomic, "exchange_paths", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    elif not atomic.exchange_paths(tmp_path / "src", tmp_path / "work"):
        pytest.skip("this filesystem has no atomic exchange")
    else:
        atomic.exchange_paths(tmp_path / "src", tmp_path / "work")  # swap the probe back
    pristine = tmp_path / "pristine"
    shutil.copytree(work, pristine, symlinks=True)
    status, total = _publish_in_child(src, work, 0)  # uninterrupted: count the steps
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert _files(camp) == new and sorted(os.listdir(work)) == ["t"]
    assert stat.S_IMODE(camp.stat().st_mode) == 0o755  # the campaign directory kept its mode
    assert total >= (4 if exchange else 5)  # links, mkdir, chmod, the exchange or the renames, rmtree's unlinks
    outcomes = set()
    for n in range(1, total + 1):
        shutil.rmtree(work)
        shutil.copytree(pristine, work, symlinks=True)
        status, _ = _publish_in_child(src, work, n)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, n
        if camp.exists():
            state = _files(camp)
            assert state in (old, new), (n, sorted(set(state) ^ set(old)), sorted(set(state) ^ set(new)))
        else:  # only between the fallback's two renames: the old campaign is parked, the new one in the temp dir
            assert not exchange, n
            parked = [p for p in work.iterdir() if p.name.startswith(".t.old-")]
            assert len(parked) == 1 and _files(parked[0]) == old, n
            assert bench.recover_interrupted_publish(camp) == camp, n
            assert _files(camp) == old, n
        outcomes.add("old" if _files(camp) == old else "new")
        # the next run sees a complete campaign: refused without overwrite, nothing written
        listing = sorted(os.listdir(work))
        with pytest.raises(bench.OutputExistsError):
            _run(work, tiny_spec())
        assert sorted(os.listdir(work)) == [x for x in listing if not x.startswith(".t.old-")], n
        spec = tiny_spec()
        spec["groups"] = spec["groups"][:1]
        summary = _run(work, spec, overwrite=True)
        assert sorted(os.listdir(work)) == ["t"], n  # every killed publish's leftovers are gone
        assert sorted(p.stem for p in (camp / "records").iterdir()) == sorted(summary["done"]), n
        assert (camp / "README.md").read_text() == "evidence\n" and (camp / "notes" / "a.md").is_file(), n
    assert outcomes == {"old", "new"}  # kills before and after the switch were both reached
    capsys.readouterr()


def test_recovery_puts_back_only_a_dead_writers_parked_campaign(campaigns, capsys):
    """A parked `.t.old-PID-*` of a live process (a publish in progress) is left alone; a dead one's is
    renamed back when the campaign directory is missing, and removed when it exists."""
    work, _, old, _ = campaigns
    camp = work / "t"
    parked_live = work / f".t.old-{os.getppid()}-a"
    os.replace(camp, parked_live)
    assert bench.recover_interrupted_publish(camp) is None and not camp.exists()
    parked_dead = work / ".t.old-999999999-b"  # beyond pid_max: no such process
    os.replace(parked_live, parked_dead)
    assert bench.recover_interrupted_publish(camp) == camp and _files(camp) == old
    assert "restored" in capsys.readouterr().err
    leftover = work / ".t.old-999999999-c"
    (leftover / "records").mkdir(parents=True)
    assert bench.recover_interrupted_publish(camp) is None
    assert sorted(os.listdir(work)) == ["t"] and _files(camp) == old


def test_records_without_campaign_json_are_named_an_incomplete_campaign(campaigns):
    """What an earlier version's publish could leave when killed (it removed campaign.json first)."""
    work, _, _, _ = campaigns
    (work / "t" / "campaign.json").unlink()
    with pytest.raises(bench.OutputExistsError, match="no campaign.json: not a complete campaign"):
        _run(work, tiny_spec())


def test_publish_through_a_symlinked_campaign_directory(tmp_path):
    """OUT/<campaign> may be a link to a directory elsewhere: the target is replaced, the link stays."""
    elsewhere, out = tmp_path / "data" / "t", tmp_path / "out"
    _run(tmp_path / "data", tiny_spec())
    (elsewhere / "README.md").write_text("evidence\n")
    out.mkdir()
    (out / "t").symlink_to(elsewhere)
    spec = tiny_spec()
    spec["groups"] = spec["groups"][2:]
    summary = _run(out, spec, overwrite=True)
    assert (out / "t").is_symlink() and (out / "t").resolve() == elsewhere.resolve()
    assert sorted(p.stem for p in (elsewhere / "records").iterdir()) == sorted(summary["done"])
    assert (elsewhere / "README.md").read_text() == "evidence\n"
    assert sorted(os.listdir(out)) == ["t"] and sorted(os.listdir(tmp_path / "data")) == ["t"]
