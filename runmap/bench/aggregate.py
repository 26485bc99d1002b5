"""One campaign from the records of separate jobs (``runmap bench SPEC --aggregate PART ...``).

The pipeline's GPU mode (workflow/rules/50-bench.smk) runs each group of a campaign as its own job
(``runmap bench SPEC --group G --out PART``), on whichever GPU that job was given. This module joins what
those jobs wrote into the campaign directory a single run would have written: ``records/<id>.json`` and
``campaign.json`` (schemas/bench-campaign.schema.json, plus ``parts``: one entry per job).

* Records are taken as the jobs wrote them, except their ratios: a baseline may have been measured by
  another job, so the ratios to baselines and the transfer bounds are recomputed over all records, pairing
  records measured on the same kind of device (type and name) instead of in the same run; each record
  keeps its job's run_id, device and timing.
* Whatever records exist are used: a configuration no part holds is listed as skipped (its job has not
  run, or failed), a part's failures and skips are carried over. A record of another campaign, of a
  configuration the spec does not have, or of one configuration in two parts is refused (BenchError).
* Output is written to a hidden directory and published with the same atomic swap as a run.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
import uuid
from pathlib import Path

from runmap.atomic import remove_stale_temporaries, write_json
from runmap.bench.campaign import (RECORD_VERSION, BenchConfig, BenchError, OutputExistsError, _publish,
                                   attach_ratios, existing_campaign, recover_interrupted_publish)


def device_key(r: dict) -> str:
    d = r.get("device") or {}
    return f"device {d.get('type')} {d.get('name')}"


def _attach_ratios_by_device(records: list[dict]) -> None:
    """campaign.attach_ratios pairs a record with the baselines of its own run (key: run_id). Records of
    separate jobs are paired by device instead: each record's run_id stands in for the device key while the
    ratios are computed, and is put back afterwards (the record still names the job that measured it)."""
    run_ids = [r["run_id"] for r in records]
    try:
        for r in records:
            r["run_id"] = device_key(r)
        attach_ratios(records)
    finally:
        for r, rid in zip(records, run_ids):
            r["run_id"] = rid


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise BenchError(f"{path}: expected a JSON object")
    return doc


def _part_campaign_dir(part: Path, name: str) -> Path:
    """A part is the --out of its job (holding NAME/) or the campaign directory itself."""
    return part / name if (part / name / "campaign.json").is_file() else part


def aggregate_parts(spec: dict, parts: list[Path], out_root: Path, configs: list[BenchConfig], *, command: str,
                    overwrite: bool = False) -> dict:
    name = spec["name"]
    camp_dir = Path(out_root) / name
    recover_interrupted_publish(camp_dir)
    existing = existing_campaign(camp_dir)
    if existing and not overwrite:
        raise OutputExistsError(f"{camp_dir} already holds a campaign ({', '.join(existing)}); nothing written "
                                "(pass --overwrite to replace it, or choose another --out)")
    want = {c.id: c for c in configs}
    records: dict[str, dict] = {}
    origin: dict[str, Path] = {}
    failed, skipped, part_rows = [], [], []
    first: dict | None = None
    for part in map(Path, parts):
        d = _part_campaign_dir(part, name)
        summ_path = d / "campaign.json"
        if not summ_path.is_file():
            continue  # its job has not run (or failed and Snakemake removed its output): its configs are skipped
        summ = _read_json(summ_path)
        if summ.get("campaign") != name:
            raise BenchError(f"{summ_path}: campaign {summ.get('campaign')!r}, not {name!r}")
        for f in sorted((d / "records").glob("*.json")):
            rec = _read_json(f)
            if rec.get("record_version") != RECORD_VERSION or rec.get("campaign") != name:
                raise BenchError(f"{f}: not a record of campaign {name!r} (record_version {RECORD_VERSION})")
            rid = rec.get("id")
            if rid not in want:
                raise BenchError(f"{f}: configuration {rid!r} is not one of campaign {name!r}'s")
            if rid in records:
                raise BenchError(f"{f}: configuration {rid} is also recorded in {origin[rid]}")
            records[rid], origin[rid] = rec, f
        failed += [x for x in summ.get("failed", []) if x.get("id") not in records]
        skipped += [x for x in summ.get("skipped", [])]
        part_rows.append({"dir": str(part), "run_id": summ.get("run_id"), "configs": summ.get("configs"),
                          "done": len(summ.get("done", [])), "failed": len(summ.get("failed", [])),
                          "wall_s": summ.get("wall_s"), "device": summ.get("device")})
        first = first or summ  # device, software and git of the campaign come from the first part read
    accounted = set(records) | {x["id"] for x in failed} | {x["id"] for x in skipped}
    skipped += [{"id": cid, "reason": "no record: the job of its group has not run or has failed"}
                for cid in want if cid not in accounted]
    ordered = [records[cid] for cid in want if cid in records]
    _attach_ratios_by_device(ordered)
    if not part_rows:
        raise BenchError(f"none of the {len(parts)} part directories holds a campaign.json of {name!r}; "
                         "nothing to aggregate")
    summary = {
        "campaign": name, "description": spec["description"],
        "run_id": _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-agg-" + uuid.uuid4().hex[:6],
        "command": command, "device": first["device"], "software": first["software"], "git": first["git"],
        "copy_bandwidth_gb_s": first["copy_bandwidth_gb_s"], "budget_note": spec.get("budget_note"),
        # device seconds: the parts may have run at the same time on several GPUs
        "wall_s": sum(p["wall_s"] or 0.0 for p in part_rows), "configs": len(want),
        "done": [r["id"] for r in ordered], "failed": failed, "skipped": skipped, "parts": part_rows,
    }
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(camp_dir, marker=".partial-")
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-{os.getpid()}-", dir=out_root))
    (tmp / "records").mkdir()
    for r in ordered:
        write_json(tmp / "records" / f"{r['id']}.json", r, indent=1)
    write_json(tmp / "campaign.json", summary, indent=1)
    _publish(tmp, camp_dir)
    return summary
