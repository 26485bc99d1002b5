"""Summarise a mutmut run of benchmarks/mutation.sh into a JSON report (results/contract/mutation/<label>.json).

Reads ``mutmut results --all true`` (mutmut-results.txt in the scratch copy) and, for each surviving mutant, its
diff (``mutmut show``). The kill rate counts killed (and timed-out, i.e. hung) mutants over every mutant that ran;
mutants whose function no selected test reaches ("no tests") are listed apart.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--rev", required=True)
    p.add_argument("--seconds", type=int, default=0)
    p.add_argument("--scope", default="", help="the mutant name patterns the run was restricted to")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    work = Path(a.workdir)
    status = {}
    for line in (work / "mutmut-results.txt").read_text().splitlines():
        line = line.strip()
        if "__mutmut_" in line and ": " in line:
            name, st = line.rsplit(": ", 1)
            status[name] = st
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
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{a.label}: {killed}/{ran} killed ({doc['kill_rate']}), {counts['survived']} survived, "
          f"{counts['no tests']} without tests -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
