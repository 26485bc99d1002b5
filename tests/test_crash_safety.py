"""Crash safety, tested by killing: `runmap pack`, `runmap ifeval generate` and `runmap bench` are SIGKILLed
at seeded random points, then rerun with the same command (bench: a campaign is either absent or a whole
published one, the earlier campaign of an interrupted `--overwrite` run survives byte for byte, and the rerun's
records equal an uninterrupted run's but for the volatile keys listed in BENCH_VOLATILE).

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
from pathlib import Path

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
HOOKS = [("os", "fsync"), ("os", "replace"), ("shutil", "copyfile"), ("runmap.atomic", "exchange_paths"),
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


def _uninterrupted_run(monkeypatch, argv, cwd) -> int:
    """Run ``runmap ARGV`` in a new folder ``cwd`` in this process, uninterrupted; returns how many durable
    steps it took (the range the kill points are drawn from)."""
    cwd.mkdir()
    with monkeypatch.context() as m:
        count = _install_counting(m)
        m.chdir(cwd)
        assert main(argv) == 0
        return count[0]


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
    total = _uninterrupted_run(monkeypatch, argv, ref_dir)
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


# ---- runmap bench ----------------------------------------------------------------------------------
# What differs between two runs of the same campaign: timing, timestamps, the run id (also quoted in the
# ratios' reasons), memory peaks and the same-run measured bandwidth with what is derived from it.
BENCH_VOLATILE = {
    "record": [("run_id",), ("created_utc",), ("timing",), ("memory",), ("h2d", "gb_s"),
               ("byte_floor", "copy_bandwidth_gb_s"), ("byte_floor", "floor_step_s"),
               ("byte_floor", "floor_decode_tok_s"), ("ratios", "decode_vs_byte_floor"),
               ("engine", "load_s"), ("engine", "timed_wall_s")],
    "campaign": [("run_id",), ("wall_s",), ("copy_bandwidth_gb_s",)],
}


def _normalised(doc, kind):
    doc = json.loads(json.dumps(doc).replace(doc["run_id"], "RUN_ID"))
    for path in BENCH_VOLATILE[kind]:
        *parent, last = path
        d = doc
        for k in parent:
            d = d[k]
        assert last in d, (kind, path)  # a volatile key the record no longer has: update the list
        d[last] = "VOLATILE"
    return doc


def _campaign_files(camp):
    return {str(p.relative_to(camp)): p.read_bytes() for p in sorted(camp.rglob("*")) if p.is_file()}


def _normalised_campaign(camp):
    recs = {p.name: _normalised(json.loads(p.read_text()), "record") for p in (camp / "records").iterdir()}
    return recs, _normalised(json.loads((camp / "campaign.json").read_text()), "campaign")


def test_bench_killed_at_random_points_then_rerun_equals_an_uninterrupted_campaign(tmp_path, monkeypatch, capsys):
    """A fresh output, then one holding an earlier campaign (killed during --overwrite runs): after every kill
    the campaign is absent (fresh) or the earlier one, byte for byte (never records without their
    campaign.json); the killed runs' temp directories accumulate without breaking the rerun, which removes
    them; the rerun equals an uninterrupted run apart from the volatile keys. Every step of publishing
    itself is killed in tests/test_bench_publish.py."""
    import yaml

    from runmap.bench import campaign as bench

    ck = write_synthetic(load_preset("tiny-olmoe")[0], tmp_path / "ck", seed=3)
    pk = pack_checkpoint(ck, tmp_path / "pk", device="cpu")
    group = {"kind": "engine", "models": ["m"], "resident": ["full"], "executors": ["reference"], "prompt_len": 4,
             "decode_len": 2}
    spec = {"name": "crash", "description": "crash safety", "device": "cpu", "defaults": {"repeats": 1, "warmup": 0},
            "models": {"m": {"preset": "tiny-olmoe", "pack": str(pk)}},
            "groups": [{"name": "b", "batch": [1, 2], **group}]}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = ["bench", str(tmp_path / "spec.yaml"), "--out", "out", "--device", "cpu", "--no-progress"]
    ref_dir = tmp_path / "reference"
    total = _uninterrupted_run(monkeypatch, argv, ref_dir)
    assert total >= 6  # record writes (each rewritten with its ratios), campaign.json, the publishing rename
    # (a fresh output is published by one os.replace, one over an existing campaign by one exchange_paths:
    # the same count, so every kill point drawn from the fresh run is reached by the --overwrite runs too)
    want = _normalised_campaign(ref_dir / "out" / "crash")
    assert sorted(want[0]) == ["m__engine__reference__r8__b1__p4__d2.json", "m__engine__reference__r8__b2__p4__d2.json"]
    work = tmp_path / "work"
    work.mkdir()
    out, camp = work / "out", work / "out" / "crash"

    def partials():
        return sorted(p.name for p in out.iterdir() if p.name.startswith(".crash.partial-")) if out.exists() else []

    for overwrite in (False, True):
        before = _campaign_files(camp) if overwrite else None
        cmd = argv + ["--overwrite"] * overwrite
        for n in _kill_points(total):  # the kills accumulate: each starts from what the last one left
            _killed_run(n, cmd, work)
            if before is None:  # a fresh output: the campaign appears whole (one rename) or not at all
                assert not camp.exists(), (n, os.listdir(camp))
            else:  # the earlier campaign, whole: the new one replaces it in one exchange, the last durable step
                if not camp.exists():  # a filesystem without the exchange, killed between its two renames
                    assert bench.recover_interrupted_publish(camp) == camp, n
                assert _campaign_files(camp) == before, n
            # hidden temp directories are never read as records: only a published records/ is
            assert all(Path(r["_path"]).parent == camp / "records" for r in bench.load_records(work)), n
            assert len(partials()) <= 1, (n, partials())  # a killed run's temp dir: removed by the next run
        monkeypatch.chdir(work)
        assert main(cmd) == 0, overwrite  # the same command, rerun
        assert partials() == [], overwrite  # the killed runs' leftovers are gone
        assert sorted(p.name for p in out.iterdir()) == ["crash"]
        assert _normalised_campaign(camp) == want, overwrite
        assert sorted(os.listdir(camp / "records")) == sorted(want[0])
    capsys.readouterr()


def test_bench_removes_only_dead_writers_temp_directories(tmp_path):
    """Leftover `.NAME.partial-PID-*` directories of dead processes are removed by the next run; a live
    process's, a failed run's kept output and other hidden files are not."""
    from runmap.bench import campaign as bench
    from test_bench_fakes import fake_factory, tiny_spec

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".t.partial-{dead_pid}-abc"
    (stale / "records").mkdir(parents=True)
    (stale / "records" / "x.json").write_text("{}")
    live = tmp_path / f".t.partial-{os.getppid()}-def"
    live.mkdir()
    failed = tmp_path / ".t.failed-ghi"
    failed.mkdir()
    other = tmp_path / ".tt.partial-1-xyz"
    other.mkdir()
    bench.run_campaign(tiny_spec(), tmp_path, engine_factory=fake_factory(), command="t", progress=False,
                       measure_bandwidth=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, failed.name, other.name, "t"])
