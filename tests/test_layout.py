"""The repository's layout holds: the product, the benchmarks and the lab stay apart (docs/layout.md).

* no Python file of the package, the kernels, the benchmarks or the tools edits ``sys.path`` (they import
  ``runmap``, installed or from the repository root on ``PYTHONPATH``);
* no ``scripts/`` folder comes back with probes or benchmarks in it (records come from ``benchmarks/``,
  probes and studies live in ``tools/explore/``), and each of those two folders says in its README what every
  file in it is;
* every repository path a Markdown file names in an inline code span or links to exists, apart from
  placeholders, globs and the pipeline's own outputs that ``.gitignore`` ignores;
* every ``docs/<page>.md#<section>`` reference, in any text file, and every Markdown link to a section of a
  page, names a heading that page has.
"""
from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("runmap", "kernels", "benchmarks", "tools")
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", ".snakemake", "node_modules",
             "build", "dist", ".whl", ".gl", "work"}
# Top-level names a Markdown path may start with even while the folder is absent (a path under one of them
# is still checked, and fails if it does not exist).
KNOWN_TOP = {"runmap", "kernels", "benchmarks", "tools", "docs", "results", "specs", "schemas", "tests",
             "workflow", "scripts", "data"}
PLACEHOLDER = re.compile(r"[*?<>{}\[\]$~]|\.\.\.")
PATH_TOKEN = re.compile(r"^[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]*)+$")


# --- sys.path -------------------------------------------------------------------------------------------------

def _sys_path_edits(source: str) -> list[int]:
    """Line numbers where ``source`` changes ``sys.path``: a call of one of its mutating methods, an
    assignment to it or to an item or slice of it, ``from sys import path``, or ``site.addsitedir``."""
    tree = ast.parse(source)

    def is_sys_path(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if is_sys_path(f.value) and f.attr in {"insert", "append", "extend", "remove", "pop", "clear",
                                                   "__setitem__", "__iadd__"}:
                lines.append(node.lineno)
            if f.attr == "addsitedir" and isinstance(f.value, ast.Name) and f.value.id == "site":
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)):
                    lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            if any(a.name == "path" for a in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def _python_files(top: str) -> list[Path]:
    base = ROOT / top
    return sorted(p for p in base.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts))


