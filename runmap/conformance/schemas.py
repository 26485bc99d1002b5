"""JSON Schema machinery: load ``schemas/*.schema.json``, find which schema claims a file, validate.

Discovery convention (every schema author follows it):

* Every schema is a draft 2020-12 document in ``schemas/`` named ``<name>.schema.json`` whose ``$id`` is
  ``https://horizon-runmap.invalid/schemas/<name>.schema.json``. Cross-file references are relative
  (``{"$ref": "common.schema.json#/$defs/executor"}``) and resolve through one ``referencing.Registry``
  holding every schema under its ``$id``; nothing is ever fetched.
* A schema that describes an artifact has a top-level ``"x-artifact-glob"``: a list of glob patterns.
  ``*`` and ``?`` stay inside one path component, ``**`` spans any number of components. A pattern is
  matched against the *trailing* components of a file's path, so ``packs/*/manifest.json`` claims
  ``results/packs/m-b256/manifest.json`` whether one validates the repository root, ``results/`` or
  the pack directory itself (write patterns from the most specific directory you know).
* ``"x-artifact-format"`` is ``"json"``, ``"jsonl"`` (every non-empty line is one document) or ``"yaml"``.
  Without it the file extension decides (.jsonl, .yaml/.yml, else JSON).
* ``"x-artifact-marker"`` (JSON artifacts a command writes wherever its ``--out`` says): an object mapping top-level
  keys to the list of values that identify the artifact, e.g. ``{"schema": ["runmap-telemetry-v1"]}``. A ``.json``
  file that no glob claims is claimed by every schema whose marker its top-level object carries (every key, with one
  of its values), so a record, a telemetry file or a trace validates at any path.
* A file claimed by several schemas must satisfy all of them. A file claimed by none is "unchecked";
  an unchecked ``*.json``/``*.jsonl`` below a ``results`` directory also produces a warning, because an
  artifact without a schema is a gap.

Import cost: ``jsonschema``/``referencing`` are imported lazily, so modules that only need the
constants here also import on the GPU machine, which has no jsonschema.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from runmap.resources import SCHEMAS_DIR

SCHEMA_DIR = SCHEMAS_DIR
ID_BASE = "https://horizon-runmap.invalid/schemas/"
GLOB_KEY = "x-artifact-glob"
FORMAT_KEY = "x-artifact-format"
MARKER_KEY = "x-artifact-marker"
MARKER_MAX_BYTES = 64 << 20  # a .json larger than this is never read for a marker (stays unchecked unless a glob claims it)
FORMATS = ("json", "jsonl", "yaml")
MAX_ERRORS_PER_DOCUMENT = 20  # enough to fix a file; a broken generator would otherwise print thousands
# Directories never walked: tool state and caches, and dot-directories (temporary outputs being
# written atomically by a running job are named with a leading dot by convention).
SKIP_DIRS = {"__pycache__", "node_modules"}


class SchemaError(ValueError):
    """A schema file itself is invalid (bad JSON, not draft 2020-12, wrong $id, bad glob)."""


@dataclasses.dataclass(frozen=True)
class Violation:
    """One reason a file does not conform.

    json_path is "$" for the document root, "$.a[3].b" inside it; schema_path is the JSON pointer-ish
    path of the failing keyword inside the schema ("properties/a/items/required"); line is the JSONL
    line (1-based) or the line of a parse error, else None.
    """

    file: str
    schema: str | None
    json_path: str
    schema_path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.file}" + (f":{self.line}" if self.line is not None else "")
        sch = f" [schema {self.schema}" + (f" at {self.schema_path}" if self.schema_path else "") + "]" if self.schema else ""
        return f"{where}: {self.json_path}: {self.message}{sch}"

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Schema:
    name: str  # file name, e.g. "manifest.schema.json"
    path: Path
    contents: dict
    globs: tuple[str, ...]
    fmt: str | None  # x-artifact-format, or None = by extension
    marker: tuple[tuple[str, tuple], ...] = ()  # x-artifact-marker as ((key, allowed values), ...)

    def marks(self, doc: Any) -> bool:
        """True when ``doc`` (a parsed JSON document) carries this schema's marker."""
        return bool(self.marker) and isinstance(doc, dict) and all(
            k in doc and any(doc[k] == v and type(doc[k]) is type(v) for v in allowed) for k, allowed in self.marker)

    @property
    def id(self) -> str:
        return self.contents["$id"]

    @property
    def is_artifact_schema(self) -> bool:
        return bool(self.globs)

    @functools.cached_property
    def _regexes(self) -> tuple[re.Pattern, ...]:
        return tuple(glob_to_regex(g) for g in self.globs)

    def claims(self, path: Path) -> bool:
        # no leading "/": an empty first component would let "*/*" claim "/x"
        posix = Path(os.path.abspath(path)).as_posix().lstrip("/")
        return any(r.search(posix) for r in self._regexes)


