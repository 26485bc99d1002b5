"""The campaign report, rendered from the bench records alone (no engine, no GPU).

``render(records, out_md, plots_dir)`` writes a Markdown report: per campaign and model a table of
every configuration, PNG plots (matplotlib, Agg) of decode tok/s and peak memory against resident experts
per layer with the baselines drawn on the same axes, the comparisons that vary one factor at a time
(residency with the executor fixed; executor with the residency fixed), the pairs that change both (flagged,
no comparison drawn), for partial residency the engine's hit rate beside the replayed LRU / Belady hit rates
and the transfer bound (with what the record's per-token figures count, read from its record_version), the
conformance findings of runmap.bench.checks, and for records with a ``profile`` (run parameter
``profile: true``) where the time of one prefill and one decode step goes: a horizontal stacked bar per
configuration of its top kernels' shares and a table of totals and launches.

The headline ratio is ``decode_vs_strongest_baseline``: the engine over the faster transformers path (eager
or static cache + torch.compile) measured in the same run, named in its column.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from runmap.bench import checks as cc
from runmap.atomic import atomic_path, write_text

GIB = 1024**3
KIND_ORDER = {"hf-bf16": 0, "hf-bf16-compile": 1, "engine-fp16": 2, "engine": 3}
KIND_LABEL = {"hf-bf16": "transformers bf16", "hf-bf16-compile": "transformers bf16, static cache + torch.compile",
              "engine-fp16": "engine, FP16 experts", "engine": "engine, INT4 experts"}
HF_KINDS = ("hf-bf16", "hf-bf16-compile")


def _val(m):
    return m.get("value") if isinstance(m, dict) and m.get("status") == "OBSERVED" else None


def _status(m) -> str:
    return m.get("status", "?") if isinstance(m, dict) else "?"


def fmt_measure(m, scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    """An OBSERVED value formatted; otherwise the status word (never a zero for an unmeasured value)."""
    v = _val(m)
    if v is None:
        return _status(m)
    return f"{v / scale:.{digits}f}{suffix}"


def fmt_ratio(m) -> str:
    v = _val(m)
    return f"{v:.2f}x" if v is not None else _status(m)


def fmt_strongest(m) -> str:
    """The ratio to the strongest transformers baseline with the baseline's name; blank for records
    written before the field existed (and for baselines, which have none)."""
    if m is None:
        return ""
    v = _val(m)
    return f"{v:.2f}x ({m.get('baseline')})" if v is not None else _status(m)


def path_label(r: dict) -> str:
    """The executor, with the engine variant (nographs, torchops, skipexperts, ...) when not the default."""
    v = (r.get("config") or {}).get("variant", "default")
    return r["executor"] if v == "default" else f"{r['executor']} [{v}]"


def _lengths(r: dict) -> tuple:
    return r["config"]["prompt_len"], r["config"]["decode_len"]


def _sort_key(r: dict):
    c = r["config"]
    return (KIND_ORDER.get(r["kind"], 9), c["batch"], c["prompt_len"], c["decode_len"], c["resident"], r["executor"],
            c.get("variant", "default"))


def _obs_summary(r: dict) -> str:
    obs = r.get("observations") or {}
    zero = sum(1 for n in cc.REQUIRED_ZERO if _status(obs.get(n)) == "OBSERVED" and _val(obs.get(n)) == 0)
    other = {}
    for n in cc.REQUIRED_ZERO:
        o = obs.get(n)
        if not (_status(o) == "OBSERVED" and _val(o) == 0):
            other[_status(o)] = other.get(_status(o), 0) + 1
    parts = [f"{zero} zero"] + [f"{k.lower()} {v}" for k, v in sorted(other.items())]
    return ", ".join(parts)


def model_table(recs: list[dict], flagged: set[str]) -> list[str]:
    head = ("| kind | executor | regime | resident | batch | prompt/decode | decode tok/s median [min-max] | "
            "prefill tok/s | TTFT ms | peak alloc GiB | peak reserved GiB | hit rate | H2D MB/token | H2D GB/s | "
            "vs hf-bf16 | vs hf-bf16-compile | vs strongest transformers | prefill vs strongest transformers | "
            "vs fp16 experts | of byte floor | required-zero obs | flag |")
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for r in sorted(recs, key=_sort_key):
        c, t = r["config"], r["timing"]
        d = t["decode_tok_s"]
        rat = r.get("ratios", {})
        lines.append("| " + " | ".join([
            r["kind"], path_label(r), r["regime"], f"{c['resident']}/{c['experts_per_layer']}", str(c["batch"]),
            f"{c['prompt_len']}/{c['decode_len']}",
            f"{d['median']:.1f} [{d['min']:.1f}-{d['max']:.1f}]",
            f"{t['prefill_tok_s']['median']:.1f}",
            f"{t['ttft_s']['median'] * 1e3:.1f}",
            fmt_measure(r["memory"]["peak_allocated_bytes"], GIB),
            fmt_measure(r["memory"]["peak_reserved_bytes"], GIB),
            fmt_measure(r["cache_stats"]["hit_rate"], 0.01, 1, "%"),
            fmt_measure(r["h2d"].get("bytes_per_token", {}), 1e6, 2),
            fmt_measure(r["h2d"]["gb_s"], 1.0, 1),
            "-" if r["kind"] == "hf-bf16" else fmt_ratio(rat.get("decode_vs_hf-bf16")),
            "-" if r["kind"] == "hf-bf16-compile" else _cell(rat.get("decode_vs_hf-bf16-compile"), digits=2,
                                                             suffix="x"),
            "-" if r["kind"] in ("hf-bf16", "hf-bf16-compile", "engine-fp16") else
            fmt_strongest(rat.get("decode_vs_strongest_baseline")),
            # blank for records written before prefill ratios existed
            "-" if r["kind"] in ("hf-bf16", "hf-bf16-compile", "engine-fp16") else
            ("" if rat.get("prefill_vs_strongest_baseline") is None else
             fmt_strongest(rat["prefill_vs_strongest_baseline"])),
            "-" if r["kind"] == "engine-fp16" else fmt_ratio(rat.get("decode_vs_engine-fp16")),
            fmt_ratio(rat.get("decode_vs_byte_floor")),
            _obs_summary(r),
            "confounded" if r["id"] in flagged else "",
        ]) + " |")
    return lines


def _cell(m, scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    """Like fmt_measure, but blank where the record has no such field at all (records written before the
    field existed, or by a path that never carries it): an empty cell says "not recorded", a status word
    says "recorded as not measured"."""
    return "" if m is None else fmt_measure(m, scale, digits, suffix)


PARTIAL_HEAD = ("| executor | routing | resident | batch | decode tok/s | engine hit rate | replay LRU | replay Belady | "
                "misses/token | transfer bound tok/s | of transfer bound | per-token figures count |")
# what a record's misses / bytes per token (and so its transfer bound) count, by its record_version
PER_TOKEN_DECODE, PER_TOKEN_MIXED = "decode steps", "prompt + decode (v1)"


def per_token_scope(r: dict) -> str:
    """The partial table's last cell: decode steps alone (bench-record-v2 on), or the prompt's misses and bytes too,
    over every decoded token (bench-record-v1). From the version marker, not from the fields present."""
    return PER_TOKEN_DECODE if cc.per_token_figures_are_decode_only(r) else PER_TOKEN_MIXED


def partial_table(recs: list[dict]) -> list[str]:
    """The partial-residency records of one model: the engine's measured hit rate beside the LRU and Belady
    hit rates replayed over the routes that actually ran, so the distance to the optimum of the cache policy
    reads off one row, and decode tok/s beside the transfer bound of its misses. Empty when no record is
    partial."""
    part = [r for r in sorted(recs, key=_sort_key) if r.get("regime") == "partial"]
    if not part:
        return []
    lines = [PARTIAL_HEAD, "|" + "|".join("---" for _ in range(PARTIAL_HEAD.count("|") - 1)) + "|"]
    for r in part:
        c, t = r["config"], r["timing"]
        rt = r.get("routing") or {}
        lines.append("| " + " | ".join([
            path_label(r), str(c.get("routing") or rt.get("workload") or ""),
            f"{c['resident']}/{c['experts_per_layer']}", str(c["batch"]),
            f"{t['decode_tok_s']['median']:.1f}",
            # decode steps' own hit rate where the record has it (the replays are of decode steps); older
            # records have only the rate over prefill and decode together
            _cell((r.get("cache_stats") or {}).get("decode_hit_rate", (r.get("cache_stats") or {}).get("hit_rate")),
                  1.0, 3),
            _cell(rt.get("replay_lru_hit_rate"), 1.0, 3),
            _cell(rt.get("replay_belady_hit_rate"), 1.0, 3),
            _cell(rt.get("misses_per_token"), 1.0, 1),
            _cell(t.get("transfer_bound_tok_s"), 1.0, 1),
            _cell((r.get("ratios") or {}).get("decode_vs_transfer_bound"), 1.0, 3),
            per_token_scope(r),
        ]) + " |")
    return lines


def _pair_rows(pairs, what: str) -> list[str]:
    rows = []
    for a, b in pairs:
        da, db = a["timing"]["decode_tok_s"]["median"], b["timing"]["decode_tok_s"]["median"]
        ma, mb = _val(a["memory"]["peak_allocated_bytes"]), _val(b["memory"]["peak_allocated_bytes"])
        mem = f"{(mb - ma) / GIB:+.2f}" if ma is not None and mb is not None else "UNSUPPORTED"
        if what == "residency":
            change = f"{a['config']['resident']} -> {b['config']['resident']} ({a['executor']})"
        else:
            change = f"{a['executor']} -> {b['executor']} (resident {a['config']['resident']})"
        rows.append(f"| {a['config']['batch']} | {change} | {da:.1f} -> {db:.1f} | {db / da:.2f}x | {mem} |")
    return rows


def _coverage(recs: list[dict]) -> list[str]:
    """What the run summaries (campaign.json beside the records/ directories) say was not run."""
    out = []
    for d in sorted({str(Path(r["_path"]).parent.parent) for r in recs if r.get("_path")}):
        f = Path(d) / "campaign.json"
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        out += [f"- run {s.get('run_id')}: {len(s.get('done', []))} of {s.get('configs')} configurations ran, "
                f"{len(s.get('failed', []))} failed, {len(s.get('skipped', []))} not run ({f.name}):"]
        by_reason: dict[str, list[str]] = {}
        for x in s.get("skipped", []):
            by_reason.setdefault(x["reason"], []).append(f"`{x['id']}`")
        out += [f"  - {why}: {', '.join(ids)}" for why, ids in by_reason.items()]
        out += [f"  - FAILED `{x['id']}`: {x['error']}" for x in s.get("failed", [])]
    return out + ([""] if out else [])


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _atomic_savefig(fig, path: Path) -> None:
    with atomic_path(path, suffix=".png") as tmp:  # savefig picks the format from the suffix
        fig.savefig(tmp, dpi=110, bbox_inches="tight")


def plot_model(recs: list[dict], metric: str, path: Path, title: str) -> bool:
    """One panel per batch size: metric against resident experts per layer, one line per executor,
    baselines as horizontal lines on the same axes. Returns False when no value was OBSERVED."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def y(r):
        if metric == "decode":
            return r["timing"]["decode_tok_s"]["median"], r["timing"]["decode_tok_s"]["min"], r["timing"]["decode_tok_s"]["max"]
        v = _val(r["memory"]["peak_allocated_bytes"])
        return (v / GIB, v / GIB, v / GIB) if v is not None else None

    batches = sorted({r["config"]["batch"] for r in recs})
    if not any(y(r) is not None for r in recs):
        return False
    fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 4.0), squeeze=False)
    e = recs[0]["config"]["experts_per_layer"]
    colors = {"reference": "tab:gray", "scalar": "tab:orange", "grouped": "tab:blue", "topk-fused": "tab:green"}
    markers = {"reference": "D", "scalar": "^", "grouped": "o", "topk-fused": "s"}  # overlapping lines stay visible
    many = len({_lengths(r) for r in recs}) > 1  # name the lengths only when they differ

    def line(r):
        return path_label(r) + (" p{}/d{}".format(*_lengths(r)) if many else "")

    for ax, b in zip(axes[0], batches):
        engine = [r for r in recs if r["kind"] == "engine" and r["config"]["batch"] == b and y(r) is not None]
        for name in sorted({line(r) for r in engine}):
            ex = next(r["executor"] for r in engine if line(r) == name)
            pts = sorted((r["config"]["resident"], *y(r)) for r in engine if line(r) == name)
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            ax.errorbar(xs, ys, yerr=err if metric == "decode" else None, marker=markers.get(ex, "o"), capsize=3,
                        color=colors.get(ex), mfc="none" if ex == "topk-fused" else None, ms=7,
                        label=f"INT4, {name}")
        styles = {"hf-bf16": ("tab:red", "--"), "hf-bf16-compile": ("tab:brown", "-."), "engine-fp16": ("tab:purple", ":")}
        for r in recs:
            if r["kind"] in styles and r["config"]["batch"] == b and y(r) is not None:
                col, ls = styles[r["kind"]]
                ax.axhline(y(r)[0], color=col, ls=ls, lw=1.6,
                           label=f"{KIND_LABEL[r['kind']]} (baseline{' p{}/d{}'.format(*_lengths(r)) if many else ''}): "
                                 f"{_num(y(r)[0])}")
        levels = sorted({r["config"]["resident"] for r in engine} | {e})
        ax.set_xticks(levels)
        ax.set_xlabel(f"resident experts per layer (of {e})")
        ax.set_ylabel("decode tok/s (median, min-max)" if metric == "decode" else "peak allocated GiB")
        ax.set_title(f"batch {b}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    _atomic_savefig(fig, path)
    plt.close(fig)
    return True


PHASES = (("decode_step", "one decode step"), ("prefill", "one prefill"))


def _short(name: str, n: int = 48) -> str:
    return name if len(name) <= n else name[: n - 1] + "\u2026"


def _profiled(recs: list[dict]) -> list[dict]:
    return [r for r in sorted(recs, key=_sort_key) if isinstance(r.get("profile"), dict)]


def profile_table(recs: list[dict]) -> list[str]:
    """Per profiled configuration and phase: total time, launches (device executions; host launch calls on
    CUDA) and the three largest names with their shares."""
    lines = ["| configuration | phase | total ms | launches | host launch calls | largest (share) |",
             "|---|---|---|---|---|---|"]
    for r in _profiled(recs):
        for key, label in PHASES:
            ph = r["profile"].get(key) or {}
            if "top" not in ph:
                lines.append(f"| `{r['id']}` | {label} | {_status(ph)} | | | {ph.get('reason', '')} |")
                continue
            hc = ph.get("host_launch_calls")
            top3 = "; ".join(f"{_short(t['name'], 40)} ({t['share']:.0%})" for t in ph["top"][:3])
            lines.append(f"| `{r['id']}` | {label} | {ph['total_device_us'] / 1e3:.3f} | {ph['launches']:.0f} | "
                         f"{'-' if hc is None else f'{hc:.0f}'} | {top3} |")
    return lines


def plot_profile(recs: list[dict], path: Path, title: str) -> bool:
    """One panel per phase (decode step, prefill), one above the other: a horizontal bar per configuration,
    stacked from its top names' shares of the phase's time (the rest grey), its total and launches beside it;
    one colour per name across both panels. Returns False when no record has a profile."""
    prof = _profiled(recs)
    if not prof:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PHASES), 1, figsize=(11.0, len(PHASES) * (1.3 + 0.5 * len(prof))), squeeze=False)
    cmap = plt.get_cmap("tab20")
    names: dict[str, int] = {}  # name -> colour index, by first appearance, shared by the panels
    for ax, (key, label) in zip(axes[:, 0], PHASES):
        for i, r in enumerate(prof):
            ph = r["profile"].get(key) or {}
            left = 0.0
            for t in ph.get("top", []):
                idx = names.setdefault(t["name"], len(names))
                ax.barh(i, t["share"], left=left, color=cmap(idx % 20), edgecolor="white", lw=0.4,
                        label=_short(t["name"]))
                left += t["share"]
            if "other" in ph:
                ax.barh(i, ph["other"]["share"], left=left, color="lightgrey", edgecolor="white", lw=0.4,
                        label="other")
            total = ph.get("total_device_us")
            ax.text(1.01, i, f"{total / 1e3:.2f} ms\n{ph['launches']:.0f} launches" if total else _status(ph),
                    va="center", fontsize=7, transform=ax.get_yaxis_transform())
        ax.set_yticks(range(len(prof)))
        ax.set_yticklabels([_short(r["id"], 60) for r in prof], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel(f"share of {label} ({prof[0]['profile']['time_source']})", fontsize=8)
        ax.set_title(label, fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        keep = {}
        for h, lab in zip(handles, labels):  # one legend entry per name
            keep.setdefault(lab, h)
        ax.legend(list(keep.values())[:24], list(keep)[:24], fontsize=6, loc="center left",
                  bbox_to_anchor=(1.2, 0.5), ncol=1 + len(keep) // 13)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _atomic_savefig(fig, path)
    plt.close(fig)
    return True


def render(records: list[dict], out_md: Path, plots_dir: Path | None = None, sources: list[str] | None = None) -> str:
    """Write the report (and its PNGs) and return the Markdown text."""
    out_md = Path(out_md)
    plots_dir = Path(plots_dir) if plots_dir else out_md.parent / f"{out_md.stem}-plots"
    findings = cc.check_records(records)
    comparable, confounded = cc.residency_pairs(records)
    flagged = {f.record for f in findings if f.severity == cc.FLAG} | {f.other for f in findings if f.severity == cc.FLAG}
    lines = ["# Benchmark report", "",
             f"Rendered by `runmap report` from {len(records)} records"
             + (f" ({', '.join(sources)})" if sources else "") + ". Every figure below comes from those records; "
             "UNSUPPORTED / UNKNOWN mean the run did not (or could not) measure the value.", ""]
    lines += ["## Headline", "", "Median decode tok/s over the timed repeats and peak allocated GPU memory, per model and "
              "configuration (all campaigns below).", ""] + headline_table(records) + [""]
    campaigns: dict[str, list[dict]] = {}
    for r in records:
        campaigns.setdefault(r["campaign"], []).append(r)
    for camp, crecs in sorted(campaigns.items()):
        r0 = crecs[0]
        runs = sorted({r["run_id"] for r in crecs})
        lines += [f"## Campaign `{camp}`", "",
                  f"- device: {r0['device'].get('name')} ({r0['device']['type']}); software: torch {r0['software']['torch']}, "
                  f"triton {r0['software'].get('triton')}, transformers {r0['software'].get('transformers')}, "
                  f"python {r0['software']['python']}",
                  f"- git commit: `{r0['git'].get('commit')}`" + (" (dirty tree)" if r0["git"].get("dirty") else ""),
                  f"- run(s): {', '.join(runs)}; command: `{r0['command']}`",
                  f"- same-run device copy bandwidth (byte floor): {fmt_measure(r0['byte_floor']['copy_bandwidth_gb_s'], 1.0, 1, ' GB/s')}",
                  ""]
        lines += _coverage(crecs)
        models: dict[str, list[dict]] = {}
        for r in crecs:
            models.setdefault(r["config"]["model"], []).append(r)
        for model, mrecs in sorted(models.items()):
            c0 = mrecs[0]["config"]
            lines += [f"### {model} (preset `{c0['preset']}`, {c0['arch']}, {c0['num_layers']} layers, "
                      f"{c0['experts_per_layer']} experts per layer, top-{c0['top_k']})", ""]
            lines += model_table(mrecs, flagged) + [""]
            part = partial_table(mrecs)
            if part:
                lines += ["Partial residency: the engine's hit rate in decode steps beside LRU and Belady (the optimum) "
                          "replayed over the decode routes that ran, misses per decoded token, and decode tok/s against "
                          "the transfer bound (full-residency step + decode steps' missed bytes per token / same-run "
                          "pinned H2D rate). The last column says what misses per token and the bound's bytes per "
                          f"token count, from the record's record_version: `{PER_TOKEN_DECODE}` (bench-record-v2: the "
                          "decode steps' misses and bytes over the tokens they made) or `" + PER_TOKEN_MIXED + "` "
                          "(bench-record-v1, written before the split by phase: every miss of the timed repeats, the "
                          "prompt's included, over the decoded tokens, so misses per token too high and the bound too "
                          "low). A record without cache_stats.decode_hit_rate shows its hit rate over prefill and "
                          "decode. A blank cell: the record has no such field.",
                          ""] + part + [""]
            for metric, label in (("decode", "decode tok/s"), ("memory", "peak allocated memory")):
                png = plots_dir / f"{camp}-{model}-{metric}.png"
                if plot_model(mrecs, metric, png, f"{camp} / {model}: {label} vs resident experts per layer"):
                    rel = os.path.relpath(png, out_md.parent)
                    lines += [f"![{model} {label}]({rel})", ""]
                else:
                    lines += [f"*{label}: no OBSERVED value in these records (e.g. UNSUPPORTED on the CPU); no plot.*", ""]
            png = plots_dir / f"{camp}-{model}-profile.png"
            if plot_profile(mrecs, png, f"{camp} / {model}: where the time of one decode step and one prefill goes"):
                lines += ["Where the time goes (run parameter `profile: true`; torch.profiler, one prefill and one "
                          "decode step per configuration):", ""] + profile_table(mrecs) + [""]
                lines += [f"![{model} profile]({os.path.relpath(png, out_md.parent)})", ""]
            noted = [r for r in sorted(mrecs, key=_sort_key) if r.get("notes")]
            if noted:
                lines += ["Notes written by the runner:", ""]
                lines += [f"- `{r['id']}`: " + "; ".join(r["notes"]) for r in noted] + [""]
            mids = {r["id"] for r in mrecs}
            comp = [(a, b) for a, b in comparable if a["id"] in mids]
            exe = [(a, b) for a, b in cc.executor_pairs(mrecs)]
            conf = [(a, b) for a, b in confounded if a["id"] in mids]
            lines += ["Comparisons that change one factor (ratio = right over left decode tok/s; memory = change of "
                      "peak allocated GiB):", ""]
            hdr = ["| batch | change | decode tok/s | ratio | peak alloc GiB change |", "|---|---|---|---|---|"]
            if comp:
                lines += ["*Residency, executor fixed:*", ""] + hdr + _pair_rows(comp, "residency") + [""]
            if exe:
                lines += ["*Executor, residency fixed:*", ""] + hdr + _pair_rows(exe, "executor") + [""]
            if not (comp or exe or conf):
                lines += ["*None in these records: no two configurations of one model, batch and lengths differ in "
                          "residency or executor alone.*", ""]
            if conf:
                lines += ["*Changes residency and executor at once: flagged, no causal comparison drawn:*", ""]
                lines += [f"- {a['id']} -> {b['id']}" for a, b in conf] + [""]
    errs = cc.errors(findings)
    lines += ["## Conformance of the records", "",
              f"{len(errs)} errors, {len(findings) - len(errs)} flags (runmap.bench.checks: executor-regime, "
              "required-zero, memory-status, full-no-misses, logits-check, confounded-neighbour).", ""]
    lines += [f"- {f}" for f in findings] + [""]
    text = "\n".join(lines)
    write_text(out_md, text)
    return text


def _headline_ratio(rat: dict) -> str:
    """decode_vs_strongest_baseline with the baseline it names; records older than that field fall back to
    the eager ratio, labelled as such so it is not read as the strongest."""
    m = rat.get("decode_vs_strongest_baseline")
    if m is not None:
        return fmt_strongest(m)
    return f"{fmt_ratio(rat.get('decode_vs_hf-bf16'))} (hf-bf16 only)"


def headline_table(records: list[dict], batch: int | None = None) -> list[str]:
    """A compact table for the README: one row per (model, kind, executor, resident), one decode tok/s and
    one peak-memory column per batch size, and per batch size the engine's decode ratio to the strongest
    transformers baseline of the same run (which one in brackets)."""
    recs = [r for r in records if batch is None or r["config"]["batch"] == batch]
    batches = sorted({r["config"]["batch"] for r in recs})
    rows: dict[tuple, dict[int, dict]] = {}
    for r in recs:
        c = r["config"]
        key = (c["preset"], KIND_ORDER.get(r["kind"], 9), r["kind"], path_label(r), -c["resident"], c["experts_per_layer"],
               _lengths(r))
        rows.setdefault(key, {})[c["batch"]] = r
    head = ("| model | path | executor | resident | " + " | ".join(f"decode tok/s b{b}" for b in batches) + " | "
            + " | ".join(f"peak GiB b{b}" for b in batches) + " | "
            + " | ".join(f"vs strongest transformers b{b}" for b in batches) + " |")
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for key in sorted(rows):
        preset, _, kind, ex, negres, e, _lens = key
        by_b = rows[key]
        dec = [f"{by_b[b]['timing']['decode_tok_s']['median']:.1f}" if b in by_b else "-" for b in batches]
        mem = [fmt_measure(by_b[b]["memory"]["peak_allocated_bytes"], GIB) if b in by_b else "-" for b in batches]
        rat = ["-" if kind in ("hf-bf16", "hf-bf16-compile", "engine-fp16") or b not in by_b else
               _headline_ratio(by_b[b]["ratios"]) for b in batches]
        lines.append(f"| {preset} | {KIND_LABEL.get(kind, kind)} | {ex} | {-negres}/{e} | " + " | ".join(dec + mem + rat) + " |")
    return lines
