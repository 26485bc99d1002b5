"""`runmap validate`: discovery by glob, error reports naming file / schema / JSON path / line, exit codes,
and the conformance summary it writes."""
from pathlib import Path
import json
import shutil
import subprocess

import pytest
import yaml

from runmap.cli.main import main
from runmap.conformance.schemas import ID_BASE, load_schemas, validate_file, validate_tree

REPO_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_CFG = yaml.safe_load((REPO_ROOT / "specs/pipeline/default.yaml").read_text())


def run_cli(capsys, *argv):
    rc = main(["validate", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A small tree: good and bad pipeline configs, an unclaimed results JSON, a binary file, a dot-dir."""
    (tmp_path / "specs/pipeline").mkdir(parents=True)
    (tmp_path / "specs/pipeline/good.yaml").write_text(yaml.safe_dump(DEFAULT_CFG))
    (tmp_path / "results/stuff").mkdir(parents=True)
    (tmp_path / "results/stuff/orphan.json").write_text("{}")
    (tmp_path / "results/stuff/blob.bin").write_bytes(b"\0\1")
    (tmp_path / "results/.tmp-pack").mkdir()
    (tmp_path / "results/.tmp-pack/bad.yaml").write_text("models: 3")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_good_tree_passes_with_unchecked_and_warning(tree, capsys):
    rc, out = run_cli(capsys, ".")
    assert rc == 0, out
    assert "unchecked results/stuff/blob.bin" in out
    assert "warning   results/stuff/orphan.json" in out
    assert ".tmp-pack" not in out  # dot-directories hold in-progress atomic writes: skipped
    assert "CONFORMANT: 1 files checked, 0 failed" in out


def test_bad_yaml_spec_names_file_schema_and_json_path(tree, capsys):
    (tree / "specs/pipeline/bad.yaml").write_text(yaml.safe_dump({**DEFAULT_CFG, "block_size": 255}))
    rc, out = run_cli(capsys, ".")
    assert rc == 1
    line = next(l for l in out.splitlines() if l.startswith("FAIL"))
    assert "specs/pipeline/bad.yaml: $.block_size:" in line
    assert "schema pipeline-config.schema.json at properties/block_size/multipleOf" in line
    assert "NOT CONFORMANT" in out


def test_parse_errors_name_the_line(tree, capsys):
    (tree / "specs/pipeline/broken.yaml").write_text("models: [a,\n  b\nseed: : 0\n")
    rc, out = run_cli(capsys, "specs")
    assert rc == 1
    assert "specs/pipeline/broken.yaml: $: cannot read:" in out and "line" in out


def test_missing_path_is_bad_input(tree, capsys):
    rc, out = run_cli(capsys, "nowhere")  # exit-code convention: 1 bad input, 2 only for argparse usage errors
    assert rc == 1 and "nowhere" in out and "Traceback" not in out


def test_nothing_to_check_is_not_success(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other/notes.txt").write_text("no artifact here")
    for d in ("empty", "other"):
        rc, out = run_cli(capsys, d, "--summary", tmp_path / f"{d}.json")
        assert rc == 1 and "zero files checked is not success" in out and "NOT CONFORMANT" in out
        s = json.loads((tmp_path / f"{d}.json").read_text())
        assert s["conformant"] is False and s["totals"]["files_checked"] == 0
        assert validate_file(tmp_path / f"{d}.json", "conformance") == []


@pytest.fixture
def record_schemas(tmp_path):
    """The repo's schemas plus a JSONL record schema that uses the shared observation definitions."""
    d = tmp_path / "schemas"
    shutil.copytree(REPO_ROOT / "schemas", d)
    (d / "probe-record.schema.json").write_text(json.dumps({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": ID_BASE + "probe-record.schema.json",
        "x-artifact-glob": ["probe/*.jsonl"],
        "type": "object", "required": ["executor", "observations"],
        "properties": {"executor": {"$ref": "common.schema.json#/$defs/executor"},
                       "observations": {"$ref": "common.schema.json#/$defs/contract_observations"}},
    }))
    return d


def _obs(**over):
    base = {n: {"status": "OBSERVED", "value": 0, "unit": "bytes"} for n in
            ("expert_d2h_bytes", "writebacks", "host_source_rewrites", "request_hash_work", "request_pack_reads")}
    base.update(over)
    return base


def test_jsonl_errors_carry_the_line(tmp_path, record_schemas, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "probe").mkdir()
    lines = [{"executor": "grouped", "observations": _obs()},
             {"executor": "scalar", "observations": _obs()},
             {"executor": "warp", "observations": _obs()}]
    (tmp_path / "probe/r.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n\n{not json\n")
    rc, out = run_cli(capsys, "probe", "--schemas-dir", record_schemas)
    assert rc == 1
    assert "probe/r.jsonl:3: $.executor: 'warp' is not one of" in out
    assert "probe/r.jsonl:5: $: not valid JSON" in out


def test_observed_nonzero_is_a_contract_violation_and_unknown_is_not(tmp_path, record_schemas, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "probe").mkdir()
    unknown = {"status": "UNKNOWN", "unit": "bytes", "reason": "not instrumented on this platform"}
    (tmp_path / "probe/ok.jsonl").write_text(json.dumps({"executor": "grouped", "observations": _obs(request_pack_reads=unknown)}) + "\n")
    summary = tmp_path / "results/conformance/summary.json"
    rc, out = run_cli(capsys, "probe", "--schemas-dir", record_schemas, "--summary", summary)
    assert rc == 0, out
    s = json.loads(summary.read_text())
    assert s["conformant"] is True
    assert s["observations"]["by_name"]["request_pack_reads"] == {"observed_zero": 0, "observed_nonzero": 0, "unknown": 1, "unsupported": 0}
    assert s["observations"]["by_name"]["expert_d2h_bytes"]["observed_zero"] == 1

    bad = _obs(expert_d2h_bytes={"status": "OBSERVED", "value": 3145728, "unit": "bytes"})
    (tmp_path / "probe/bad.jsonl").write_text(json.dumps({"executor": "scalar", "observations": bad}) + "\n")
    rc, out = run_cli(capsys, "probe", "--schemas-dir", record_schemas, "--summary", summary)
    assert rc == 1
    assert "CONTRACT  probe/bad.jsonl:1: $.observations.expert_d2h_bytes: expert_d2h_bytes observed as 3145728" in out
    s = json.loads(summary.read_text())
    assert s["conformant"] is False and s["totals"]["files_failed"] == 0
    assert s["observations"]["violations"] == [{"file": "probe/bad.jsonl", "json_path": "$.observations.expert_d2h_bytes",
                                                "name": "expert_d2h_bytes", "value": 3145728, "line": 1}]


def test_a_zero_written_without_measurement_is_rejected(tmp_path, record_schemas, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "probe").mkdir()
    fake = _obs(writebacks={"status": "UNKNOWN", "value": 0, "reason": "x"})
    (tmp_path / "probe/r.jsonl").write_text(json.dumps({"executor": "scalar", "observations": fake}) + "\n")
    rc, out = run_cli(capsys, "probe", "--schemas-dir", record_schemas)
    assert rc == 1 and "probe/r.jsonl:1: $.observations.writebacks:" in out


def test_summary_is_written_on_failure_and_conforms(tree, capsys):
    (tree / "specs/pipeline/bad.yaml").write_text(yaml.safe_dump({**DEFAULT_CFG, "models": []}))
    out_path = tree / "results/conformance/summary.json"
    rc, _ = run_cli(capsys, "specs", "results", "--summary", out_path)
    assert rc == 1
    s = json.loads(out_path.read_text())
    assert load_schemas().validate_document(s, "conformance") == []
    assert s["conformant"] is False
    assert s["totals"] == {"files_checked": 2, "files_passed": 1, "files_failed": 1, "violations": 1,
                           "unchecked": 2, "warnings": 1, "observation_violations": 0}
    bad = next(f for f in s["files"] if f["status"] == "fail")
    assert bad["path"] == "specs/pipeline/bad.yaml"
    assert bad["violations"][0]["json_path"] == "$.models"
    assert s["schemas"]["pipeline-config.schema.json"]["files_checked"] == 2
    assert s["roots"] == ["specs", "results"]
    assert s["command"] == ["runmap", "validate", "specs", "results", "--summary", str(out_path)]
    # the summary itself is an artifact the next validation claims and checks
    rc, out = run_cli(capsys, "results/conformance")
    assert rc == 0 and "1 files checked" in out
    assert not list(out_path.parent.glob(".*tmp"))  # atomic write leaves no temporary behind


def test_tampered_summary_fails(tree, capsys):
    out_path = tree / "results/conformance/summary.json"
    run_cli(capsys, "specs", "--summary", out_path)
    s = json.loads(out_path.read_text())
    s["totals"]["files_checked"] = -1
    out_path.write_text(json.dumps(s))
    rc, out = run_cli(capsys, "results")
    assert rc == 1 and "results/conformance/summary.json: $.totals.files_checked:" in out


def test_explicit_schema_for_a_file(tree, capsys):
    p = tree / "cfg.json"
    p.write_text(json.dumps({"models": ["tiny-olmoe"], "seed": -1}))
    rc, out = run_cli(capsys, "--schema", "pipeline-config", p)
    assert rc == 1 and "cfg.json: $.seed:" in out
    assert validate_file(p, "pipeline-config.schema.json")[0].json_path == "$.seed"
    rc, out = run_cli(capsys, "--schema", "no-such", p)
    assert rc == 2 and "no schema" in out


def test_repository_specs_and_committed_results_conform():
    """Every committed spec and every committed result (GPU evidence) conforms. Only git-tracked files:
    locally generated pipeline data is not evidence (and may be mid-rewrite by a running pipeline)."""
    try:
        tracked = subprocess.run(["git", "ls-files", "-z", "specs", "results"], cwd=REPO_ROOT, check=True,
                                 capture_output=True, text=True).stdout.split("\0")
        roots = [REPO_ROOT / t for t in tracked if t]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (e.g. an sdist): all of specs/
        roots = [REPO_ROOT / "specs"]
    assert any(r.name == "architecture.yaml" for r in roots)
    report = validate_tree(*roots)
    assert report.ok, "\n".join(str(v) for v in report.violations)
    assert len(report.checked) >= 10


def test_list_schemas_and_help(capsys):
    rc, out = run_cli(capsys, "--list-schemas")
    assert rc == 0 and "common.schema.json" in out and "specs/models/*.yaml" in out
    with pytest.raises(SystemExit) as e:
        main(["validate", "--help"])
    assert e.value.code == 0
    assert "x-artifact-glob" in capsys.readouterr().out


def test_artifacts_written_anywhere_are_claimed_by_their_marker(tmp_path, capsys):
    """`runmap bench --out DIR`, `generate --telemetry FILE`, `contract --out FILE` write wherever they are told: a
    campaign folder under any name, a record, a telemetry file named freely are validated (by their top-level marker,
    x-artifact-marker, or campaign.json's name), a marked file that breaks its schema fails, and a JSON file with no
    marker stays unchecked."""
    src = REPO_ROOT / "results/campaigns/h100-llama-matched-qwen"
    camp = tmp_path / "my-bench-output" / "run1"
    (camp / "records").mkdir(parents=True)
    shutil.copy(src / "campaign.json", camp / "campaign.json")
    record = sorted((src / "records").glob("*.json"))[0]
    shutil.copy(record, camp / "records" / record.name)
    shutil.copy(REPO_ROOT / "results/contract/h200.json", tmp_path / "my-bench-output" / "contract-run.json")
    (tmp_path / "my-bench-output" / "other.json").write_text(json.dumps({"hello": 1}))
    rc, out = run_cli(capsys, tmp_path / "my-bench-output", "-v")
    assert rc == 0 and "3 files checked, 0 failed" in out, out
    for schema in ("bench-campaign", "bench-record", "contract-report"):
        assert f"[{schema}.schema.json]" in out, (schema, out)
    assert f"unchecked {tmp_path / 'my-bench-output' / 'other.json'}" in out
    broken = json.loads(record.read_text())
    del broken["timing"]
    (camp / "records" / "broken.json").write_text(json.dumps(broken))
    rc, out = run_cli(capsys, camp)
    assert rc == 1 and "FAIL" in out and "broken.json" in out and "'timing' is a required property" in out, out
