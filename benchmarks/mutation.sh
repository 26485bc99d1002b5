#!/usr/bin/env bash
# Mutation testing of the expert cache (resident-qpacked-cache-v1) with mutmut: mutates the modules listed in
# pyproject.toml [tool.mutmut] only_mutate (runmap/residency/{cache,transport,host_source,observations,eviction}.py)
# and runs the tests of pytest_add_cli_args_test_selection against each mutant.
#
#   benchmarks/mutation.sh [LABEL] [REV]
#   MUTATION_SCOPE=all benchmarks/mutation.sh after        # every mutant (hours on 2 cores)
#
# LABEL  names the report: results/contract/mutation/<LABEL>.json (default: after)
# REV    a git revision whose tracked files are mutated instead of the working tree (the mutmut
#        configuration always comes from the working tree's pyproject.toml)
#
# It runs in a scratch copy (MUTATION_WORKDIR, default /tmp/runmap-mutation/<LABEL>), never in the work tree,
# so mutmut's mutants/ folder does not appear in the repository. JOBS (default 1) parallel mutant runs.
# MUTATION_SCOPE: mutant name patterns (fnmatch); default: the cache's abort, staging copy, release, row
# reclamation (retiring and fenced rows), lease protection and wait paths (~110 mutants). A full run has 1,700+
# mutants (most in error-message strings and CUDA-only code) at 8-30 s each on 2 shared cores: days, not minutes.
# Wider scopes, e.g. MUTATION_SCOPE="runmap.residency.cache.*" or MUTATION_SCOPE=all, for a longer run.
# Not part of the default test run: ~15 min (current tests) to ~45 min (the slower old suite) for the default
# scope. Needs `pip install -e .[mutation]`.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
LABEL=${1:-after}
REV=${2:-}
WORK=${MUTATION_WORKDIR:-/tmp/runmap-mutation}/$LABEL
rm -rf "$WORK"
mkdir -p "$WORK"
if [ -n "$REV" ]; then
    git -C "$ROOT" archive "$REV" | tar -xf - -C "$WORK"
else  # tracked and untracked-but-not-ignored files of the working tree
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$WORK"
fi
cp "$ROOT/pyproject.toml" "$WORK/pyproject.toml"
cd "$WORK"
# test files of the selection that the mutated revision does not have yet are dropped from its copy
python3 - <<'PY'
import pathlib, re
p = pathlib.Path("pyproject.toml")
s = p.read_text()
m = re.search(r'pytest_add_cli_args_test_selection = \[(.*?)\]', s)
keep = [t for t in re.findall(r'"([^"]+)"', m.group(1)) if pathlib.Path(t.split("::")[0]).exists()]
p.write_text(s[:m.start(1)] + ", ".join(f'"{t}"' for t in keep) + s[m.end(1):])
PY
C='runmap.residency.cache.xǁExpertCacheǁ'
DEFAULT_SCOPE="${C}_abort__mutmut_* ${C}_copy_rows__mutmut_* ${C}_release__mutmut_* ${C}_drop_request__mutmut_*
 ${C}_reclaim_retiring__mutmut_* ${C}_reclaim_fenced__mutmut_* ${C}_protected__mutmut_* ${C}_visible__mutmut_*
 ${C}_retire__mutmut_* ${C}_wait_all__mutmut_*"
SCOPE=${MUTATION_SCOPE:-$DEFAULT_SCOPE}
[ "$SCOPE" = all ] && SCOPE=""
t0=$(date +%s)
# RUNMAP_MUTATION=1: the contract tests skip Hypothesis shrinking (a killed mutant needs no minimal example)
OMP_NUM_THREADS=1 TRITON_INTERPRET=1 RUNMAP_MUTATION=1 PYTHONHASHSEED=0 mutmut run --max-children "${JOBS:-1}" $SCOPE > mutmut-run.log 2>&1 || {
    tail -40 mutmut-run.log; exit 1; }
t1=$(date +%s)
mutmut results --all true > mutmut-results.txt 2>&1 || true
python3 "$ROOT/benchmarks/mutation_report.py" --workdir "$WORK" --label "$LABEL" --rev "${REV:-working-tree}" \
    --seconds $((t1 - t0)) --scope "$SCOPE" --out "$ROOT/results/contract/mutation/$LABEL.json"
