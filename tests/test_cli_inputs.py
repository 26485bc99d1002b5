"""Bad input never ends in a traceback, and every subcommand follows one exit-code convention.

Hypothesis draws argument vectors for `runmap pack`, `validate`, `synth`, `generate`, `logits`,
`ifeval score`, `report` and `bench` from each subcommand's own parser (random subsets of its flags, random
values of the wrong type or range, nonexistent paths, files where directories are expected and the
reverse), runs them in-process in an empty temporary working directory and asserts: the exit status is one
of the convention in `runmap --help` (0, 1, 2; 3 only from `bench`, whose --deadline-s can skip
configurations; 130 is Ctrl-C's, which no vector sends), no traceback is printed, and nothing is created
or changed in the working directory except at a path named on the command line or a subcommand's
documented default output; the shared fixtures are never changed.
Random corruptions of a pack manifest (a key deleted, a value of another type, a file name pointing
outside the pack) go to `runmap validate` and Engine.from_pack, which must refuse them with an error of
the kinds the CLI reports in one line (never TypeError, KeyError, AttributeError, IndexError, ...).

`runmap bench` gets campaign specs made for it: a tiny valid one (one configuration of the tiny pack with
the reference executor, 2 prompt and 2 decode tokens, no warmup, one repeat: a real run of a few seconds),
one whose pack is missing (the configuration fails), and the wrong files every subcommand gets; its
--pack/--checkpoint values name the spec's model or not, its --only values are regular expressions or
not. Its run-start copy-bandwidth probe is shrunk from 256 MiB to 1 MiB (on the CPU the 256 MiB fill alone
takes about 2 s per run, and the probe's figure is not what this test checks), which keeps the bench
examples within about 30 s.
"""
import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runmap.arch.config import load_preset
from runmap.cli.main import build_parser, main
from runmap.format.pack import pack_checkpoint
from runmap.synth.checkpoint import write_synthetic

SUBCOMMANDS = [("pack",), ("validate",), ("synth",), ("generate",), ("logits",), ("ifeval", "score"), ("report",),
               ("bench",)]
# runmap --help: 0 success, 1 bad input / failed check or run, 2 usage, 3 bench's deadline skipped some
EXIT_CODES = {path: {0, 1, 2, 3} if path == ("bench",) else {0, 1, 2} for path in SUBCOMMANDS}
# a subcommand's documented default output (report: results/report.md, bench: results/campaigns/)
DEFAULT_OUTPUTS = {"report": "results", "bench": "results/campaigns"}
EXAMPLES = int(os.environ.get("RUNMAP_CLI_EXAMPLES", "12"))  # per subcommand; 12 keeps the module well under 40 s
CLI_SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _bench_spec(pack: str) -> dict:
    return {"name": "tiny", "description": "argument-vector test", "device": "cpu",
            "defaults": {"repeats": 1, "warmup": 0},
            "models": {"m": {"preset": "tiny-olmoe", "pack": pack}},
            "groups": [{"name": "g", "kind": "engine", "models": ["m"], "resident": ["full"],
                        "executors": ["reference"], "batch": 1, "prompt_len": 2, "decode_len": 2}]}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """A tiny checkpoint, its pack and two campaign specs, outside every example's working directory
    (read-only for them)."""
    import yaml

    base = tmp_path_factory.mktemp("cli-inputs")
    ck = write_synthetic(load_preset("tiny-olmoe")[0], base / "ck", seed=1)
    pk = pack_checkpoint(ck, base / "pack", device="cpu")
    spec, nopack = base / "spec.yaml", base / "spec-nopack.yaml"
    spec.write_text(yaml.safe_dump(_bench_spec(str(pk))))
    nopack.write_text(yaml.safe_dump(_bench_spec("missing-pack")))  # relative: never there in the empty cwd
    return {"checkpoint": ck, "pack": pk, "spec": spec, "spec-nopack": nopack}


@pytest.fixture()
def small_bandwidth_probe(monkeypatch):
    import functools

    from runmap.bench import metrics

    monkeypatch.setattr(metrics, "copy_bandwidth", functools.partial(metrics.copy_bandwidth, nbytes=1 << 20))


def _snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st_ = p.lstat()
            out[p.relative_to(root).as_posix()] = (p.is_dir(), st_.st_size, st_.st_mtime_ns)
    return out


def _parser_actions(path: tuple[str, ...]):
    """(optionals, positionals) of a subcommand's parser."""
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    opts = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    pos = [a for a in parser._actions if not a.option_strings and a.__class__.__name__ != "_SubParsersAction"]
    return opts, pos


