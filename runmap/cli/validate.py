"""``runmap validate``: check every artifact and spec below some paths against its JSON Schema."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from runmap.atomic import write_json

HELP = "validate artifacts and specs against schemas/ (and write a conformance summary)"
DESCRIPTION = """\
Validate every file below each PATH (directories are walked; dot-directories are skipped) against the
JSON Schemas in schemas/ that claim it, and report the contract observations found in them.

Which schema checks which file: each schemas/<name>.schema.json lists glob patterns in its top-level
"x-artifact-glob"; a pattern matches the trailing components of a file's path (`packs/*/manifest.json`
claims results/packs/m-b256/manifest.json). Files no schema claims are listed as unchecked; an unchecked
*.json / *.jsonl below a results/ directory is also a warning. YAML specs (specs/architecture.yaml,
specs/models/*.yaml, specs/pipeline/*.yaml) are checked when PATH contains them.

Each violation is printed as
  FILE[:LINE]: JSON_PATH: MESSAGE [schema NAME at SCHEMA_PATH]
An OBSERVED non-zero value of a required-zero cache-contract observation (expert_d2h_bytes, writebacks,
host_source_rewrites, request_hash_work, request_pack_reads) is a contract violation.

exit status: 0 every checked file conforms and no contract violation; 1 otherwise; 2 bad usage.

examples:
  runmap validate results specs
  runmap validate results/packs/tiny-olmoe-b256 --summary results/conformance/summary.json
  runmap validate --schema manifest some/dir/manifest.json
  runmap validate --list-schemas
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", metavar="PATH", help="directories or files to validate (default: .)")
    p.add_argument("--summary", metavar="FILE", help="write the conformance summary JSON here (atomically); "
                   "it is written even when validation fails")
    p.add_argument("--schema", metavar="NAME", help="validate the given FILES against this schema (e.g. "
                   "'manifest' or 'manifest.schema.json') instead of discovering schemas by glob")
    p.add_argument("--schemas-dir", metavar="DIR", help="schema directory (default: the repository's schemas/)")
    p.add_argument("--list-schemas", action="store_true", help="print each schema with its artifact globs and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="print only violations, warnings and the final line")
    p.add_argument("-v", "--verbose", action="store_true", help="also list every file that passed")


def _list_schemas(ss) -> int:
    for name, s in sorted(ss.schemas.items()):
        globs = ", ".join(s.globs) if s.globs else "(definitions only)"
        print(f"{name:40s} {globs}")
    return 0


def run(args: argparse.Namespace) -> int:
    from runmap.conformance import summary as conformance
    from runmap.conformance.schemas import FileResult, SchemaError, TreeReport, display_path, load_schemas, validate_tree

    try:
        ss = load_schemas(args.schemas_dir)
    except SchemaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list_schemas:
        return _list_schemas(ss)
    paths = [Path(p) for p in (args.paths or ["."])]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"error: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2

    if args.schema:
        try:
            ss.get(args.schema)
        except KeyError as e:
            print(f"error: {e.args[0]}", file=sys.stderr)
            return 2
        if any(p.is_dir() for p in paths):
            print("error: --schema takes files, not directories", file=sys.stderr)
            return 2
        report = TreeReport(roots=[display_path(p) for p in paths])
        for p in paths:
            used, violations, docs = ss.validate_file(p, [args.schema], label=display_path(p))
            report.checked.append(FileResult(display_path(p), used, violations))
            report.documents.extend((display_path(p), line, d) for line, d in docs)
    else:
        report = validate_tree(*paths, schema_set=ss, keep_documents=True)

    command = ["runmap", "validate", *map(str, args.paths)]
    for flag, value in (("--schema", args.schema), ("--schemas-dir", args.schemas_dir), ("--summary", args.summary)):
        if value:
            command += [flag, str(value)]
    summary = conformance.build_summary(report, ss, command=command)
    # Campaign checks (runmap/bench/checks.py) over the bench records validated here: an error makes
    # the run non-conformant; a flag (a record changing residency and executor against its neighbour) is
    # a warning. Both are listed in the summary's warnings.
    from runmap.bench import checks as campaign_checks

    campaign_findings = campaign_checks.check_documents(report.documents)
    summary["warnings"] = summary["warnings"] + [f"campaign check: {f}" for f in campaign_findings]
    summary["totals"]["warnings"] = len(summary["warnings"])
    if campaign_checks.errors(campaign_findings):
        summary["conformant"] = False
    for f in report.checked:
        if f.ok:
            if args.verbose:
                print(f"ok        {f.path}  [{', '.join(f.schemas)}]")
            continue
        for v in f.violations:
            print(f"FAIL      {v}")
    for v in summary["observations"]["violations"]:
        where = v["file"] + (f":{v['line']}" if "line" in v else "")
        print(f"CONTRACT  {where}: {v['json_path']}: {v['name']} observed as {v['value']!r}, the contract requires 0")
    for f in campaign_findings:
        print(f"CAMPAIGN  {f}")
    if not args.quiet:
        for u in report.unchecked:
            print(f"unchecked {u}")
    for w in report.warnings:
        print(f"warning   {w}")

    if args.summary:
        # The summary must itself conform: a bug here should fail loudly, not write a bad artifact.
        bad = ss.validate_document(summary, "conformance", file=args.summary)
        if bad:
            for v in bad:
                print(f"error: internal: summary does not match its schema: {v}", file=sys.stderr)
            return 1
        write_json(args.summary, summary)

    t = summary["totals"]
    verdict = "CONFORMANT" if summary["conformant"] else "NOT CONFORMANT"
    print(f"{verdict}: {t['files_checked']} files checked, {t['files_failed']} failed "
          f"({t['violations']} violations), {t['observation_violations']} contract violations, "
          f"{t['unchecked']} unchecked, {t['warnings']} warnings"
          + (f"; summary: {args.summary}" if args.summary else ""))
    return 0 if summary["conformant"] else 1
