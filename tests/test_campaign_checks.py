"""Conformance checks over bench records: each check passes a good record and fails a bad one."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from runmap.bench import checks as cc
from test_bench_fakes import as_gpu, run_fake


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    _, recs = run_fake(tmp_path_factory.mktemp("camp"))
    for r in recs:
        r.pop("_path")
    return recs


def _one(records, rid):
    return copy.deepcopy(next(r for r in records if r["id"] == rid))


PARTIAL = "m__engine__grouped__r4__b1__p4__d3"
FULL = "m__engine__grouped__r8__b1__p4__d3"


def test_good_records_have_no_errors(records):
    assert cc.errors(cc.check_records(records)) == []


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.pop("executor"), "executor None"),
    (lambda r: r.update(executor=""), "executor ''"),
    (lambda r: r.update(regime="mixed"), "regime 'mixed'"),
    (lambda r: r.update(regime="full"), "resident 4 of 8 experts per layer is 'partial'"),
])
def test_executor_and_regime_named(records, mutate, match):
    r = _one(records, PARTIAL)
    mutate(r)
    errs = cc.errors(cc.check_records([r]))
    assert any(e.check == "executor-regime" and match in e.message for e in errs), errs


@pytest.mark.parametrize("obs, match", [
    (0, "bare value 0"),
    ({"status": "UNKNOWN", "value": 0, "reason": "not instrumented"}, "carries a value"),
    ({"status": "UNSUPPORTED", "value": 0, "reason": "platform"}, "carries a value"),
    ({"status": "UNKNOWN"}, "without a reason"),
    ({"status": "OBSERVED", "value": 4096}, "the contract requires 0"),
    ({"status": "OBSERVED"}, "without a numeric value"),
    ({"status": "ZERO", "value": 0}, "status 'ZERO'"),
    (None, "missing"),
])
def test_required_zero_observations(records, obs, match):
    r = _one(records, PARTIAL)
    if obs is None:
        del r["observations"]["writebacks"]
    else:
        r["observations"]["writebacks"] = obs
    errs = cc.errors(cc.check_records([r]))
    assert [e.check for e in errs] == ["required-zero"] and match in errs[0].message, errs


@pytest.mark.parametrize("status", ["UNKNOWN", "UNSUPPORTED"])
def test_explicitly_unmeasured_observation_is_accepted(records, status):
    r = _one(records, PARTIAL)
    r["observations"]["request_pack_reads"] = {"status": status, "reason": "no pack reader to instrument"}
    assert cc.errors(cc.check_records([r])) == []


@pytest.mark.parametrize("mem, match", [
    (0, "not a measure"),
    ({"status": "OBSERVED", "value": 0}, "a measured peak is > 0"),
    ({"status": "OBSERVED", "value": 123}, "OBSERVED on a CPU run"),
    ({"status": "UNSUPPORTED", "value": 0, "reason": "cpu"}, "carries a value"),
])
def test_memory_is_never_a_bare_zero(records, mem, match):
    r = _one(records, PARTIAL)
    r["memory"]["peak_allocated_bytes"] = mem
    errs = cc.errors(cc.check_records([r]))
    assert any(e.check == "memory-status" and match in e.message for e in errs), errs


def test_gpu_record_with_observed_peak_passes(records):
    assert cc.errors(cc.check_records([as_gpu(_one(records, PARTIAL), 3.0)])) == []


def test_full_residency_has_no_misses(records):
    r = _one(records, FULL)
    assert cc.errors(cc.check_records([r])) == []
    r["cache_stats"]["misses"] = {"status": "OBSERVED", "value": 3}
    errs = cc.errors(cc.check_records([r]))
    assert [e.check for e in errs] == ["full-no-misses"] and "3 misses" in errs[0].message
    r = _one(records, FULL)
    r["cache_stats"]["misses"] = {"status": "UNKNOWN", "reason": "not reported"}
    assert [e.check for e in cc.errors(cc.check_records([r]))] == ["full-no-misses"]
    r = _one(records, FULL)
    r["h2d"]["bytes"] = {"status": "OBSERVED", "value": 1000}
    assert [e.check for e in cc.errors(cc.check_records([r]))] == ["full-no-misses"]
    # a partial record may miss
    assert cc.errors(cc.check_records([_one(records, PARTIAL)])) == []


def _series(records, spec):
    """Records of one series with (resident, executor) pairs as given."""
    base = _one(records, PARTIAL)
    out = []
    for res, ex in spec:
        r = copy.deepcopy(base)
        r["config"]["resident"] = res
        r["config"]["experts_per_layer"] = 64
        r["regime"] = "full" if res == 64 else "partial"
        r["executor"] = ex
        r["id"] = f"r{res}-{ex}"
        out.append(r)
    return out


def test_changing_residency_and_executor_is_flagged(records):
    # the reference design's OLMoE c60 (scalar) -> c64 (grouped) transition
    recs = _series(records, [(50, "scalar"), (60, "scalar"), (64, "grouped")])
    flags = [f for f in cc.check_records(recs) if f.severity == cc.FLAG]
    assert [(f.other, f.record) for f in flags] == [("r60-scalar", "r64-grouped")]
    comparable, confounded = cc.residency_pairs(recs)
    assert [(a["id"], b["id"]) for a, b in comparable] == [("r50-scalar", "r60-scalar")]
    assert [(a["id"], b["id"]) for a, b in confounded] == [("r60-scalar", "r64-grouped")]


def test_same_executor_neighbour_clears_the_flag(records):
    recs = _series(records, [(60, "scalar"), (64, "grouped"), (64, "scalar"), (60, "grouped")])
    assert [f for f in cc.check_records(recs) if f.severity == cc.FLAG] == []
    assert len(cc.executor_pairs(recs)) == 2  # grouped vs scalar at 60 and at 64


def test_other_batch_is_another_series(records):
    recs = _series(records, [(60, "scalar"), (64, "scalar")])
    other = _series(records, [(64, "grouped")])
    other[0]["config"]["batch"] = 8
    assert [f for f in cc.check_records(recs + other) if f.severity == cc.FLAG] == []


def test_runmap_validate_runs_the_checks(tmp_path, records, capsys):
    from runmap.cli.main import main

    d = tmp_path / "campaigns" / "t" / "records"
    d.mkdir(parents=True)
    good = _one(records, PARTIAL)
    (d / f"{good['id']}.json").write_text(json.dumps(good))
    assert main(["validate", str(tmp_path), "-q"]) == 0
    bad = _one(records, FULL)
    bad["cache_stats"]["misses"] = {"status": "OBSERVED", "value": 2}
    (d / f"{bad['id']}.json").write_text(json.dumps(bad))
    assert main(["validate", str(tmp_path), "-q"]) == 1
    out = capsys.readouterr().out
    assert "CAMPAIGN" in out and "full-no-misses" in out and "NOT CONFORMANT" in out
    # every file valid, yet not conformant: the verdict's line says why and where
    verdict = out.strip().splitlines()[-1]
    assert "0 failed" in verdict and f"1 campaign check errors ({tmp_path / 'campaigns' / 't'})" in verdict, verdict


def test_every_record_version_is_checked_and_validates(records):
    """bench-record-v1 records (the committed evidence written before the per-token figures became the decode
    steps') are still records to the checks and the schema; the writer writes v2; an unknown version is neither."""
    from runmap.conformance.schemas import validate_document

    assert cc.RECORD_VERSIONS == ("bench-record-v1", "bench-record-v2") and cc.RECORD_VERSION == "bench-record-v2"
    assert {r["record_version"] for r in records} == {cc.RECORD_VERSION}
    schema = json.loads((Path(__file__).resolve().parent.parent / "schemas/bench-record.schema.json").read_text())
    assert schema["properties"]["record_version"]["enum"] == list(cc.RECORD_VERSIONS)
    bad = _one(records, FULL)
    bad["cache_stats"]["misses"] = {"status": "OBSERVED", "value": 2}
    for version, decode_only in (("bench-record-v1", False), ("bench-record-v2", True)):
        r = dict(_one(records, PARTIAL), record_version=version)
        assert validate_document(r, "bench-record.schema.json") == []
        assert cc.is_record(r) and cc.per_token_figures_are_decode_only(r) is decode_only
        found = cc.check_documents([("f.json", None, dict(bad, record_version=version))])
        assert [f.check for f in cc.errors(found)] == ["full-no-misses"]
    r = dict(_one(records, PARTIAL), record_version="bench-record-v3")
    assert validate_document(r, "bench-record.schema.json") != [] and not cc.is_record(r)
    assert cc.check_documents([("f.json", None, dict(bad, record_version="bench-record-v3"))]) == []