# Values for one argument. "@pack" / "@checkpoint" are replaced by the fixture paths (read-only inputs);
# every other path is relative to the example's empty working directory.
SAFE_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=12)
PATHS = st.sampled_from(["missing", "missing/deeper/x.json", "afile.txt", "adir", "adir/", "out/new",
                         "out.safetensors", "../escape-attempt-not-used", ".", "@pack", "@checkpoint"])
NUMBERS = st.one_of(st.integers(-(2 ** 70), 2 ** 70).map(str), st.sampled_from(["0", "-1", "1", "3", "1e9", "nan",
                                                                                 "inf", "-0.5", "0x10", ""]))
VALUES = st.one_of(PATHS, NUMBERS, SAFE_TEXT, st.sampled_from(["5,6,7", "1,,x", "tiny-olmoe", "nosuch=x"]))
# bench: NAME=DIR pairs (m is the specs' model) and --only expressions, well-formed or not
PAIRS = st.sampled_from(["m=@pack", "m=@checkpoint", "m=adir", "m=afile.txt", "m=missing", "nosuch=@pack", "m",
                         "=adir", "m=", "m=@pack=x"])
REGEXES = st.sampled_from(["(", "[a-", "*", "b1", "^m__engine", "nomatch", ".*", "", "(?P<x>"])
# inputs that would make a valid run long or large are kept out: the real OLMoE preset (a 14 GB synth)
FORBIDDEN = {"olmoe-1b-7b-0924", "qwen1.5-moe-a2.7b"}


def _value_for(action, draw):
    """Mostly a value of the right kind (a choice, a number for a typed option), sometimes anything."""
    if draw(st.integers(0, 4)) == 0:
        return draw(VALUES)
    if action.choices:
        return draw(st.sampled_from(sorted(map(str, action.choices))))
    if action.type in (int, float):
        return draw(NUMBERS)
    if action.dest == "preset":
        return draw(st.sampled_from(["tiny-olmoe", "tiny-qwen2-moe", "no-such-preset"]))
    if action.dest == "spec":  # bench's campaign spec
        return draw(st.sampled_from(["@spec", "@spec", "@spec-nopack"]))
    if action.dest in ("pack", "checkpoint") and action.metavar == "NAME=DIR":
        return draw(PAIRS)
    if action.dest == "only":
        return draw(REGEXES)
    return draw(VALUES)


@st.composite
def argvs(draw, path):
    opts, pos = _parser_actions(path)
    argv = list(path)
    chosen = draw(st.lists(st.sampled_from(opts), max_size=len(opts), unique_by=lambda a: a.dest)) if opts else []
    # required options are given most of the time, so most vectors get past argparse
    chosen += [a for a in opts if a.required and a not in chosen and draw(st.integers(0, 9)) > 0]
    for a in chosen:
        flag = draw(st.sampled_from(a.option_strings))
        if a.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, _value_for(a, draw)]
    for a in pos:
        n = draw(st.integers(0, 2)) if a.nargs in ("*", "?") else 1
        if draw(st.integers(0, 9)) == 0:
            n = 0  # a missing positional: a usage error
        argv += [_value_for(a, draw) for _ in range(n)]
    if draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(1, len(argv))), draw(st.sampled_from(["--no-such-flag", "-x", "--", "-"])))
    return argv


def _fixture_path(v: str, fixtures) -> str:
    """'@NAME' (alone, or as the DIR of a NAME=DIR pair) -> the fixture's path."""
    head, sep, tail = v.rpartition("=") if "=@" in v else ("", "", v)
    if tail.startswith("@") and tail[1:] in fixtures:
        return head + sep + str(fixtures[tail[1:]])
    return v


def _resolve(argv, fixtures, path):
    if path == ("bench",):
        # the output root is never a fixture's folder (a run would write its campaign into it)
        argv = ["out" if a == "--out" and b.startswith("@") else b for a, b in zip([""] + argv, argv)]
    out = [_fixture_path(v, fixtures) for v in argv]
    if path == ("pack",):
        # the pack output (second positional) must never be a fixture: --force would replace the shared pack
        out = [v if v not in (str(fixtures["pack"]),) or "--packed" in out else "out/p" for v in out]
    if path == ("synth",):
        out = ["tiny-olmoe" if v in FORBIDDEN else v for v in out]
    if path in (("generate",), ("logits",)):
        # a valid pack would run the engine (slow in Triton's interpreter): these see bad packs only
        out = ["adir" if v == str(fixtures["pack"]) else v for v in out]
    return out


