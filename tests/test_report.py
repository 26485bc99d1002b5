"""The report is rendered from records alone: tables per model, PNG plots, no causal claim from a
flagged pair."""
from __future__ import annotations

import copy
import json

import pytest

from runmap.bench import report
from runmap.cli.main import main
from test_bench_fakes import as_gpu, run_fake

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cpu_records(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    _, recs = run_fake(root)
    return root, recs


def test_report_from_records_cli(cpu_records, tmp_path):
    root, recs = cpu_records
    out = tmp_path / "report.md"
    assert main(["report", "--records", str(root), "--out", str(out)]) == 0
    text = out.read_text()
    assert "### m (preset `tiny-olmoe`" in text
    # one table row per record, the CPU peak written as UNSUPPORTED
    body = text.split("### m", 1)[1]
    rows = [l for l in body.splitlines() if l.startswith("| engine") or l.startswith("| hf-bf16")]
    assert len(rows) == len(recs)
    assert "UNSUPPORTED" in rows[0]
    png = tmp_path / "report-plots" / "t-m-decode.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    # no memory plot on the CPU (nothing OBSERVED), and the report says so
    assert not (tmp_path / "report-plots" / "t-m-memory.png").exists()
    assert "no OBSERVED value" in text
    # residency comparisons with the executor fixed: 4 -> 6 -> 8 for both batches
    assert text.count("(grouped) |") == 4


def test_report_no_records_is_an_error(tmp_path):
    assert main(["report", "--records", str(tmp_path), "--out", str(tmp_path / "r.md")]) == 1


def test_memory_plot_and_no_comparison_from_flagged_pair(cpu_records, tmp_path):
    _, recs = cpu_records
    recs = [as_gpu(r, 2.0 + i * 0.1) for i, r in enumerate(recs)]
    # make the full-residency records run another executor: 6 -> 8 changes both
    for r in recs:
        if r["kind"] == "engine" and r["regime"] == "full":
            r["executor"] = "topk-fused"
            r["id"] = r["id"].replace("grouped", "topk-fused")
    out = tmp_path / "r.md"
    text = report.render(copy.deepcopy(recs), out)
    assert (tmp_path / "r-plots" / "t-m-memory.png").read_bytes()[:8] == PNG_MAGIC
    conf = text.split("no causal comparison drawn:*", 1)[1].split("##", 1)[0]
    assert "m__engine__grouped__r6__b1__p4__d3 -> m__engine__topk-fused__r8__b1__p4__d3" in conf
    # the comparison tables hold only one-factor changes: 4 -> 6 (grouped), never 6 -> 8
    table_rows = [l for l in text.splitlines() if l.startswith("| ") and " -> " in l]
    assert table_rows and not any("6 -> 8" in l for l in table_rows)
    assert text.count("4 -> 6 (grouped)") == 2
    flagged_rows = [l for l in text.splitlines() if l.endswith("| confounded |")]
    assert len(flagged_rows) == 4  # r6 and r8 at batch 1 and 2
    assert "flags" in text and "0 errors" in text


def test_headline_table(cpu_records):
    _, recs = cpu_records
    lines = report.headline_table(recs, batch=1)
    assert lines[0].startswith("| model |") and len(lines) == 2 + sum(r["config"]["batch"] == 1 for r in recs)
    both = report.headline_table(recs)  # one row per configuration, a column per batch size
    assert len(both) == len(lines) and "decode tok/s b2" in both[0]


def test_fmt_never_prints_zero_for_unmeasured():
    assert report.fmt_measure({"status": "UNSUPPORTED", "reason": "cpu"}) == "UNSUPPORTED"
    assert report.fmt_measure({"status": "OBSERVED", "value": 2 * 1024**3}, report.GIB) == "2.00"
    assert report.fmt_ratio({"status": "UNKNOWN", "reason": "x"}) == "UNKNOWN"
    json.dumps(report.headline_table([]))


def _partial_rows(text: str) -> list[list[str]]:
    body = text.split(report.PARTIAL_HEAD, 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in l.strip("|").split("|")] for l in body.strip().splitlines()[1:]]


