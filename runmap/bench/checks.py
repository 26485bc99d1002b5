"""Conformance checks over benchmark records, beyond what bench-record.schema.json can say.

Run by ``runmap validate`` over every bench record it validates (``check_documents``) and by the
report (which draws no causal comparison from a flagged pair). Checks:

* ``executor-regime``: every record names its executor and its regime, and the regime agrees with the
  configuration (full <=> resident == experts per layer).
* ``required-zero``: each required-zero observation of the cache contract is OBSERVED zero, or
  explicitly UNKNOWN / UNSUPPORTED with a reason and no value -- never a bare number, never a value
  under a non-OBSERVED status, never an OBSERVED non-zero (a contract violation).
* ``memory-status``: peak memory figures are measures with a status; an OBSERVED peak is > 0 (a zero
  peak is a run that did not measure), and a CPU run says UNSUPPORTED.
* ``full-no-misses``: a full-residency engine record (kind engine: the baselines run no cache) observed
  zero misses and zero host->device expert bytes.
* ``logits-check``: a record that carries the logits check against the reference executor has it
  OBSERVED, and its largest difference is within its tolerance x the logit scale (recomputed here, not
  read from ``passed``); a ``passed`` that disagrees with the figures is an error too.
* ``confounded-neighbour`` (a flag, not an error): along the residency axis of one series (same
  campaign, model, kind, engine variant, batch and lengths), a record whose neighbour at the adjacent residency level
  runs a different executor, with no same-executor record there: that transition changes residency
  and executor at once, so neither effect can be read from it (docs/architecture.md#executors).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from runmap.bench.registry import RECORD_EXECUTORS as EXECUTORS
from runmap.residency.observations import OBSERVATION_NAMES as REQUIRED_ZERO, STATUSES
from runmap.residency.regimes import REGIME_NAMES as REGIMES, regime_of

# The bench record's versions, oldest first: every reader (runmap report, runmap validate's checks) takes each
# of them, `runmap bench` writes the last. What a version says (docs/routing-workloads.md, "Route traces and
# replay"): the meaning of the per-token decode figures, routing.misses_per_token and h2d.bytes_per_token (and
# timing.transfer_bound_tok_s, built from the bytes per token):
#   bench-record-v1: every miss / host->device byte of the timed repeats, the prompt's included, over the decoded
#                    tokens ("mixed");
#   bench-record-v2: the decode steps' own misses / bytes over the tokens the decode steps made, each row's first
#                    token being the prefill's ("decode only"; the prefill's are cache_stats.misses -
#                    cache_stats.decode_misses and h2d.prefill_bytes).
RECORD_VERSIONS = ("bench-record-v1", "bench-record-v2")
RECORD_VERSION = RECORD_VERSIONS[-1]
DECODE_ONLY_SINCE = "bench-record-v2"


def per_token_figures_are_decode_only(rec: dict) -> bool:
    """Whether a record's misses / H2D bytes per token (and its transfer bound) count the decode steps alone
    (True), or the prompt's too (False: bench-record-v1). Read from record_version alone, never from which fields
    the record happens to carry."""
    return RECORD_VERSIONS.index(rec["record_version"]) >= RECORD_VERSIONS.index(DECODE_ONLY_SINCE)

ERROR, FLAG = "error", "flag"


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    severity: str  # "error" fails validation; "flag" is reported and excluded from causal comparisons
    record: str  # record id (or "?")
    message: str
    file: str | None = None
    other: str | None = None  # the neighbour record of a pair finding

    def __str__(self) -> str:
        where = self.file or self.record
        return f"{where}: [{self.severity} {self.check}] {self.message}"

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def is_record(doc: Any) -> bool:
    """A bench record of any version a reader takes (RECORD_VERSIONS)."""
    return isinstance(doc, dict) and doc.get("record_version") in RECORD_VERSIONS


def _rid(rec: dict) -> str:
    return str(rec.get("id", "?"))


def check_executor_regime(rec: dict) -> list[Finding]:
    out = []
    ex, reg = rec.get("executor"), rec.get("regime")
    if not isinstance(ex, str) or ex not in EXECUTORS:
        out.append(Finding("executor-regime", ERROR, _rid(rec), f"executor {ex!r} is not one of {list(EXECUTORS)}"))
    if reg not in REGIMES:
        out.append(Finding("executor-regime", ERROR, _rid(rec), f"regime {reg!r} is not one of {list(REGIMES)}"))
        return out
    cfg = rec.get("config") or {}
    r, e = cfg.get("resident"), cfg.get("experts_per_layer")
    if isinstance(r, int) and isinstance(e, int):
        want = regime_of(r, e)
        if reg != want:
            out.append(Finding("executor-regime", ERROR, _rid(rec),
                               f"regime {reg!r} but resident {r} of {e} experts per layer is {want!r}"))
    return out


def check_required_zero(rec: dict) -> list[Finding]:
    out = []
    obs = rec.get("observations")
    if not isinstance(obs, dict):
        return [Finding("required-zero", ERROR, _rid(rec), "no observations object")]
    for n in REQUIRED_ZERO:
        o = obs.get(n)
        if o is None:
            out.append(Finding("required-zero", ERROR, _rid(rec), f"{n}: missing (write it as UNKNOWN with a reason)"))
        elif not isinstance(o, dict):
            out.append(Finding("required-zero", ERROR, _rid(rec),
                               f"{n}: bare value {o!r} without a status (OBSERVED / UNKNOWN / UNSUPPORTED)"))
        elif o.get("status") not in STATUSES:
            out.append(Finding("required-zero", ERROR, _rid(rec), f"{n}: status {o.get('status')!r} not in {list(STATUSES)}"))
        elif o["status"] == "OBSERVED":
            v = o.get("value")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                out.append(Finding("required-zero", ERROR, _rid(rec), f"{n}: OBSERVED without a numeric value ({v!r})"))
            elif v != 0:
                out.append(Finding("required-zero", ERROR, _rid(rec), f"{n}: OBSERVED {v}, the contract requires 0"))
        else:
            if "value" in o:
                out.append(Finding("required-zero", ERROR, _rid(rec),
                                   f"{n}: {o['status']} carries a value ({o['value']!r}); a run that did not measure "
                                   "must not write one"))
            if not o.get("reason"):
                out.append(Finding("required-zero", ERROR, _rid(rec), f"{n}: {o['status']} without a reason"))
    return out


def check_memory_status(rec: dict) -> list[Finding]:
    out = []
    mem = rec.get("memory") or {}
    dev = (rec.get("device") or {}).get("type")
    for k in ("peak_allocated_bytes", "peak_reserved_bytes"):
        m = mem.get(k)
        if not isinstance(m, dict) or m.get("status") not in STATUSES:
            out.append(Finding("memory-status", ERROR, _rid(rec), f"memory.{k}: {m!r} is not a measure with a status"))
            continue
        if m["status"] == "OBSERVED":
            v = m.get("value")
            if not isinstance(v, (int, float)) or v <= 0:
                out.append(Finding("memory-status", ERROR, _rid(rec), f"memory.{k}: OBSERVED {v!r}; a measured peak is > 0"))
            if dev == "cpu":
                out.append(Finding("memory-status", ERROR, _rid(rec),
                                   f"memory.{k}: OBSERVED on a CPU run; torch keeps no host allocator peak (UNSUPPORTED)"))
        elif "value" in m:
            out.append(Finding("memory-status", ERROR, _rid(rec), f"memory.{k}: {m['status']} carries a value"))
    return out


def _value(m) -> float | None:
    return m.get("value") if isinstance(m, dict) and m.get("status") == "OBSERVED" else None


def check_full_no_misses(rec: dict) -> list[Finding]:
    if rec.get("regime") != "full" or rec.get("kind") != "engine":
        return []  # the baselines run no expert cache: there is nothing to miss
    out = []
    misses = (rec.get("cache_stats") or {}).get("misses")
    v = _value(misses)
    if v is None:
        out.append(Finding("full-no-misses", ERROR, _rid(rec),
                           f"full residency but misses are not OBSERVED ({misses!r}); zero misses must be observed"))
    elif v != 0:
        out.append(Finding("full-no-misses", ERROR, _rid(rec), f"full residency but {v} misses observed"))
    h2d = _value((rec.get("h2d") or {}).get("bytes"))
    if h2d:
        out.append(Finding("full-no-misses", ERROR, _rid(rec), f"full residency but {h2d} expert bytes copied host->device"))
    return out


def check_logits(rec: dict) -> list[Finding]:
    """The record's logits check (runmap.bench.campaign.logits_check) against its own figures: where routing was
    compared (routes_agree OBSERVED), the difference to the reference executor on the same routes within
    tolerance x scale and routes_agree at least min_route_agreement; otherwise the difference to the reference
    (its own routing) within tolerance x scale."""
    chk = rec.get("check")
    if chk is None:
        return []
    if not isinstance(chk, dict):
        return [Finding("logits-check", ERROR, _rid(rec), f"check is {chk!r}, not an object")]
    diff, scale, tol = _value(chk.get("executor_vs_reference_max_abs")), _value(chk.get("logit_scale")), chk.get("tolerance")
    if diff is None or scale is None or not isinstance(tol, (int, float)):
        return [Finding("logits-check", ERROR, _rid(rec), "logits check without an OBSERVED difference, logit scale "
                        "and tolerance")]
    routes = chk.get("routes_agree")
    out = []
    if isinstance(routes, dict) and routes.get("status") == "OBSERVED":
        frac, same, floor = _value(routes), _value(chk.get("executor_vs_reference_same_routes_max_abs")), \
            chk.get("min_route_agreement")
        ok = same is not None and same <= tol * scale and isinstance(floor, (int, float)) and frac >= floor
        if not ok:
            out.append(Finding("logits-check", ERROR, _rid(rec),
                               f"executor {rec.get('executor')} vs {chk.get('reference_executor')}: max |diff| on the "
                               f"same routes {'UNKNOWN' if same is None else f'{same:.4g}'} (tolerance {tol} x logit "
                               f"scale {scale:.4g}), routes agree at {frac:.4g} of positions (min {floor})"))
    else:
        ok = diff <= tol * scale
        if not ok:
            out.append(Finding("logits-check", ERROR, _rid(rec),
                               f"executor {rec.get('executor')} vs {chk.get('reference_executor')}: max |diff| "
                               f"{diff:.4g} > tolerance {tol} x logit scale {scale:.4g}"))
    if chk.get("passed") is not ok:
        out.append(Finding("logits-check", ERROR, _rid(rec), f"passed={chk.get('passed')!r} but the figures say {ok}"))
    return out


RECORD_CHECKS = (check_executor_regime, check_required_zero, check_memory_status, check_full_no_misses, check_logits)


def series_key(rec: dict) -> tuple:
    """Records that differ only in residency and executor: engine variants (no graphs, torch ops, experts
    skipped) are series of their own."""
    c = rec.get("config") or {}
    return (rec.get("campaign"), c.get("model"), rec.get("kind"), c.get("variant", "default"), c.get("batch"),
            c.get("prompt_len"), c.get("decode_len"))


def residency_pairs(records: list[dict]) -> tuple[list[tuple[dict, dict]], list[tuple[dict, dict]]]:
    """(comparable, confounded) pairs of records at adjacent residency levels of each series.

    Comparable: same executor, residency changed (a residency effect). Confounded: a record whose
    executor does not run at the adjacent level, paired with each record there (both changed)."""
    series: dict[tuple, dict[int, list[dict]]] = {}
    for r in records:
        res = (r.get("config") or {}).get("resident")
        if r.get("kind") != "engine" or not isinstance(res, int):
            continue
        series.setdefault(series_key(r), {}).setdefault(res, []).append(r)
    comparable, confounded = [], []
    for levels in series.values():
        ordered = sorted(levels)
        for lo, hi in zip(ordered, ordered[1:]):
            a_recs, b_recs = levels[lo], levels[hi]
            a_ex = {a.get("executor") for a in a_recs}
            for a in a_recs:
                same = [b for b in b_recs if b.get("executor") == a.get("executor")]
                comparable += [(a, b) for b in same]
                if not same:  # a's executor stops here: every step to the next level changes both
                    confounded += [(a, b) for b in b_recs]
            for b in b_recs:
                if b.get("executor") not in a_ex:  # b's executor starts here
                    confounded += [(a, b) for a in a_recs]
    # de-duplicate, keeping order
    seen, uniq = set(), []
    for a, b in confounded:
        k = (_rid(a), _rid(b))
        if k not in seen:
            seen.add(k)
            uniq.append((a, b))
    return comparable, uniq


def executor_pairs(records: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs at the same residency level of one series with different executors (an executor effect)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("kind") == "engine":
            groups.setdefault(series_key(r) + ((r.get("config") or {}).get("resident"),), []).append(r)
    out = []
    for recs in groups.values():
        recs = sorted(recs, key=lambda r: str(r.get("executor")))
        out += [(a, b) for i, a in enumerate(recs) for b in recs[i + 1:] if a.get("executor") != b.get("executor")]
    return out


def check_confounded(records: list[dict]) -> list[Finding]:
    out = []
    for a, b in residency_pairs(records)[1]:
        ca, cb = a["config"], b["config"]
        out.append(Finding(
            "confounded-neighbour", FLAG, _rid(b),
            f"changes residency ({ca['resident']} -> {cb['resident']}) and executor ({a.get('executor')} -> "
            f"{b.get('executor')}) against {_rid(a)}: no causal comparison is drawn from this pair",
            other=_rid(a)))
    return out


def check_records(records: list[dict], files: list[str] | None = None) -> list[Finding]:
    """Every finding over a set of records (files, when given, parallel to records, label findings)."""
    out = []
    for i, rec in enumerate(records):
        f = files[i] if files else rec.get("_path")
        for chk in RECORD_CHECKS:
            out += [dataclasses.replace(x, file=f) for x in chk(rec)]
    by_id = {_rid(r): (files[i] if files else r.get("_path")) for i, r in enumerate(records)}
    out += [dataclasses.replace(x, file=by_id.get(x.record)) for x in check_confounded(records)]
    return out


def check_documents(documents: Iterable[tuple[str, int | None, Any]]) -> list[Finding]:
    """Hook for ``runmap validate``: (file, line, document) triples of everything it validated; the
    bench records among them are checked, everything else is ignored."""
    recs, files = [], []
    for file, _line, doc in documents:
        if is_record(doc):
            recs.append(doc)
            files.append(file)
    return check_records(recs, files) if recs else []


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == ERROR]