def _run_in_empty_cwd(argv):
    with tempfile.TemporaryDirectory() as d:
        cwd = Path(d) / "cwd"
        cwd.mkdir()
        (cwd / "afile.txt").write_text("not what any subcommand expects\n")
        (cwd / "adir").mkdir()
        (cwd / "adir/junk.bin").write_bytes(b"\x00\xff")
        before = _snapshot(cwd)
        old = os.getcwd()
        out, err = io.StringIO(), io.StringIO()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = main(argv)
                except SystemExit as e:  # argparse: --help (0) or a usage error (2)
                    rc = e.code
        finally:
            os.chdir(old)
        after = _snapshot(cwd)
    return rc, out.getvalue(), err.getvalue(), before, after


def _named(rel: str, argv) -> bool:
    """True when ``rel`` (a path below the working directory) is, or lies below, a path named in argv."""
    for v in argv:
        if v in (".", "./"):  # the working directory itself
            return True
        v = v.rstrip("/")
        if v and (rel == v or rel.startswith(v + "/")):  # an option's value may start with "-" too
            return True
        if v.startswith("--") and "=" in v and rel.startswith(v.split("=", 1)[1]):
            return True
    return False


def _fixture_state(fixtures) -> dict:
    return {k: _snapshot(p) if p.is_dir() else p.read_bytes() for k, p in fixtures.items()}


def _check(argv, fixtures, path):
    fx_before = _fixture_state(fixtures)
    rc, out, err, before, after = _run_in_empty_cwd(argv)
    assert rc in EXIT_CODES[path], (argv, rc, err)
    assert "Traceback" not in out + err, (argv, err)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    # the parent folders of a named output that the run created (mkdir -p, as for any output path) belong to it
    made = [a for a in after if _named(a, argv)]
    stray = [k for k in changed if not _named(k, argv) and not any(a.startswith(k + "/") for a in made)]
    # a subcommand's documented default output path counts as named
    default = DEFAULT_OUTPUTS.get(argv[0])
    stray = [k for k in stray if not default or not (k == default or k.startswith(default + "/")
                                                     or default.startswith(k + "/"))]
    assert not stray, (argv, stray)
    assert _fixture_state(fixtures) == fx_before, argv
    if rc == 1:
        assert err.strip() or out.strip(), argv  # a failure says why
    return rc


@pytest.mark.parametrize("path", SUBCOMMANDS, ids=" ".join)
def test_random_argument_vectors(fixtures, small_bandwidth_probe, path):
    @CLI_SETTINGS
    @given(argvs(path))
    def prop(argv):
        _check(_resolve(argv, fixtures, path), fixtures, path)

    prop()


def test_an_output_below_missing_folders_creates_them_and_nothing_else(fixtures, small_bandwidth_probe):
    # found by the random vectors: the folders above a named output are made for it, and only those
    assert _check(["synth", "--preset", "tiny-olmoe", "missing/deeper/x.json"], fixtures, ("synth",)) == 0


# Each exit status bench can give, reached on purpose (the random vectors above reach them only by chance).
BENCH_CASES = {
    "run": (["bench", "@spec", "--out", "out", "--no-progress"], 0),  # a real run of the tiny configuration
    "default-out": (["bench", "@spec", "--no-progress"], 0),  # into the documented default, results/campaigns/
    "failing-config": (["bench", "@spec-nopack", "--out", "out", "--no-progress"], 1),  # no pack
    "not-a-spec": (["bench", "afile.txt"], 1),
    "bad-regex": (["bench", "@spec", "--only", "("], 2),
    "unknown-model": (["bench", "@spec", "--pack", "nosuch=@pack"], 2),
    "deadline": (["bench", "@spec", "--out", "out", "--deadline-s", "0", "--no-progress"], 3),  # all skipped
    "negative-deadline": (["bench", "@spec", "--deadline-s", "-1"], 2),
    "nan-deadline": (["bench", "@spec", "--deadline-s", "nan"], 2),
    "out-is-a-file": (["bench", "@spec", "--out", "afile.txt", "--no-progress"], 1),
    "pack-is-not-a-pack": (["bench", "@spec", "--pack", "m=adir", "--out", "out", "--no-progress"], 1),
}


@pytest.mark.parametrize("argv,want", BENCH_CASES.values(), ids=BENCH_CASES.keys())
def test_bench_exit_statuses(fixtures, small_bandwidth_probe, argv, want):
    argv = _resolve(argv, fixtures, ("bench",))
    rc = _check(argv, fixtures, ("bench",))
    assert rc == want, argv


