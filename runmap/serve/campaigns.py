"""The page's campaign view: a campaign's report tables and plots, rendered by ``runmap report``'s own code.

A campaign is a directory under one of the roots (``--campaigns``, default ``results/campaigns``) that
holds ``records/*.json``. Its report is ``runmap.bench.report.render`` of those records, written into
the server's own temporary directory (never into the campaign folder, which may be committed evidence),
and the Markdown is turned into HTML with markdown-it-py (tables on, raw HTML off) with the plot links
pointing at this server. A report is rendered again only when a record file changes.
"""
from __future__ import annotations

import re
import tempfile
import threading
from pathlib import Path

from runmap.serve.protocol import ApiError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class Campaigns:
    def __init__(self, roots):
        self.roots = [Path(r) for r in roots]
        self._tmp = tempfile.TemporaryDirectory(prefix="runmap-serve-reports-")
        self._lock = threading.Lock()  # matplotlib is not thread-safe; one render at a time
        self._cache: dict[str, tuple[tuple, dict]] = {}

    def close(self) -> None:
        self._tmp.cleanup()

    def _found(self) -> dict[str, Path]:
        out = {}
        for root in self.roots:
            if not root.is_dir():
                continue
            for d in sorted(root.iterdir()):
                if d.is_dir() and NAME_RE.match(d.name) and (d / "records").is_dir() and d.name not in out:
                    out[d.name] = d
        return out

    def list(self) -> list[dict]:
        return [{"name": n, "path": str(d), "records": len(list((d / "records").glob("*.json"))),
                 "has_campaign_json": (d / "campaign.json").is_file()} for n, d in self._found().items()]

    def report(self, name: str) -> dict:
        """{"name", "path", "records", "html"}; ApiError 404 for an unknown campaign, 422 for unreadable records."""
        from markdown_it import MarkdownIt

        from runmap.bench.campaign import BenchError, load_records
        from runmap.bench.report import render

        d = self._found().get(name)
        if d is None:
            raise ApiError(404, f"no campaign {name!r} under {', '.join(map(str, self.roots))}", code="not_found")
        files = sorted((d / "records").glob("*.json"))
        key = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] == key:
                return hit[1]
            try:
                records = load_records(d)
            except BenchError as e:
                raise ApiError(422, str(e), code="bad_records") from None
            if not records:
                raise ApiError(422, f"{d}: no bench records", code="bad_records")
            out = Path(self._tmp.name) / name
            md = render(records, out / "report.md", out / "report-plots", sources=[str(d)])
        html = MarkdownIt("commonmark", {"html": False}).enable("table").render(md)
        html = html.replace('src="report-plots/', f'src="/api/campaigns/{name}/plots/')
        doc = {"name": name, "path": str(d), "records": len(records), "html": html}
        with self._lock:
            self._cache[name] = (key, doc)
        return doc

    def plot(self, name: str, file: str) -> Path:
        if not NAME_RE.match(name) or not re.match(r"^[A-Za-z0-9._-]+\.png$", file):
            raise ApiError(404, "no such plot", code="not_found")
        p = Path(self._tmp.name) / name / "report-plots" / file
        if not p.is_file():
            raise ApiError(404, f"no plot {file!r} for campaign {name!r} (open its report first)", code="not_found")
        return p