def glob_to_regex(pattern: str) -> re.Pattern:
    """Compile a glob (``*``, ``?``, ``[...]``, ``**``) into a regex that ``search``-matches the trailing
    components of a relative POSIX path (no leading "/")."""
    if not pattern or pattern.startswith("/") or "\\" in pattern:
        raise SchemaError(f"glob {pattern!r}: must be a non-empty relative POSIX pattern")
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append(r"(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(r".*")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append(r"[^/]")
            i += 1
        elif pattern[i] == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                raise SchemaError(f"glob {pattern!r}: unterminated '['")
            body = pattern[i + 1 : j].replace("\\", "\\\\")
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append(f"[{body}]")
            i = j + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile(r"(?:^|/)" + "".join(out) + r"$")


def load_document(path: Path, fmt: str) -> Any:
    """Parse a JSON or YAML file. Raises ValueError naming the file and the line on a parse error."""
    text = Path(path).read_text(encoding="utf-8")
    if fmt == "yaml":
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark is not None else ""
            raise ValueError(f"{path}:{line} not valid YAML: {e}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno} column {e.colno}: not valid JSON: {e.msg}") from e


def _format_for(path: Path, schemas: Iterable[Schema]) -> str:
    for s in schemas:
        if s.fmt:
            return s.fmt
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix in (".yaml", ".yml"):
        return "yaml"
    return "json"


def _json_path(parts: Iterable) -> str:
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(p)) else f"[{json.dumps(p)}]")
    return out