def test_ctrl_c_during_a_bench_run_exits_130_without_a_traceback(fixtures, small_bandwidth_probe, monkeypatch):
    """Ctrl-C (KeyboardInterrupt in the main thread) while a configuration runs: exit status 130, the line
    'interrupted', no traceback, and nothing written outside the output path."""
    from runmap.bench import campaign

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(campaign, "run_config", interrupted)
    argv = _resolve(["bench", "@spec", "--out", "out", "--no-progress"], fixtures, ("bench",))
    try:
        rc, out, err, before, after = _run_in_empty_cwd(argv)
    except KeyboardInterrupt:  # escaping main() would also stop this pytest session: fail instead
        pytest.fail("KeyboardInterrupt escaped runmap's main()")
    assert rc == 130 and "interrupted" in err and "Traceback" not in out + err, (rc, err)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert changed and all(k == "out" or k.startswith("out/") for k in changed), changed


# ---- manifest corruptions -------------------------------------------------------------------------
def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            yield from _paths(v, prefix + (i,))


OTHER_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 2 ** 40), st.floats(allow_nan=True),
                         st.text(max_size=5), st.just([]), st.just({}), st.just([1, "a"]),
                         st.sampled_from(["../nonrouted.safetensors", "/etc/passwd", "..", "sub/x", "nonrouted.safetensors"]))


@st.composite
def corruptions(draw, manifest):
    paths = [p for p in _paths(manifest) if p]
    where = draw(st.sampled_from(paths))
    op = draw(st.sampled_from(["delete", "replace"]))
    return where, op, (None if op == "delete" else draw(OTHER_VALUES))


def _apply(manifest, where, op, value):
    m = json.loads(json.dumps(manifest))
    parent = m
    for k in where[:-1]:
        parent = parent[k]
    if op == "delete":
        del parent[where[-1]]
    else:
        parent[where[-1]] = value
    return m


PROMPT = [5, 6, 7, 8]


def test_random_manifest_corruptions(fixtures, tmp_path_factory):
    from runmap.engine.engine import Engine

    manifest = json.loads((fixtures["pack"] / "manifest.json").read_text())
    work = tmp_path_factory.mktemp("corrupt")
    ref = Engine.from_pack(fixtures["pack"], executor="reference", device="cpu", max_batch=1, max_seq_len=16)
    want = ref.logits(PROMPT)
    ref.close()
    allowed = (ValueError, RuntimeError, OSError)  # what `runmap generate`/`logits` report in one line

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(corruptions(manifest))
    def prop(c):
        where, op, value = c
        d = work / "pack"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(fixtures["pack"], d)
        m = _apply(manifest, where, op, value)
        (d / "manifest.json").write_text(json.dumps(m))
        rc, out, err, *_ = _run_in_empty_cwd(["validate", str(d)])
        assert rc in (0, 1) and "Traceback" not in out + err, (where, op, value, err)
        try:
            eng = Engine.from_pack(d, executor="reference", device="cpu", max_batch=1, max_seq_len=16)
        except allowed as e:
            assert str(e), (where, op, value)
            assert type(e).__name__ not in ("KeyError", "IndexError"), (where, op, value, e)
            assert rc == 1, (where, op, value, e)  # what the engine refuses, validate fails too
        else:  # an accepted manifest edit (a field nothing computes with) never changes the answer
            try:
                assert torch.equal(eng.logits(PROMPT), want), (where, op, value)
            finally:
                eng.close()

    prop()


