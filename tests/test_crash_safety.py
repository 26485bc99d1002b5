"""Crash safety, tested by killing: `runmap pack` and `runmap ifeval generate` are SIGKILLed at seeded random
points, then rerun with the same command.

A kill point is the N-th call of one of the steps that make output durable (a tensor write, an fsync, a
copy, an atomic rename); the child process sends itself SIGKILL on entering that call, so every step before
it has happened and none after. The total number of such calls is counted on an uninterrupted run in this
process, and N is drawn from it with a fixed seed.

After each kill: no partial output is taken for complete (`runmap validate` fails on what the pack left, the
output directory is absent or a complete pack, an IFEval sidecar is not "complete" and `runmap ifeval score`
refuses it); after the rerun the result equals an uninterrupted run's, byte for byte (the pack's manifest
apart from its timestamps, timings and memory figures; the IFEval answers file entirely), with no leftover
temporary directory, and IFEval never repeats or loses a prompt.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

from runmap.arch.config import load_preset
from runmap.cli.main import main
from runmap.format.pack import pack_checkpoint
from runmap.format.packfile import check_pack
from runmap.ifeval import generate as G
from runmap.synth.checkpoint import write_synthetic

SEED = 20
KILLS = 3  # kill points per command (each is one subprocess: about 3 s of imports)

# Kill hooks: (module, attribute) of each durable step, in the child and in the counting run.
HOOKS = [("os", "fsync"), ("os", "replace"), ("shutil", "copyfile"),
         ("runmap.format.safetensors_io", "StreamingWriter.write")]

CHILD = r"""
import importlib, os, signal, sys
n_kill, hooks, argv = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
count = [0]
def wrap(orig):
    def hooked(*a, **k):
        count[0] += 1
        if count[0] == n_kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*a, **k)
    return hooked
for h in hooks:
    mod, attr = h.split(":")
    obj = importlib.import_module(mod)
    *owner, name = attr.split(".")
    for o in owner:
        obj = getattr(obj, o)
    setattr(obj, name, wrap(getattr(obj, name)))
from runmap.cli.main import main
sys.exit(main(argv))
"""


def _install_counting(monkeypatch):
    import importlib

    count = [0]
    for mod, attr in HOOKS:
        obj = importlib.import_module(mod)
        *owner, name = attr.split(".")
        for o in owner:
            obj = getattr(obj, o)
        orig = getattr(obj, name)

        def hooked(*a, _orig=orig, **k):
            count[0] += 1
            return _orig(*a, **k)

        monkeypatch.setattr(obj, name, hooked)
    return count


def _killed_run(n_kill, argv, cwd):
    hooks = ",".join(f"{m}:{a}" for m, a in HOOKS)
    p = subprocess.run([sys.executable, "-c", CHILD, str(n_kill), hooks, *argv], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, (n_kill, p.returncode, p.stderr[-2000:])
    return p


def _kill_points(total):
    return sorted(random.Random(SEED).sample(range(1, total + 1), min(KILLS, total)))


# ---- runmap pack -----------------------------------------------------------------------------------
VOLATILE = ("created_utc", "timing", "memory")


def _pack_bytes(d):
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.name != "manifest.json"}
    m = json.loads((d / "manifest.json").read_text())
    return files, {k: v for k, v in m.items() if k not in VOLATILE}


def test_pack_killed_at_random_points_then_rerun_equals_an_uninterrupted_pack(tmp_path, monkeypatch, capsys):
    ck = write_synthetic(load_preset("tiny-olmoe")[0], tmp_path / "ck", seed=2)
    with monkeypatch.context() as m:
        count = _install_counting(m)
        want = _pack_bytes(pack_checkpoint(ck, tmp_path / "reference", device="cpu"))
        total = count[0]
    assert total >= 8  # non-routed + layer tensor writes, fsyncs, copies, the manifest and dir renames
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the relative output path "p" lies in work, for the child and the rerun alike
    argv = ["pack", str(ck), "p", "--device", "cpu", "--no-progress"]
    for n in _kill_points(total):
        _killed_run(n, argv, work)
        left = sorted(os.listdir(work))
        assert not (work / "p").exists() or not check_pack(work / "p"), (n, left)  # absent or complete
        if left and left != ["p"]:  # a killed pack left its temporary directory: never taken for a pack
            assert main(["validate", str(work)]) == 1, (n, left)
            assert "half-written" in capsys.readouterr().out or all(
                not os.listdir(work / x) for x in left if x != "p"), (n, left)
        if (work / "p").exists():
            shutil.rmtree(work / "p")  # killed after the final rename: the pack was complete
        assert main(argv) == 0, n  # the same command, rerun
        assert sorted(os.listdir(work)) == ["p"], n  # the killed run's leftovers are gone
        assert _pack_bytes(work / "p") == want, n
        assert check_pack(work / "p") == []
        shutil.rmtree(work / "p")
    capsys.readouterr()


# ---- runmap ifeval generate ------------------------------------------------------------------------
def test_ifeval_generate_killed_at_random_points_resumes_without_repeating_or_losing(tmp_path, monkeypatch):
    from runmap.ifeval import score as S

    ck = write_synthetic(load_preset("tiny-olmoe")[0], tmp_path / "ck", seed=2)
    pack = pack_checkpoint(ck, tmp_path / "pack", device="cpu")
    limit = 3
    argv = ["ifeval", "generate", "--packed", str(pack), "--out", "answers.jsonl", "--executor", "reference",
            "--max-new-tokens", "2", "--limit", str(limit), "--batch-size", "1", "--model-name", "tiny",
            "--no-progress"]
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("".join(G.DEFAULT_INPUTS.read_text().splitlines(keepends=True)[:limit]))
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    with monkeypatch.context() as m:
        count = _install_counting(m)
        m.chdir(ref_dir)
        assert main(argv) == 0
        total = count[0]
    want = (ref_dir / "answers.jsonl").read_bytes()
    prompts = [p.prompt for p in G.read_prompts(G.DEFAULT_INPUTS, limit)]
    assert sorted(json.loads(l)["prompt"] for l in want.decode().splitlines()) == sorted(prompts)
    for n in _kill_points(total):
        work = tmp_path / f"work-{n}"
        work.mkdir()
        _killed_run(n, argv, work)
        out, side = work / "answers.jsonl", G.sidecar_path(work / "answers.jsonl")
        if out.exists():  # what was saved is a prefix of the uninterrupted answers, never more
            assert want.startswith(out.read_bytes()), n
        if side.exists():
            meta = json.loads(side.read_text())
            if meta["status"] != "complete":
                with pytest.raises(S.IFEvalError):
                    S.score_files(inputs, out)  # a partial answers file is never scored as complete
        monkeypatch.chdir(work)
        assert main(argv) == 0, n  # the same command, rerun: resumes from what was saved
        assert out.read_bytes() == want, n  # no prompt repeated or lost, same answers in the same order
        meta = json.loads(side.read_text())
        assert meta["status"] == "complete" and meta["counts"] == {"prompts": limit, "answered": limit,
                                                                   "remaining": 0}
        # nothing else: a temporary sidecar the kill left is removed by the rerun's next atomic write
        assert sorted(os.listdir(work)) == ["answers.jsonl", "answers.jsonl.meta.json"], n
