"""``runmap validate``: check every artifact and spec below some paths against its JSON Schema, and every
pack's bytes against the digests its manifest records."""
from __future__ import annotations

import argparse
import os
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

Packs: for every pack manifest found (format runmap-qpack), every file of the pack is hashed and compared
with the size and sha256 the manifest records, every expert row with its recorded sha256; a mismatch, a
missing file, a file the manifest does not record, or a manifest file name outside the pack directory
fails, naming the file. A directory holding pack data files but no manifest.json (the manifest is written
last, so this is a pack whose writer was killed), including a hidden .NAME.tmp-* directory left by a
killed `runmap pack`, fails as half-written. Finding no file to check at all fails: zero is not success.

exit status: 0 at least one file checked, every checked file and pack conforms, no contract violation;
1 otherwise (also a PATH that does not exist); 2 bad usage.

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


NOTHING_CHECKED = ("no artifact or spec found that a schema claims: zero files checked is not success "
                   "(wrong directory, or an empty or unfinished output?)")
MANIFEST_SCHEMA = "manifest.schema.json"


def _strip_prefix(message: str, path: str) -> str:
    return message[len(path) + 2:] if message.startswith(path + ": ") else message


# a pack's own JSON files and their schemas: the schemas' globs claim them below a folder named packs/ only, so a pack
# validated where it lies (runmap validate /data/olmoe-pack) has them checked here
PACK_FILE_SCHEMAS = {"config.json": "hf-checkpoint", **{n: "hf-aux" for n in (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "chat_template.json")}}


def _check_packs(report, schema_set=None) -> None:
    """Recompute every digest of every pack whose manifest was validated; each problem becomes a violation of
    that manifest's file result, naming the file at fault. With ``schema_set``, the pack's config and tokenizer
    files no glob claimed are validated against their schemas too."""
    from runmap.conformance.schemas import FileResult, Violation, display_path
    from runmap.format.packfile import FORMAT_NAME, MANIFEST, check_pack

    results = {f.path: f for f in report.checked}
    for label, _line, doc in report.documents:
        fmt = doc.get("format") if isinstance(doc, dict) else None
        if Path(label).name != MANIFEST or not isinstance(fmt, dict) or fmt.get("name") != FORMAT_NAME:
            continue
        res = results.get(label)
        if res is None:
            continue
        pack = Path(label).parent
        corrupt = set()
        for file, message in check_pack(pack):
            corrupt.add(Path(file).name)
            res.violations.append(Violation(display_path(Path(file)), MANIFEST_SCHEMA, "$.files", "",
                                            "pack integrity: " + _strip_prefix(message, file)))
        # (a file whose digest is wrong has its one violation above: its bytes are not the pack's)
        for name, schema in PACK_FILE_SCHEMAS.items() if schema_set is not None else ():
            f = pack / name
            lab = display_path(f)
            if f.is_file() and lab not in results and name not in corrupt:
                used, violations, _docs = schema_set.validate_file(f, [schema], label=lab)
                results[lab] = FileResult(lab, used, violations)
                report.checked.append(results[lab])
                report.unchecked[:] = [u for u in report.unchecked if u != lab]
        # the files the manifest records are checked by their digests: no longer "unchecked"
        files = doc.get("files") if isinstance(doc.get("files"), list) else []
        covered = {display_path(pack / e["file"]) for e in files
                   if isinstance(e, dict) and isinstance(e.get("file"), str) and "/" not in e["file"]}
        report.unchecked[:] = [u for u in report.unchecked if u not in covered]


def _candidate_dirs(paths: list[Path]):
    """Directories that may hold a pack: every walked directory (validate's walk skips dot-directories), the
    roots themselves, and the hidden ``.NAME.tmp-*`` directories an interrupted atomic writer leaves."""
    from runmap.conformance.schemas import SKIP_DIRS

    for root in paths:
        if not root.is_dir():
            continue
        yield root
        for dirpath, dirnames, _ in os.walk(root):
            for d in sorted(dirnames):
                if d.startswith(".") and ".tmp-" in d:
                    yield Path(dirpath) / d
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
            for d in dirnames:
                yield Path(dirpath) / d


def _half_written_packs(report, paths: list[Path]) -> None:
    from runmap.conformance.schemas import FileResult, Violation, display_path
    from runmap.format.packfile import MANIFEST, looks_half_written

    seen = set()
    for d in _candidate_dirs(paths):
        key = os.path.abspath(d)
        if key in seen or not looks_half_written(d):
            continue
        seen.add(key)
        label = display_path(d / MANIFEST)
        msg = (f"missing: {display_path(d)} holds pack data files but no {MANIFEST}, which `runmap pack` writes "
               "last: a half-written pack (its writer was killed or failed); rerun runmap pack and remove this "
               "directory")
        report.checked.append(FileResult(label, [MANIFEST_SCHEMA], [Violation(label, MANIFEST_SCHEMA, "$", "", msg)]))


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
        print(f"runmap validate: {e}", file=sys.stderr)
        return 2
    if args.list_schemas:
        return _list_schemas(ss)
    paths = [Path(p) for p in (args.paths or ["."])]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"runmap validate: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 1

    if args.schema:
        try:
            ss.get(args.schema)
        except KeyError as e:
            print(f"runmap validate: {e.args[0]}", file=sys.stderr)
            return 2
        if any(p.is_dir() for p in paths):
            print("runmap validate: --schema takes files, not directories", file=sys.stderr)
            return 2
        report = TreeReport(roots=[display_path(p) for p in paths])
        for p in paths:
            used, violations, docs = ss.validate_file(p, [args.schema], label=display_path(p))
            report.checked.append(FileResult(display_path(p), used, violations))
            report.documents.extend((display_path(p), line, d) for line, d in docs)
    else:
        report = validate_tree(*paths, schema_set=ss, keep_documents=True)
        _half_written_packs(report, paths)
    _check_packs(report, None if args.schema else ss)  # --schema: only the files and schema named

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
    nothing = not report.checked
    if nothing:
        summary["warnings"].append(NOTHING_CHECKED)
        summary["conformant"] = False
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
    if nothing:
        print(f"runmap validate: {', '.join(map(str, args.paths or ['.']))}: {NOTHING_CHECKED}", file=sys.stderr)

    if args.summary:
        # The summary must itself conform: a bug here should fail loudly, not write a bad artifact.
        bad = ss.validate_document(summary, "conformance", file=args.summary)
        if bad:
            for v in bad:
                print(f"runmap validate: internal: summary does not match its schema: {v}", file=sys.stderr)
            return 1
        write_json(args.summary, summary)

    t = summary["totals"]
    verdict = "CONFORMANT" if summary["conformant"] else "NOT CONFORMANT"
    # the campaign checks' errors make a run non-conformant with every file valid: the line says so, and where
    failing = campaign_checks.errors(campaign_findings)
    campaigns = sorted({f.file.split("/records/")[0] for f in failing if f.file and "/records/" in f.file})
    checks = (f", {len(failing)} campaign check errors" + (f" ({', '.join(campaigns)})" if campaigns else "")
              if failing else "")
    print(f"{verdict}: {t['files_checked']} files checked, {t['files_failed']} failed "
          f"({t['violations']} violations), {t['observation_violations']} contract violations{checks}, "
          f"{t['unchecked']} unchecked, {t['warnings']} warnings"
          + (f"; summary: {args.summary}" if args.summary else ""))
    return 0 if summary["conformant"] else 1