def test_a_reader_that_goes_away_stops_runmap_quietly_with_status_141():
    """`runmap bench SPEC --list | head`: once the pipe's reader has gone, runmap stops with no error line and the
    SIGPIPE status; a broken pipe that is not standard output's stays an ordinary error."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    p = subprocess.Popen([sys.executable, "-m", "runmap", "bench", "specs/campaigns/h200-llama-matched.yaml", "--list"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=repo)
    p.stdout.close()  # the reader is gone before runmap writes its first line
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and err == b""


def test_a_broken_pipe_that_is_not_standard_output_is_an_error(monkeypatch, capsys):
    import importlib

    cli_main = importlib.import_module("runmap.cli.main")  # the module (runmap.cli.main is also the function's name)
    validate = importlib.import_module("runmap.cli.validate")

    def run(args):
        raise BrokenPipeError(32, "a client's socket")
    monkeypatch.setattr(validate, "run", run)
    monkeypatch.setattr(cli_main, "_stdout_is_pipe", lambda: False)
    assert main(["validate", "results/campaigns/h200-host-overhead/campaign.json"]) == 1
    assert "BrokenPipeError" in capsys.readouterr().err


class _Built(Exception):
    """Raised by the stand-ins below once the command has said how it builds its engine."""


@pytest.mark.parametrize("command", ["generate", "logits", "serve", "ifeval"])
def test_every_engine_command_takes_the_cache_contract_and_passes_it_on(fixtures, monkeypatch, command, tmp_path):
    """--cache-contract is a residency option of every command that builds an engine (placement host-read needs v2 on
    a GPU): each passes what was asked to Engine.from_pack, and v1 stays the default."""
    from runmap.engine.engine import Engine
    import runmap.serve.app as app

    seen = []

    def from_pack(pack, **kw):
        seen.append(kw)
        raise _Built()

    monkeypatch.setattr(Engine, "from_pack", staticmethod(from_pack))

    class Server:  # serve hands its loader to the server: call it here instead of starting one
        def __init__(self, load_engine, **kw):
            load_engine()

    monkeypatch.setattr(app, "Server", Server)
    tail = {"generate": ["--prompt", "x"], "logits": ["--tokens", "1,2", "--out", "unused.safetensors"],
            "serve": ["--port", "0"],
            "ifeval": ["--out", str(tmp_path / "answers.jsonl"), "--limit", "1", "--max-new-tokens", "4"]}[command]
    for contract in ("v2", None):
        head = ["ifeval", "generate"] if command == "ifeval" else [command]
        argv = [*head, "--packed", str(fixtures["pack"]), "--resident", "4", *tail]
        argv += ["--cache-contract", contract] if contract else []
        with contextlib.suppress(_Built):
            main(argv)
        assert seen and seen[-1]["cache_contract"] == (contract or "v1"), (argv, seen)


@pytest.mark.parametrize("argv", [
    ["generate", "--packed", "P", "--prompt", "x", "--max-new-tokens", "-5"],
    ["generate", "--packed", "P", "--prompt", "x", "--temperature", "-1"],
    ["generate", "--packed", "P", "--prompt", "x", "--top-p", "2"],
    ["generate", "--packed", "P", "--prompt", "x", "--top-p", "nan"],
    ["generate", "--packed", "P", "--prompt", "x", "--resident", "-1"],
    ["serve", "--packed", "P", "--resident", "0"],
    ["pack", "CK", "OUT", "--block-size", "7"],
    ["synth", "OUT", "--preset", "tiny-olmo"],
    ["synth", "OUT", "--preset", "tiny-olmoe", "--shard-size", "0"],
    ["synth", "OUT", "--preset", "tiny-olmoe", "--direct-pack", "--block-size", "0"],
    ["logits", "--packed", "P", "--out", "o.safetensors", "--tokens", "a,b"],
    ["ifeval", "generate", "--packed", "P", "--out", "a.jsonl", "--shard", "3/2"],
    ["ifeval", "generate", "--packed", "P", "--out", "a.jsonl", "--limit", "-1"],
    ["ifeval", "score", "--responses", "r.jsonl", "--out", "o", "--limit", "0"],
    ["ifeval", "merge", "a.jsonl", "--out", "o.jsonl", "--limit", "0"],
])
def test_an_out_of_range_value_is_a_usage_error(argv, capsys, tmp_path, monkeypatch):
    """Exit 2 (runmap --help: a malformed or out-of-range argument value), one line naming the option, before
    anything is read or written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    option = argv[-2]  # the bad value is the last
    assert e.value.code == 2 and f"argument {option}:" in err[-1] and not any("Traceback" in l for l in err), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
@pytest.mark.parametrize("command", ["generate", "logits"])
def test_device_cuda_without_cuda_is_one_clear_line(fixtures, capsys, command):
    """--device cuda where torch sees no GPU: exit 1 and one line saying so (never a fallback to the CPU, never an
    internal assertion)."""
    tail = ["--prompt", "x"] if command == "generate" else ["--tokens", "1,2", "--out", "unused.safetensors"]
    rc = main([command, "--packed", str(fixtures["pack"]), "--device", "cuda", *tail])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "no CUDA device here" in err[0] and "Error" not in err[0], err


def test_every_example_in_a_subcommands_help_parses():
    """The examples at the end of `runmap COMMAND --help` (EXAMPLES) are command lines the parser accepts as written,
    so they cannot drift from the options; every command a user runs first has them."""
    import shlex

    from runmap.cli.main import SUBCOMMANDS, build_parser

    parser = build_parser()
    seen = set()
    for name, mod in SUBCOMMANDS.items():
        text = getattr(mod, "EXAMPLES", None)
        if text is None:
            continue
        for line in text.splitlines()[1:]:
            for command in line.split("&&"):
                argv = shlex.split(command)
                assert argv[0] == "runmap", line
                parser.parse_args(argv[1:])  # SystemExit (exit 2) on a line that does not parse
                seen.add(argv[1])
    assert {"pack", "generate", "logits", "replay", "ifeval"} <= seen, seen