def test_sys_path_detector_sees_the_usual_forms():
    src = ("import sys, site\nsys.path.insert(0, 'x')\nsys.path.append('y')\nsys.path[:0] = ['z']\n"
           "sys.path = ['w']\nsys.path += ['v']\nfrom sys import path\nsite.addsitedir('u')\n"
           "print(sys.path)\nmodule.__path__.append('ok')\n")
    assert _sys_path_edits(src) == [2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("top", CODE_DIRS)
def test_no_sys_path_edits(top):
    if not (ROOT / top).is_dir():
        pytest.skip(f"no {top}/ in this tree")
    bad = []
    for p in _python_files(top):
        for line in _sys_path_edits(p.read_text(encoding="utf-8")):
            bad.append(f"{p.relative_to(ROOT)}:{line}")
    assert not bad, ("sys.path edited (import runmap instead: installed, or PYTHONPATH=. from the repository "
                     "root; shared helpers belong in a runmap module): " + ", ".join(bad))


# --- scripts/, benchmarks/, tools/explore/ ----------------------------------------------------------------------

def test_no_scripts_folder_with_probes_or_benchmarks():
    scripts = ROOT / "scripts"
    if not scripts.is_dir():
        return
    stray = sorted(p.name for p in scripts.iterdir() if p.name != "__pycache__")
    assert not stray, (f"scripts/ holds {stray}: a run that writes a committed record goes to benchmarks/, a "
                       "probe or study to tools/explore/ (each listed in that folder's README.md)")


@pytest.mark.parametrize("folder", ["benchmarks", "tools/explore"])
def test_every_file_is_described_in_its_readme(folder):
    d = ROOT / folder
    readme = d / "README.md"
    assert readme.is_file(), f"{folder}/ has no README.md"
    text = readme.read_text(encoding="utf-8")
    missing = sorted(p.name for p in d.iterdir()
                     if p.is_file() and p.name != "README.md" and f"`{p.name}`" not in text)
    assert not missing, f"{folder}/README.md does not describe {missing}"


# --- paths named in Markdown ------------------------------------------------------------------------------------

def _gitignore_patterns() -> list[str]:
    f = ROOT / ".gitignore"
    if not f.is_file():
        return []
    out = []
    for line in f.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and not line.startswith("!"):
            out.append(line)
    return out


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Whether the repository-relative posix path ``rel`` (or a folder above it) matches a .gitignore pattern
    (the subset of the syntax this repository uses: globs, a leading / or an inner / anchors, a trailing /
    means a folder)."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        dir_only = pat.endswith("/")
        body = pat.strip("/")
        anchored = pat.startswith("/") or "/" in body
        for i, pre in enumerate(prefixes):
            is_last = i == len(prefixes) - 1
            if dir_only and is_last and not (rel.endswith("/") or (ROOT / pre).is_dir()):
                continue
            if anchored:
                if fnmatch.fnmatchcase(pre, body):
                    return True
            elif fnmatch.fnmatchcase(pre.rsplit("/", 1)[-1], body):
                return True
    return False


def _markdown_files() -> list[Path]:
    patterns = _gitignore_patterns()
    files = []
    for p in ROOT.rglob("*.md"):
        rel = p.relative_to(ROOT)
        if SKIP_DIRS.intersection(rel.parts) or any(part.endswith(".egg-info") for part in rel.parts):
            continue
        if _ignored(rel.as_posix(), patterns):  # generated (results/report.md, ...)
            continue
        files.append(p)
    return sorted(files)


_FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def named_paths(text: str) -> list[tuple[str, str]]:
    """(kind, path) for every candidate repository path in Markdown ``text``: kind "code" for a token of an
    inline code span that looks like a relative path (a slash, no placeholder or glob), kind "link" for a
    relative link target (anchor dropped). Fenced code blocks are left out: they hold commands with
    arguments, not references."""
    text = _FENCE.sub("", text)
    out = []
    for m in _LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("/"):
            continue
        if not PLACEHOLDER.search(target):
            out.append(("link", target))
    for m in _CODE_SPAN.finditer(text):
        for tok in m.group(2).split():
            tok = tok.split("=", 1)[-1].strip("'\"(),;")
            tok = re.sub(r":\d+(-\d+)?$", "", tok)  # file.py:123
            if tok.startswith("./"):
                tok = tok[2:]
            if PLACEHOLDER.search(tok) or not PATH_TOKEN.match(tok) or tok.startswith(("/", "../")):
                continue
            out.append(("code", tok))
    return out


def _resolve(md: Path, kind: str, path: str) -> list[Path]:
    """Where a named path may exist (it must exist at one of them); empty where it is not a repository path.
    Links resolve against the Markdown file's folder, as a renderer does. A code-span path resolves against
    the Markdown file's folder when its first name is there (a README's own `logs/x.log`), and against the
    root when its first name is a top-level name of the repository; anything else (`lm_eval/tasks`,
    `gate/up`) is not a repository path."""
    if kind == "link":
        return [(md.parent / path).resolve()]
    first = path.split("/", 1)[0]
    out = []
    if (md.parent / first).exists():
        out.append(md.parent / path)
    if first in KNOWN_TOP or (ROOT / first).exists():
        out.append(ROOT / path)
    return out


def test_named_paths_extractor():
    text = ("See `runmap/bench/metrics.py` and [the contract](docs/cache-contract.md#rules), run\n"
            "`PYTHONPATH=. python3 benchmarks/bench_kernels.py --out $OUT/x.json --configs=tools/explore/a.json`;\n"
            "not `results/packs/<model>-b256/`, `results/*/README.md`, `gate/up`-ish `runmap.kernels`, "
            "[web](https://example.org/a/b) or `/tmp/x`.\n```\npython3 scripts/gone.py\n```\n"
            "`kernels/grouped.py:253` ``double `tick` docs/layout.md``\n")
    assert named_paths(text) == [
        ("link", "docs/cache-contract.md"),
        ("code", "runmap/bench/metrics.py"),
        ("code", "benchmarks/bench_kernels.py"),
        ("code", "tools/explore/a.json"),
        ("code", "gate/up"),
        ("code", "kernels/grouped.py"),
        ("code", "docs/layout.md"),
    ]


def test_gitignore_matcher():
    pats = ["results/checkpoints/", "results/ifeval/*-b[0-9]*/", "*.egg-info/", "results/report.md"]
    assert _ignored("results/checkpoints/tiny/config.json", pats)
    assert _ignored("results/report.md", pats)
    assert _ignored("results/ifeval/tiny-b128/answers.jsonl", pats)
    assert _ignored("horizon_runmap.egg-info/PKG-INFO", pats)
    assert not _ignored("results/kernels/README.md", pats)
    assert not _ignored("results/checkpoints.md", pats)


def test_markdown_names_only_existing_paths():
    patterns = _gitignore_patterns()
    missing = []
    files = _markdown_files()
    assert any(f.name == "README.md" for f in files)
    for md in files:
        for kind, path in named_paths(md.read_text(encoding="utf-8")):
            places = _resolve(md, kind, path)
            if not places or any(t.exists() for t in places):
                continue
            target = places[-1]
            try:
                rel = target.resolve().relative_to(ROOT).as_posix()
            except ValueError:  # points out of the repository
                missing.append(f"{md.relative_to(ROOT)}: {path} (outside the repository)")
                continue
            if _ignored(rel + ("/" if path.endswith("/") else ""), patterns):
                continue  # a pipeline output, regenerated by `snakemake`, never committed
            hint = ""
            if path.startswith("runmap/kernels/") and (ROOT / path[len("runmap/"):]).exists():
                hint = f" (in the repository it is {path[len('runmap/'):]}; runmap.kernels is its installed name)"
            missing.append(f"{md.relative_to(ROOT)}: {path}{hint}")
    assert not missing, "Markdown names paths that do not exist:\n  " + "\n  ".join(missing)


# --- sections of docs pages ---------------------------------------------------------------------------------------

def heading_slugs(text: str) -> set[str]:
    """The anchors a renderer gives the headings of Markdown ``text``: lower case, punctuation other than
    ``-`` and ``_`` dropped, spaces to hyphens; a repeated heading gets ``-1``, ``-2``, ...; and the explicit anchors
    ``<a id="..."></a>`` of the text."""
    slugs, seen = set(), {}
    unfenced = _FENCE.sub("", text)
    slugs.update(re.findall(r'<a id="([A-Za-z0-9_-]+)"></a>', unfenced))
    for line in unfenced.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        slugs.add(base if n == 0 else f"{base}-{n}")
    return slugs


def test_heading_slugs():
    text = ("# Top\n## 6. `miss-transaction`: Miss transaction\n## Top\n```\n# not a heading\n<a id=\"no\"></a>\n```\n"
            "<a id=\"row-1\"></a>\n")
    assert heading_slugs(text) == {"top", "6-miss-transaction-miss-transaction", "top-1", "row-1"}


TEXT_SUFFIXES = {".py", ".smk", ".md", ".yaml", ".yml", ".json", ".sh", ".toml", ".txt", ""}
_DOCS_REF = re.compile(r"(?<![\w/.-])docs/([A-Za-z0-9_.-]+\.md)#([A-Za-z0-9_-]+)")
_MD_LINK_ANCHOR = re.compile(r"\]\(\s*<?([^)\s>#]+\.md)#([A-Za-z0-9_-]+)>?\s*\)")


def _text_files() -> list[Path]:
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if (SKIP_DIRS.intersection(rel.parts) or rel.parts[0] == "data"
                or any(part.endswith(".egg-info") for part in rel.parts)):
            continue
        if p.is_file() and p.suffix in TEXT_SUFFIXES and p.stat().st_size < 2_000_000:
            out.append(p)
    return out


def test_docs_section_references_exist():
    slugs: dict[Path, set[str]] = {}

    def has(page: Path, anchor: str) -> bool:
        if page not in slugs:
            slugs[page] = heading_slugs(page.read_text(encoding="utf-8")) if page.is_file() else set()
        return anchor in slugs[page]

    bad = []
    for f in _text_files():
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rel = f.relative_to(ROOT)
        for m in _DOCS_REF.finditer(text):
            if not has(ROOT / "docs" / m.group(1), m.group(2)):
                bad.append(f"{rel}: docs/{m.group(1)}#{m.group(2)}")
        if f.suffix == ".md":
            for m in _MD_LINK_ANCHOR.finditer(text):
                if m.group(1).startswith(("http:", "https:")):
                    continue
                if not has((f.parent / m.group(1)).resolve(), m.group(2)):
                    bad.append(f"{rel}: ({m.group(1)}#{m.group(2)})")
    assert not bad, "references to sections that do not exist:\n  " + "\n  ".join(sorted(set(bad)))