def test_partial_table_puts_engine_hit_rate_beside_replay(cpu_records, tmp_path):
    _, recs = cpu_records
    recs = copy.deepcopy(recs)
    part = [r for r in recs if r["regime"] == "partial"]
    assert len(part) == 4  # r4 and r6 at batch 1 and 2
    r4b1 = next(r for r in part if r["config"]["resident"] == 4 and r["config"]["batch"] == 1)
    r4b1["cache_stats"]["hit_rate"] = {"status": "OBSERVED", "value": 0.5}  # prefill included: not the column's
    r4b1["cache_stats"]["decode_hit_rate"] = {"status": "OBSERVED", "value": 0.8125}
    r4b1["routing"]["replay_lru_hit_rate"] = {"status": "OBSERVED", "value": 0.8}
    r4b1["routing"]["replay_belady_hit_rate"] = {"status": "OBSERVED", "value": 0.9375}
    r4b1["routing"]["misses_per_token"] = {"status": "OBSERVED", "value": 33.88}
    r4b1["timing"]["transfer_bound_tok_s"] = {"status": "OBSERVED", "value": 297.46}
    r4b1["ratios"]["decode_vs_transfer_bound"] = {"status": "OBSERVED", "value": 0.0723}
    # a record written before routing existed: no routing block, no bound, no ratio
    r6b2 = next(r for r in part if r["config"]["resident"] == 6 and r["config"]["batch"] == 2)
    del r6b2["routing"], r6b2["timing"]["transfer_bound_tok_s"], r6b2["ratios"]["decode_vs_transfer_bound"]
    text = report.render(recs, tmp_path / "r.md")
    rows = _partial_rows(text)
    assert len(rows) == 4 and all(r[2] in ("4/8", "6/8") for r in rows)  # only partial records, no full ones
    by = {(r[2], r[3]): r for r in rows}
    assert by[("4/8", "1")][4:] == ["66.0", "0.812", "0.800", "0.938", "33.9", "297.5", "0.072", "decode steps"]
    # present but not measured: the status word, never a number; misses per token are the decode steps' over the
    # tokens those steps made (each row's first token is the prefill's)
    r6b1 = next(r for r in part if r["config"]["resident"] == 6 and r["config"]["batch"] == 1)
    per_tok = r6b1["cache_stats"]["decode_misses"]["value"] / (
        (r6b1["timing"]["new_tokens"] - 1) * r6b1["config"]["repeats"])
    assert r6b1["routing"]["misses_per_token"]["value"] == pytest.approx(per_tok)
    assert by[("6/8", "1")][5:11] == ["0.750", "UNSUPPORTED", "UNSUPPORTED", f"{per_tok:.1f}", "UNKNOWN", "UNKNOWN"]
    # absent: blank cells (the engine's own hit rate is still there; a record without the decode split shows its
    # rate over prefill and decode)
    del r6b2["cache_stats"]["decode_hit_rate"]
    rows = _partial_rows(report.render(recs, tmp_path / "r2.md"))
    by = {(r[2], r[3]): r for r in rows}
    assert by[("6/8", "2")][5:] == ["0.750", "", "", "", "", "", "decode steps"]
    assert by[("6/8", "2")][1] == "model"  # the workload still read from config.routing


def test_partial_rows_say_what_their_per_token_figures_count_from_the_record_version(cpu_records, tmp_path):
    """bench-record-v2 (what the bench writes now): misses and bytes per token are the decode steps'; v1: the prompt's
    misses and bytes too, over every decoded token. Read from record_version, whatever fields the record carries:
    a v1 record with the decode split's fields is still v1, a v2 record without them still v2."""
    root, recs = cpu_records
    assert {r["record_version"] for r in recs} == {"bench-record-v2"}  # the record writer marks the new meaning
    recs = copy.deepcopy(recs)
    part = {(r["config"]["resident"], r["config"]["batch"]): r for r in recs if r["regime"] == "partial"}
    assert "decode_hit_rate" in part[4, 1]["cache_stats"]
    part[4, 1]["record_version"] = part[6, 1]["record_version"] = "bench-record-v1"
    del part[6, 1]["cache_stats"]["decode_hit_rate"], part[6, 2]["cache_stats"]["decode_hit_rate"]
    text = report.render(recs, tmp_path / "r.md")
    assert report.PARTIAL_HEAD.rstrip(" |").endswith("per-token figures count")
    by = {(r[2], r[3]): r[-1] for r in _partial_rows(text)}
    assert by == {("4/8", "1"): "prompt + decode (v1)", ("6/8", "1"): "prompt + decode (v1)",
                  ("4/8", "2"): "decode steps", ("6/8", "2"): "decode steps"}
    assert "`decode steps` (bench-record-v2" in text and "`prompt + decode (v1)` (bench-record-v1" in text

    # runmap report reads both versions from disk (and leaves out a version it does not know)
    d = tmp_path / "mixed" / "records"
    d.mkdir(parents=True)
    for r in recs:
        (d / f"{r['id']}.json").write_text(json.dumps({k: v for k, v in r.items() if k != "_path"}))
    unknown = dict(part[4, 2], id="m__unknown", record_version="bench-record-v99")
    (d / "m__unknown.json").write_text(json.dumps({k: v for k, v in unknown.items() if k != "_path"}))
    out = tmp_path / "mixed.md"
    assert main(["report", "--records", str(tmp_path / "mixed"), "--out", str(out)]) == 0
    assert {(r[2], r[3]): r[-1] for r in _partial_rows(out.read_text())} == by
    assert f"from {len(recs)} records" in out.read_text()


def test_no_partial_table_without_partial_records(cpu_records, tmp_path):
    _, recs = cpu_records
    full = [r for r in copy.deepcopy(recs) if r["regime"] == "full"]
    text = report.render(full, tmp_path / "r.md")
    assert report.PARTIAL_HEAD not in text and report.partial_table(full) == []
