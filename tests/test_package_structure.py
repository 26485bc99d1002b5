"""The package's shape: subpackages import only downward (no cycles, nothing through importlib), the
kernels live in the runmap namespace (never a top-level ``kernels``), and the registries are the one
source of the name lists that the CLI, the spec and the schemas repeat."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent

# Rank of each part of the package: a module may import a module of its own part or of a lower rank.
# Parts of equal rank are independent of each other (kernels and residency do not know each other).
RANKS = {
    "": 0, "resources": 0, "atomic": 0, "provenance": 0, "gpuslot": 0, "argtypes": 0,  # the root and its plain utilities
    "arch": 1, "conformance": 1,
    "format": 2,
    "kernels": 3, "residency": 3, "workload": 3,
    "engine": 4, "synth": 4,
    "bench": 5, "ifeval": 5,
    "serve": 6,  # the server runs the engine, IFEval (generate, score) and campaign reports (bench.report)
    "cli": 7, "__main__": 8,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[0] == "kernels":  # installed as runmap.kernels (pyproject package-dir)
        parts = ["runmap", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _sources() -> list[Path]:
    return sorted([*(REPO_ROOT / "runmap").rglob("*.py"), *(REPO_ROOT / "kernels").rglob("*.py")])


def _imports(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) of every runmap import in ``path`` (function-level ones too unless
    top_level_only). ``from runmap.x import y`` yields runmap.x.y when y is a module, else runmap.x."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in ("runmap", "kernels")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ("runmap", "kernels"):
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if _is_module(sub) else node.module))
    return out


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[:2] == ["runmap", "kernels"]:
        base = REPO_ROOT / "kernels" / Path(*parts[2:]) if len(parts) > 2 else REPO_ROOT / "kernels"
    else:
        base = REPO_ROOT / Path(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_every_part_has_a_rank():
    parts = {_part(_module_name(p)) for p in _sources()}
    assert parts <= set(RANKS), f"new part(s) {sorted(parts - set(RANKS))}: give them a rank in RANKS and docs/layout.md"


def test_imports_go_downward_only():
    bad = []
    for path in _sources():
        me = _part(_module_name(path))
        for line, target in _imports(path):
            if target.split(".")[0] == "kernels":
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: imports top-level {target!r} (use runmap.kernels)")
                continue
            other = _part(target)
            if other != me and RANKS[other] >= RANKS[me]:
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {me or 'runmap'} (rank {RANKS[me]}) imports "
                           f"{target} ({other or 'runmap'}, rank {RANKS[other]})")
    assert not bad, "\n".join(bad)


def test_no_module_level_import_cycle():
    graph = {}
    for path in _sources():
        me = _module_name(path)
        graph[me] = {t for _, t in _imports(path, top_level_only=True) if t != me}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_no_runmap_module_is_reached_through_importlib():
    """Imports are written as imports (ifeval's scorer may load the third-party checker package)."""
    offenders = []
    for path in _sources():
        # third-party modules only: if-verifiable's IFEval checkers, and the libraries whose versions a record names
        if path in (REPO_ROOT / "runmap" / "ifeval" / "score.py", REPO_ROOT / "runmap" / "provenance.py"):
            continue
        text = path.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            if "import_module(" in line or "__import__(" in line:
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_tests_and_tools_never_import_a_top_level_kernels():
    roots = [REPO_ROOT / d for d in ("tests", "benchmarks", "tools", "scripts") if (REPO_ROOT / d).is_dir()]
    bad = []
    for path in sorted(p for r in roots for p in r.rglob("*.py")):
        for line, target in _imports(path):
            if target.split(".")[0] == "kernels":
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {target}")
    assert not bad, "\n".join(bad)


def test_pyproject_lists_every_subpackage_and_maps_the_top_level_folders():
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    on_disk = {_module_name(p.parent / "__init__.py") for p in _sources() if p.name == "__init__.py"}
    assert on_disk <= listed, f"subpackages missing from pyproject packages: {sorted(on_disk - listed)}"
    assert project["package-dir"]["runmap.kernels"] == "kernels"
    assert not any(p == "kernels" or p.startswith("kernels.") for p in listed)
    for data in ("specs", "schemas", "data"):
        assert project["package-dir"][f"runmap.{data}"] == data


# ---- registries: one list of names each, agreeing with the spec and the schemas ---------------------

@pytest.fixture(scope="module")
def architecture():
    return yaml.safe_load((REPO_ROOT / "specs" / "architecture.yaml").read_text())


@pytest.fixture(scope="module")
def common_defs():
    return json.loads((REPO_ROOT / "schemas" / "common.schema.json").read_text())["$defs"]


def test_executor_registry_agrees_with_spec_and_schema(architecture, common_defs):
    from runmap.kernels.registry import EXECUTORS, GRAPH_SAFE_EXECUTORS

    assert tuple(EXECUTORS) == tuple(e["id"] for e in architecture["executors"])
    assert list(EXECUTORS) == common_defs["executor"]["enum"]
    assert GRAPH_SAFE_EXECUTORS == ("grouped", "topk-fused")
    assert all(e.description and callable(e.load) for e in EXECUTORS.values())


def test_observation_and_regime_registries_agree_with_spec_and_schema(architecture, common_defs):
    from runmap.residency.observations import REQUIRED_ZERO, STATUSES
    from runmap.residency.regimes import REGIME_NAMES

    assert {o["id"]: o["unit"] for o in architecture["observations"]["required_zero"]} == REQUIRED_ZERO
    assert list(REQUIRED_ZERO) == common_defs["observation_name"]["enum"]
    assert list(STATUSES) == common_defs["observation_status"]["enum"]
    assert REGIME_NAMES == tuple(r["id"] for r in architecture["regimes"])
    assert list(REGIME_NAMES) == common_defs["regime"]["enum"]


def test_bench_record_executors_are_the_registry_plus_the_baselines():
    from runmap.bench.registry import BASELINE_EXECUTORS, RECORD_EXECUTORS
    from runmap.kernels.registry import EXECUTOR_NAMES

    assert RECORD_EXECUTORS == EXECUTOR_NAMES + tuple(BASELINE_EXECUTORS)
    schema = json.loads((REPO_ROOT / "schemas" / "bench-record.schema.json").read_text())
    text = json.dumps(schema)
    for name in BASELINE_EXECUTORS:
        assert f'"{name}"' in text, f"bench-record schema does not allow baseline executor {name!r}"


@pytest.mark.parametrize("argv", [["generate"], ["logits"], ["ifeval", "generate"], ["serve", "--packed", "x"]])
def test_cli_executor_choices_come_from_the_registry(argv, capsys):
    from runmap.cli.main import main
    from runmap.kernels.registry import EXECUTOR_NAMES

    with pytest.raises(SystemExit):
        main([*argv, "--executor", "no-such-executor"])
    err = capsys.readouterr().err
    assert "no-such-executor" in err
    for name in EXECUTOR_NAMES:
        assert repr(name) in err or name in err


def test_help_does_not_import_torch():
    """`runmap --help` builds every subcommand's parser without the heavy stack (seconds under load)."""
    import subprocess
    import sys

    code = ("import sys; from runmap.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'triton', 'transformers', 'jsonschema', 'fastapi', 'uvicorn', 'pydantic',\n"
            "                     'prometheus_client') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "HEAVY []" in out, out[-500:]


def test_no_executor_list_is_written_out_in_the_product():
    """The names appear once, in runmap/kernels/registry.py (descriptions and tile defaults aside)."""
    needle = '"reference", "scalar", "grouped", "topk-fused"'
    hits = [str(p.relative_to(REPO_ROOT)) for p in _sources() if needle in p.read_text().replace("'", '"')]
    assert hits == [], hits


def test_check_kernels_help_names_the_default_token_counts(capsys):
    """`runmap check-kernels --help` states the M sets the check runs by default (written out there, since the
    parser must not import the kernels): the same lists as runmap.kernels.check.M_DEFAULT."""
    from runmap.cli.main import main
    from runmap.kernels.check import M_DEFAULT

    with pytest.raises(SystemExit):
        main(["check-kernels", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for device, ms in M_DEFAULT.items():
        assert f"{','.join(map(str, ms))} on {device}" in text, device
