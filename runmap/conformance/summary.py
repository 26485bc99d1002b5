"""The conformance summary: what ``runmap validate --summary`` writes (schema: conformance.schema.json).

It states, for one set of validated paths:

* per file: which schemas claimed it, pass/fail, and each violation (JSON path, schema path, line);
* per schema: how many files it checked and how many failed;
* the contract observations found in any validated JSON document: every object under a key named
  ``observations`` holding the required-zero observations of specs/architecture.yaml. An OBSERVED
  value other than 0 is a contract violation; UNKNOWN / UNSUPPORTED are counted, never turned into 0;
* ``conformant``: no schema violation and no contract violation.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable

import yaml

from runmap.resources import ARCHITECTURE_SPEC
from runmap.provenance import utc_timestamp

SUMMARY_KIND = "runmap-conformance-summary"
FORMAT_VERSION = 1


def required_zero_observations(spec_path: Path = ARCHITECTURE_SPEC) -> list[str]:
    """Names of the observations the cache contract requires to be observed as zero."""
    spec = yaml.safe_load(Path(spec_path).read_text())
    return [o["id"] for o in spec["observations"]["required_zero"]]


def _walk(node: Any, path: str) -> Iterable[tuple[str, dict]]:
    """Yield (json_path, dict) for every dict stored under a key named "observations"."""
    if isinstance(node, dict):
        for k, v in node.items():
            sub = f"{path}.{k}"
            if k == "observations" and isinstance(v, dict):
                yield sub, v
            yield from _walk(v, sub)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def tally_observations(documents: Iterable[tuple[str, int | None, Any]], names: list[str]) -> dict:
    """Count statuses of the required-zero observations over (file, line, document) triples."""
    by_name = {n: {"observed_zero": 0, "observed_nonzero": 0, "unknown": 0, "unsupported": 0} for n in names}
    violations, records = [], 0
    for file, line, doc in documents:
        for jpath, obs in _walk(doc, "$"):
            present = [n for n in names if isinstance(obs.get(n), dict)]
            if not present:
                continue
            records += 1
            for n in present:
                o = obs[n]
                status = o.get("status")
                if status == "OBSERVED":
                    value = o.get("value")
                    if value == 0:
                        by_name[n]["observed_zero"] += 1
                    else:
                        by_name[n]["observed_nonzero"] += 1
                        v = {"file": file, "json_path": f"{jpath}.{n}", "name": n, "value": value}
                        if line is not None:
                            v["line"] = line
                        violations.append(v)
                elif status == "UNKNOWN":
                    by_name[n]["unknown"] += 1
                elif status == "UNSUPPORTED":
                    by_name[n]["unsupported"] += 1
                # any other status is a schema violation, reported by the schema that claims the file
    return {"records": records, "by_name": by_name, "violations": violations}


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_summary(report, schema_set, command: list[str]) -> dict:
    """The summary dict for a ``runmap.conformance.schemas.TreeReport`` made with ``keep_documents=True``."""
    from runmap import __version__

    per_schema = {
        name: {"sha256": _sha256(s.path), "artifact_globs": list(s.globs), "files_checked": 0, "files_failed": 0}
        for name, s in sorted(schema_set.schemas.items())
    }
    for f in report.checked:
        for name in f.schemas:
            per_schema[name]["files_checked"] += 1
            if not f.ok:
                per_schema[name]["files_failed"] += 1
    obs = tally_observations(report.documents, required_zero_observations())
    return {
        "kind": SUMMARY_KIND,
        "format_version": FORMAT_VERSION,
        "created_utc": utc_timestamp(),
        "runmap_version": __version__,
        "command": command,
        "roots": report.roots,
        "architecture": {"path": "specs/architecture.yaml", "sha256": _sha256(ARCHITECTURE_SPEC),
                         "cache_contract": "resident-qpacked-cache-v1"},
        "schemas": per_schema,
        "totals": {
            "files_checked": len(report.checked),
            "files_passed": len(report.checked) - len(report.failed),
            "files_failed": len(report.failed),
            "violations": len(report.violations),
            "unchecked": len(report.unchecked),
            "warnings": len(report.warnings),
            "observation_violations": len(obs["violations"]),
        },
        "files": [
            {"path": f.path, "schemas": f.schemas, "status": "pass" if f.ok else "fail",
             "violations": [v.to_dict() for v in f.violations]}
            for f in report.checked
        ],
        "unchecked": report.unchecked,
        "warnings": report.warnings,
        "observations": obs,
        "conformant": report.ok and not obs["violations"],
    }
