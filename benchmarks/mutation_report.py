"""Summarise a mutmut run of benchmarks/mutation.sh into a JSON report (results/contract/mutation/<label>.json).

Reads ``mutmut results --all true`` (mutmut-results.txt in the scratch copy) and, for each surviving mutant, its
diff (``mutmut show``). The kill rate counts killed (and timed-out, i.e. hung) mutants over every mutant that ran;
mutants whose function no selected test reaches ("no tests") are listed apart.

``--first-run`` (the mutmut-results.txt of the run before survivors were re-run against new tests) adds that run's
counts and survivors (the verdicts are the first run's, updated with those of the mutants re-run since);
``--equivalent`` (results/contract/mutation/equivalent.json: mutant name -> why it cannot be killed) marks
survivors as equivalent and adds the kill rate over the non-equivalent mutants.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
from pathlib import Path


def read_status(path: Path) -> dict:
    status = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if "__mutmut_" in line and ": " in line:
            name, st = line.rsplit(": ", 1)
            status[name] = st
    return status


def summary(status: dict, names=None) -> dict:
    """Counts, ran, killed and kill rate of ``status`` (restricted to ``names`` when given)."""
    if names is not None:
        status = {n: s for n, s in status.items() if n in names}
    counts = collections.Counter(status.values())
    ran = sum(v for k, v in counts.items() if k not in ("no tests", "not checked", "skipped"))
    killed = counts["killed"] + counts["timeout"]
    return {"counts": dict(sorted(counts.items())), "ran": ran, "killed": killed,
            "kill_rate": round(killed / ran, 4) if ran else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--rev", required=True)
    p.add_argument("--seconds", type=int, default=0)
    p.add_argument("--scope", default="", help="the mutant name patterns the run was restricted to")
    p.add_argument("--out", required=True)
    p.add_argument("--first-run", help="mutmut-results.txt of the first run (before survivors were re-run)")
    p.add_argument("--equivalent", help="JSON {mutant name: why it is equivalent}")
    p.add_argument("--note", default="", help="how the run was made (re-runs, revisions)")
    a = p.parse_args()
    work = Path(a.workdir)
    status = read_status(work / "mutmut-results.txt")
    first = read_status(Path(a.first_run)) if a.first_run else None
    if first is not None:  # a re-run may have reset the verdicts it did not re-run (mutmut does on a config change)
        status = {n: (status[n] if status.get(n, "not checked") != "not checked" else st) for n, st in first.items()}
    counts = collections.Counter(status.values())
    by_module = collections.defaultdict(collections.Counter)
    for name, st in status.items():
        by_module[name.split(".x")[0]][st] += 1
    ran = sum(v for k, v in counts.items() if k not in ("no tests", "not checked", "skipped"))
    killed = counts["killed"] + counts["timeout"]
    survivors = {}
    for name, st in sorted(status.items()):
        if st == "survived":
            r = subprocess.run(["mutmut", "show", name], cwd=work, capture_output=True, text=True)
            survivors[name] = "\n".join(line for line in r.stdout.splitlines()[1:] if line.startswith(("+", "-"))
                                        and not line.startswith(("+++", "---")))
    doc = {
        "label": a.label, "rev": a.rev, "tool": "mutmut 3.8.1", "seconds": a.seconds,
        "scope": a.scope.split() if a.scope else "every mutant of [tool.mutmut] only_mutate",
        "counts": dict(sorted(counts.items())), "ran": ran, "killed": killed,
        "kill_rate": round(killed / ran, 4) if ran else None,
        "by_module": {m: dict(sorted(c.items())) for m, c in sorted(by_module.items())},
        "survivors": survivors,
        "no_tests": sorted(n for n, s in status.items() if s == "no tests"),
    }
    if a.note:
        doc["note"] = a.note
    ran_names = {n for n, st in status.items() if st not in ("no tests", "not checked", "skipped")}
    if first is not None:
        doc["first_run"] = summary(first, ran_names)
        doc["first_run"]["survivors"] = sorted(n for n in ran_names if first.get(n) == "survived")
    if a.equivalent:
        reasons = json.loads(Path(a.equivalent).read_text())
        equivalent = {n: reasons[n] for n in survivors if n in reasons}
        doc["equivalent"] = equivalent
        doc["not_explained"] = sorted(n for n in survivors if n not in reasons)
        non_eq = ran - len(equivalent)
        doc["non_equivalent"] = non_eq
        doc["kill_rate_non_equivalent"] = round(killed / non_eq, 4) if non_eq else None
        if a.first_run:
            f = doc["first_run"]
            f_non_eq = f["ran"] - sum(1 for n in equivalent if first.get(n) == "survived")  # reached then
            f["kill_rate_non_equivalent"] = round(f["killed"] / f_non_eq, 4) if f_non_eq else None
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{a.label}: {killed}/{ran} killed ({doc['kill_rate']}), {counts['survived']} survived"
          + (f" ({len(doc['equivalent'])} equivalent, {len(doc['not_explained'])} not explained)"
             if "equivalent" in doc else "") + f", {counts['no tests']} without tests -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
