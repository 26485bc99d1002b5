"""`runmap bench SPEC --aggregate PART ...` (issue 21 item 1): one campaign from the output of per-group jobs,
from whatever parts exist, refusing records that are not the spec's or appear twice. The real per-group run
(engine, pipeline) is tests/test_pipeline_gpu.py; here the parts are written by hand."""
import json
from pathlib import Path

import pytest

from runmap.bench.aggregate import aggregate_parts
from runmap.bench.campaign import RECORD_VERSION, BenchError, expand, load_spec
from runmap.cli.main import main


SPEC_PATH = Path(__file__).resolve().parent.parent / "specs" / "campaigns" / "default.yaml"


@pytest.fixture(scope="module")
def spec():
    return load_spec(SPEC_PATH)


def _record(c, run_id, tok_s):
    return {"record_version": RECORD_VERSION, "id": c.id, "campaign": "default", "group": c.group, "kind": c.kind,
            "executor": c.executor, "regime": c.regime, "run_id": run_id, "device": {"type": "cpu", "name": "x86_64"},
            "config": {"model": c.model, "batch": c.batch, "prompt_len": c.prompt_len, "decode_len": c.decode_len},
            "timing": {"decode_tok_s": {"median": tok_s}}, "memory": {"peak_allocated_bytes": {"status": "OBSERVED",
                                                                                            "value": 1000}},
            "h2d": {}, "ratios": {}}


def _part(root: Path, group: str, configs, run_id="run-" + "a", tok_s=10.0, extra=()):
    d = root / group / "default"
    (d / "records").mkdir(parents=True)
    mine = [c for c in configs if c.group == group]
    for c in mine:
        (d / "records" / f"{c.id}.json").write_text(json.dumps(_record(c, run_id, tok_s)))
    for rec in extra:
        (d / "records" / f"{rec['id']}.json").write_text(json.dumps(rec))
    (d / "campaign.json").write_text(json.dumps({
        "campaign": "default", "run_id": run_id, "configs": len(mine), "done": [c.id for c in mine], "failed": [],
        "skipped": [], "wall_s": 2.5, "device": {"type": "cpu", "name": "x86_64"}, "software": {}, "git": {},
        "copy_bandwidth_gb_s": {"status": "UNKNOWN", "reason": "test"}}))
    return root / group


def test_parts_join_into_one_campaign_with_cross_part_ratios(spec, tmp_path):
    configs = expand(spec)
    parts = [_part(tmp_path / "parts", "baseline-fp16-experts", configs, "run-b", tok_s=20.0),
             _part(tmp_path / "parts", "residency-reference", configs, "run-r", tok_s=10.0),
             tmp_path / "parts" / "baseline-hf"]  # its job has not run: no folder at all
    summary = aggregate_parts(spec, parts, tmp_path / "out", configs, command="test")
    camp = tmp_path / "out" / "default"
    ids = {c.id for c in configs}
    done = {c.id for c in configs if c.group in ("baseline-fp16-experts", "residency-reference")}
    assert set(summary["done"]) == done and summary["failed"] == []
    assert {s["id"] for s in summary["skipped"]} == ids - done  # whatever records exist; the rest is listed
    assert all("has not run or has failed" in s["reason"] for s in summary["skipped"])
    assert [p["run_id"] for p in summary["parts"]] == ["run-b", "run-r"] and summary["wall_s"] == 5.0
    assert json.loads((camp / "campaign.json").read_text()) == summary
    rec = json.loads(next((camp / "records").glob("tiny-olmoe__engine__reference__r8__b1__*.json")).read_text())
    assert rec["run_id"] == "run-r"  # still names the job that measured it
    # paired with the fp16 baseline another job measured (same model, batch, lengths, device)
    assert rec["ratios"]["decode_vs_engine-fp16"] == {"status": "OBSERVED", "value": 0.5}


def test_a_configuration_in_two_parts_or_of_another_spec_is_refused(spec, tmp_path):
    configs = expand(spec)
    twice = [c for c in configs if c.group == "baseline-fp16-experts"][0]
    a = _part(tmp_path / "p1", "baseline-fp16-experts", configs)
    b = _part(tmp_path / "p2", "residency-reference", configs, extra=[_record(twice, "run-x", 1.0)])
    with pytest.raises(BenchError, match=f"configuration {twice.id} is also recorded in"):
        aggregate_parts(spec, [a, b], tmp_path / "out", configs, command="test")
    stranger = {**_record(twice, "run-y", 1.0), "id": "tiny-olmoe__engine__scalar__r1__b9__p1__d1"}
    c = _part(tmp_path / "p3", "baseline-hf", configs, extra=[stranger])
    with pytest.raises(BenchError, match="is not one of campaign 'default'"):
        aggregate_parts(spec, [c], tmp_path / "out", configs, command="test")
    assert not (tmp_path / "out" / "default").exists()  # nothing published


def test_cli_aggregate_reports_one_line_and_exit_status(tmp_path, capsys):
    assert main(["bench", str(SPEC_PATH), "--aggregate", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "nothing to aggregate" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", str(SPEC_PATH), "--group", "no-such-group", "--list"]) == 2
    assert "--group 'no-such-group': the spec has groups" in capsys.readouterr().err
    assert main(["bench", str(SPEC_PATH), "--group", "baseline-hf", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed and all("__hf-bf16__" in i for i in listed)