class SchemaSet:
    """Every schema of one directory, with a registry so cross-file ``$ref`` resolves offline."""

    def __init__(self, schema_dir: str | Path = SCHEMA_DIR):
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError as JSError
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        self.dir = Path(schema_dir)
        self.schemas: dict[str, Schema] = {}
        paths = sorted(self.dir.glob("*.schema.json"))
        if not paths:
            raise SchemaError(f"{self.dir}: no *.schema.json files")
        for p in paths:
            try:
                contents = json.loads(p.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise SchemaError(f"{p}: line {e.lineno}: not valid JSON: {e.msg}") from e
            if contents.get("$schema") != "https://json-schema.org/draft/2020-12/schema":
                raise SchemaError(f"{p}: $schema must be https://json-schema.org/draft/2020-12/schema")
            if contents.get("$id") != ID_BASE + p.name:
                raise SchemaError(f"{p}: $id must be {ID_BASE + p.name!r}, got {contents.get('$id')!r}")
            try:
                Draft202012Validator.check_schema(contents)
            except JSError as e:
                raise SchemaError(f"{p}: not a valid draft 2020-12 schema at {'/'.join(map(str, e.path))}: {e.message}") from e
            globs = contents.get(GLOB_KEY, [])
            if not isinstance(globs, list) or not all(isinstance(g, str) for g in globs):
                raise SchemaError(f"{p}: {GLOB_KEY} must be a list of glob strings")
            for g in globs:
                try:
                    glob_to_regex(g)
                except SchemaError as e:
                    raise SchemaError(f"{p}: {GLOB_KEY}: {e}") from e
            fmt = contents.get(FORMAT_KEY)
            if fmt is not None and fmt not in FORMATS:
                raise SchemaError(f"{p}: {FORMAT_KEY} must be one of {FORMATS}, got {fmt!r}")
            marker = contents.get(MARKER_KEY, {})
            if not isinstance(marker, dict) or not all(isinstance(v, list) and v for v in marker.values()):
                raise SchemaError(f"{p}: {MARKER_KEY} must map top-level keys to non-empty lists of values")
            self.schemas[p.name] = Schema(p.name, p, contents, tuple(globs), fmt,
                                          tuple((k, tuple(v)) for k, v in sorted(marker.items())))
        self.registry = Registry().with_resources(
            (s.id, Resource.from_contents(s.contents, default_specification=DRAFT202012)) for s in self.schemas.values()
        )
        self._validators: dict[str, Any] = {}

    # ---- lookup --------------------------------------------------------------------------------
    def get(self, name: str) -> Schema:
        key = name if name.endswith(".schema.json") else f"{name}.schema.json"
        if key not in self.schemas:
            raise KeyError(f"no schema {name!r} in {self.dir}; known: {sorted(self.schemas)}")
        return self.schemas[key]

    def matching(self, path: str | Path) -> list[Schema]:
        return [s for s in self.schemas.values() if s.claims(Path(path))]

    def validator(self, name: str):
        from jsonschema import Draft202012Validator

        s = self.get(name)
        if s.name not in self._validators:
            self._validators[s.name] = Draft202012Validator(
                s.contents, registry=self.registry, format_checker=Draft202012Validator.FORMAT_CHECKER
            )
        return self._validators[s.name]

    # ---- validation ----------------------------------------------------------------------------
    def validate_document(self, doc: Any, schema: str, file: str = "<document>", line: int | None = None) -> list[Violation]:
        """Validate one parsed document. Returns the violations (empty when it conforms)."""
        s = self.get(schema)
        errors = sorted(self.validator(s.name).iter_errors(doc), key=lambda e: (list(map(str, e.absolute_path)), e.message))
        out = []
        for e in errors[:MAX_ERRORS_PER_DOCUMENT]:
            msg = e.message if len(e.message) <= 300 else e.message[:297] + "..."
            out.append(Violation(file, s.name, _json_path(e.absolute_path), "/".join(map(str, e.absolute_schema_path)), msg, line))
        if len(errors) > MAX_ERRORS_PER_DOCUMENT:
            out.append(Violation(file, s.name, "$", "", f"... and {len(errors) - MAX_ERRORS_PER_DOCUMENT} more errors", line))
        return out

    def _marked(self, path: Path) -> tuple[list[Schema], Any]:
        """(the schemas whose marker a .json file's top level carries, that parsed document); ([], None) when there are
        none (not .json, too large, unreadable, not JSON, no marker on it: the file stays unchecked, as before
        markers)."""
        if path.suffix.lower() != ".json" or not any(s.marker for s in self.schemas.values()):
            return [], None
        try:  # what a command writes is small; a large data file (a checkpoint's index is ~100 KB) is not read whole
            if path.stat().st_size > MARKER_MAX_BYTES:
                return [], None
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return [], None
        marking = [s for s in self.schemas.values() if s.marks(doc)]
        return marking, doc if marking else None

    def validate_file(self, path: str | Path, schemas: list[str] | None = None, label: str | None = None):
        """Validate a file against the named schemas, or against every schema that claims it.

        Returns (schema names used, violations, parsed documents). Documents are (line or None, doc).
        """
        path = Path(path)
        label = label or str(path)
        used = [self.get(n) for n in schemas] if schemas else self.matching(path)
        docs: list[tuple[int | None, Any]] = []
        if not used:
            used, doc = self._marked(path)
            if not used:
                return [], [], []
            docs.append((None, doc))  # read already, for its marker
        fmt = _format_for(path, used)
        violations: list[Violation] = []
        try:
            if not docs and fmt == "jsonl":
                for i, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                    if not raw.strip():
                        continue
                    try:
                        docs.append((i, json.loads(raw)))
                    except json.JSONDecodeError as e:
                        violations.append(Violation(label, None, "$", "", f"not valid JSON: {e.msg} (column {e.colno})", i))
            elif not docs:
                docs.append((None, load_document(path, fmt)))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            msg = str(e).replace(str(path), "").lstrip(": ") or type(e).__name__
            return [s.name for s in used], [Violation(label, None, "$", "", f"cannot read: {msg}")], []
        if fmt == "jsonl" and not docs and not violations:
            violations.append(Violation(label, None, "$", "", "empty JSONL file (no records)"))
        for s in used:
            for line, doc in docs:
                violations.extend(self.validate_document(doc, s.name, file=label, line=line))
        return [s.name for s in used], violations, docs


@dataclasses.dataclass
class FileResult:
    path: str  # as reported: relative to the current directory when below it
    schemas: list[str]
    violations: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclasses.dataclass
class TreeReport:
    roots: list[str]
    checked: list[FileResult] = dataclasses.field(default_factory=list)
    unchecked: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    documents: list[tuple[str, int | None, Any]] = dataclasses.field(default_factory=list)  # (path, line, doc)

    @property
    def failed(self) -> list[FileResult]:
        return [f for f in self.checked if not f.ok]

    @property
    def violations(self) -> list[Violation]:
        return [v for f in self.checked for v in f.violations]

    @property
    def ok(self) -> bool:
        return not self.failed


def display_path(p: Path) -> str:
    """Path relative to the current directory when it lies below it (stable across machines), else absolute."""
    a = Path(os.path.abspath(p))
    try:
        return a.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return a.as_posix()


def iter_files(root: Path) -> Iterable[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        for f in sorted(filenames):
            if not f.startswith("."):
                yield Path(dirpath) / f


def _under_results(p: Path) -> bool:
    return "results" in Path(os.path.abspath(p)).parts


def validate_tree(*roots: str | Path, schema_set: SchemaSet | None = None, keep_documents: bool = False) -> TreeReport:
    """Validate every file below each root (a directory or a single file) against the schemas claiming it."""
    ss = schema_set or load_schemas()
    report = TreeReport(roots=[display_path(Path(r)) for r in roots])
    seen: set[str] = set()
    for root in roots:
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"{root}: no such file or directory")
        for f in iter_files(root):
            key = os.path.abspath(f)
            if key in seen:
                continue
            seen.add(key)
            label = display_path(f)
            used, violations, docs = ss.validate_file(f, label=label)
            if not used:
                report.unchecked.append(label)
                if f.suffix.lower() in (".json", ".jsonl") and _under_results(f):
                    report.warnings.append(f"{label}: JSON artifact under results/ that no schema claims (add an x-artifact-glob)")
                continue
            report.checked.append(FileResult(label, used, violations))
            if keep_documents:
                report.documents.extend((label, line, d) for line, d in docs)
    return report


@functools.lru_cache(maxsize=4)
def _cached(schema_dir: str) -> SchemaSet:
    return SchemaSet(schema_dir)


def load_schemas(schema_dir: str | Path | None = None) -> SchemaSet:
    """The schemas of ``schema_dir`` (default: the repository's ``schemas/``), cached per directory."""
    return _cached(str(Path(schema_dir or SCHEMA_DIR).resolve()))


def validate_file(path: str | Path, schema: str | None = None) -> list[Violation]:
    """Violations of one file against ``schema`` (name, with or without ``.schema.json``) or every
    schema claiming it. A file no schema claims returns []: check ``load_schemas().matching(path)``."""
    return load_schemas().validate_file(path, [schema] if schema else None)[1]


def validate_document(doc: Any, schema: str, file: str = "<document>") -> list[Violation]:
    """Violations of an in-memory document (e.g. a manifest before it is written)."""
    return load_schemas().validate_document(doc, schema, file=file)
