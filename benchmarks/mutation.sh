#!/usr/bin/env bash
# Mutation testing of the expert cache (resident-qpacked-cache-v1) with mutmut: mutates the modules listed in
# pyproject.toml [tool.mutmut] only_mutate (runmap/residency/{cache,transport,host_source,observations,eviction,
# instruments}.py)
# and runs the tests of pytest_add_cli_args_test_selection against each mutant.
#
#   benchmarks/mutation.sh [LABEL] [REV]
#   MUTATION_SCOPE=lease benchmarks/mutation.sh after-lease   # a named scope (presets below)
#   MUTATION_SCOPE=all benchmarks/mutation.sh after        # every mutant (hours on 2 cores)
#
# LABEL  names the report: results/contract/mutation/<LABEL>.json (default: after)
# REV    a git revision whose tracked files are mutated instead of the working tree (the mutmut
#        configuration always comes from the working tree's pyproject.toml)
#
# It runs in a scratch copy (MUTATION_WORKDIR, default /tmp/runmap-mutation/<LABEL>), never in the work tree,
# so mutmut's mutants/ folder does not appear in the repository. JOBS (default 1) parallel mutant runs.
# MUTATION_SCOPE: a preset name or mutant name patterns (fnmatch). Presets (results/contract/mutation/README.md
# says what each leaves out and why):
#   default               the cache's abort, staging copy, release, row reclamation (retiring and fenced rows),
#                         lease protection and wait paths (~110 mutants; report after.json)
#   lease                 the rest of the lease path: Request (acquire, acquire_all, release, __exit__), the
#                         cache's _acquire, _transaction, _take_staging, _use_staging (~275; after-lease.json)
#   transport-observations  the CPU transports' data path (Transport stage/copy/table upload, CpuTransport,
#                         CpuDirectTransport), the host source's protection checks, rewrite and hash counters,
#                         and all_zero (~190; after-transport-observations.json)
#   eviction              both eviction policies (61; after-eviction.json)
#   observations          the observation block (cache_observations, observed, unknown, unsupported; all_zero is in
#                         transport-observations) and the copy monitor behind expert_d2h_bytes and writebacks
#                         (instruments.py, all but the @contextmanager scope, which mutmut skips) (~466;
#                         after-observations.json)
#   construction          construction and reporting: HostSource.__init__, from_pack, _verify; the cache's __init__,
#                         _configure, _startup_publish, _group, admit, telemetry, row_states (637, mostly error
#                         messages and telemetry keys; after-construction.json)
#   construction-rest     the small accessors and helpers that run on the CPU: HostSource.from_rows, watch_reader,
#                         _touch_pages, row_tensor, _sha256; the cache's from_pack, from_host, mapping,
#                         static_row_table, monitored, _watch, _check_faulted, _fault, leased_experts,
#                         outstanding_leases, staging_free, staging_reserved, _Staging; Event, the base Transport's
#                         __init__, alloc_storage, alloc_staging, describe and CpuTransport.__init__ (116; not the
#                         CUDA transports, default_transport's CUDA branches or _np_copy / _unregister_host)
#   placement-prefetch    expert placement and next-layer prefetch (46d771e, 7ba5da8, 204e8e7): ExpertCache.prefetch,
#                         Request.acquire (its place argument), ExpertCache._acquire (place handling, cpu_site_experts,
#                         all_hit_leases, the _prefetched bookkeeping) and the two mutants of the lines prefetch added
#                         to _transaction (by number, as mutmut 3.8.1 numbers them at 204e8e7: 115, the evicted
#                         experts leaving _prefetched; 126, the reclaim in the after-publication fault path) (185;
#                         after-placement-prefetch.json)
#   pace                  transport.pace, the emulated slower host link of the consumer-link experiment (a6aa5cf;
#                         33; after-pace.json)
#   host-read             the host-read site's cache operations (placement host-read): noting a step's host reads
#                         (Request.note_host_reads, note_host_read_step, their masks and counters), promotion
#                         (promote, promote_step, its all-layer pre-filter, _promote_layer), the resident masks, and the
#                         eviction policies' whole-step arrays (touch_layers, values_all, _grow); after-host-read.json
# MUTATION_RERUN=1 benchmarks/mutation.sh LABEL: re-run the survivors (and the mutants no test reached) of an
# earlier run of LABEL that no re-run has killed yet (MUTATION_NAMES: only those matching these patterns), in its
# scratch copy against the working tree (refused if a function they mutate changed since, so the mutants are the
# same); the report then carries both runs (first_run) and the equivalent survivors listed in
# results/contract/mutation/equivalent.json. MUTATION_UNCHECKED=1 (with MUTATION_NAMES): also the mutants matching
# MUTATION_NAMES that a first run stopped before it reached them ("not checked"); the report's first_run then
# counts only the mutants that run reached.
# A full run has 2,000+ mutants (most in error-message strings and CUDA-only code) at 5-45 s each on 2 shared
# cores: days, not minutes. Not part of the default test run: 15-40 min per preset. Needs
# `pip install -e .[mutation]`.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
LABEL=${1:-after}
REV=${2:-}
WORK=${MUTATION_WORKDIR:-/tmp/runmap-mutation}/$LABEL
EQUIV="$ROOT/results/contract/mutation/equivalent.json"
select_tests() {  # test files of the selection that the copy does not have are dropped from its pyproject.toml
python3 - <<'PY'
import pathlib, re
p = pathlib.Path("pyproject.toml")
s = p.read_text()
m = re.search(r'pytest_add_cli_args_test_selection = \[(.*?)\]', s, re.S)
keep = [t for t in re.findall(r'"([^"]+)"', m.group(1)) if pathlib.Path(t.split("::")[0]).exists()]
p.write_text(s[:m.start(1)] + ", ".join(f'"{t}"' for t in keep) + s[m.end(1):])
PY
}
if [ -n "${MUTATION_RERUN:-}" ]; then
    [ -f "$WORK/mutmut-results.txt" ] && [ -f "$WORK/run-info" ] || { echo "no earlier run of $LABEL in $WORK"; exit 2; }
    cd "$WORK"
    [ -f mutmut-results-first.txt ] || cp mutmut-results.txt mutmut-results-first.txt
    # the first run's survivors and the mutants no selected test reached (new tests may reach them now), less
    # those an earlier re-run has killed since
    mapfile -t names < <(python3 - <<'PY'
def status(path):
    return dict(line.strip().rsplit(": ", 1) for line in open(path) if "__mutmut_" in line and ": " in line)
import fnmatch, os
first, now = status("mutmut-results-first.txt"), status("mutmut-results.txt")
only = os.environ.get("MUTATION_NAMES", "").split()
# a stopped first run leaves mutants of its scope unchecked; the scope is then named by MUTATION_NAMES
redo = ("survived", "no tests") + (("not checked",) if only and os.environ.get("MUTATION_UNCHECKED") else ())
for name, st in first.items():
    if st in redo and now.get(name) not in ("killed", "timeout"):
        if not only or any(fnmatch.fnmatch(name, p) for p in only):
            print(name)
PY
)
    [ ${#names[@]} -gt 0 ] || { echo "$LABEL: every survivor of the first run is killed"; exit 0; }
    # their functions must be those of the first run (then mutmut makes the same mutants of them)
    python3 - "$ROOT" "${names[@]}" <<'PY'
import ast, sys
from pathlib import Path

def functions(path):
    src = path.read_text()
    out = {}
    for node in ast.parse(src).body:
        subs = node.body if isinstance(node, ast.ClassDef) else [node]
        for f in subs:
            if isinstance(f, ast.FunctionDef):
                out[f"{node.name}.{f.name}" if f is not node else f.name] = ast.get_source_segment(src, f)
    return out

root, changed, seen = Path(sys.argv[1]), set(), {}
for name in sys.argv[2:]:
    mod, _, rest = name.partition(".x")
    func = rest.rsplit("__mutmut_", 1)[0]
    key = func.strip("ǁ").replace("ǁ", ".") if "ǁ" in func else func[1:]
    path = mod.replace(".", "/") + ".py"
    for tree in (Path("."), root):
        seen.setdefault((tree, path), functions(tree / path))
    if key not in seen[(Path("."), path)] or seen[(Path("."), path)][key] != seen[(root, path)].get(key):
        changed.add(f"{path}:{key}")
if changed:
    sys.exit("changed since the first run (run the scope afresh): " + ", ".join(sorted(changed)))
PY
    # the working tree replaces the copy (mutmut keeps the verdicts of functions that did not change)
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xmf -  # -m: new mtimes, so mutmut regenerates changed modules
    cp "$ROOT/pyproject.toml" pyproject.toml
    select_tests
    read -r first_rev first_seconds first_scope_name < run-info
    t0=$(date +%s)
    OMP_NUM_THREADS=1 TRITON_INTERPRET=1 RUNMAP_MUTATION=1 PYTHONHASHSEED=0 mutmut run --max-children "${JOBS:-1}" \
        "${names[@]}" > mutmut-rerun.log 2>&1 || { tail -40 mutmut-rerun.log; exit 1; }
    t1=$(date +%s)
    mutmut results --all true > mutmut-results.txt 2>&1 || true
    MUTATION_SCOPE=$first_scope_name
    echo "${#names[@]} re-run with the working tree at $(git -C "$ROOT" rev-parse --short HEAD) in $((t1 - t0)) s" >> rerun-notes
    RERUN_NOTE="first run: $first_rev, $first_seconds s; then its survivors and unreached mutants (their functions \
unchanged): $(paste -sd';' rerun-notes | sed 's/;/; then /g')"
fi
if [ -z "${MUTATION_RERUN:-}" ]; then
rm -rf "$WORK"
mkdir -p "$WORK"
if [ -n "$REV" ]; then
    git -C "$ROOT" archive "$REV" | tar -xf - -C "$WORK"
else  # tracked and untracked-but-not-ignored files of the working tree
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$WORK"
fi
cp "$ROOT/pyproject.toml" "$WORK/pyproject.toml"
cd "$WORK"
select_tests
fi
R='runmap.residency'
C="$R.cache.xǁExpertCacheǁ"
T="$R.transport.x"
H="$R.host_source.xǁHostSourceǁ"
case "${MUTATION_SCOPE:-default}" in
default) SCOPE="${C}_abort__mutmut_* ${C}_copy_rows__mutmut_* ${C}_release__mutmut_* ${C}_drop_request__mutmut_*
 ${C}_reclaim_retiring__mutmut_* ${C}_reclaim_fenced__mutmut_* ${C}_protected__mutmut_* ${C}_visible__mutmut_*
 ${C}_retire__mutmut_* ${C}_wait_all__mutmut_*" ;;
lease) SCOPE="$R.cache.xǁRequestǁ* ${C}_acquire__mutmut_* ${C}_transaction__mutmut_* ${C}_take_staging__mutmut_*
 ${C}_use_staging__mutmut_*" ;;
transport-observations) SCOPE="${T}ǁTransportǁstage__mutmut_* ${T}ǁTransportǁstage_and_copy__mutmut_*
 ${T}ǁTransportǁcopy_rows__mutmut_* ${T}ǁTransportǁupload_table__mutmut_* ${T}ǁTransportǁupload_table_async__mutmut_*
 ${T}ǁCpuTransportǁh2d__mutmut_* ${T}ǁCpuTransportǁquery__mutmut_* ${T}ǁCpuDirectTransportǁ*
 $R.host_source.x__probe_pages__mutmut_* $R.host_source.x__maps_read_only__mutmut_*
 $R.host_source.xǁHostSourceǁverify_protection__mutmut_* $R.host_source.xǁHostSourceǁprotection_holds__mutmut_*
 $R.host_source.xǁHostSourceǁcheck_frozen__mutmut_* $R.host_source.xǁHostSourceǁwrite_row__mutmut_*
 $R.host_source.xǁHostSourceǁhash_row__mutmut_* $R.observations.x_all_zero__mutmut_*" ;;
eviction) SCOPE="$R.eviction.x*" ;;
observations) SCOPE="$R.observations.x_cache_observations__mutmut_* $R.observations.x_observed__mutmut_*
 $R.observations.x_unknown__mutmut_* $R.observations.x_unsupported__mutmut_* $R.instruments.x*" ;;
construction) SCOPE="${H}__init____mutmut_* ${H}from_pack__mutmut_* ${H}_verify__mutmut_* ${C}__init____mutmut_*
 ${C}_configure__mutmut_* ${C}_startup_publish__mutmut_* ${C}_group__mutmut_* ${C}admit__mutmut_*
 ${C}telemetry__mutmut_* ${C}row_states__mutmut_*" ;;
construction-rest) SCOPE="$R.host_source.x__sha256__mutmut_* ${H}from_rows__mutmut_* ${H}watch_reader__mutmut_*
 ${H}_touch_pages__mutmut_* ${H}row_tensor__mutmut_* $R.cache.xǁ_Stagingǁ* ${C}from_pack__mutmut_* ${C}from_host__mutmut_*
 ${C}mapping__mutmut_* ${C}static_row_table__mutmut_* ${C}monitored__mutmut_* ${C}_watch__mutmut_*
 ${C}_check_faulted__mutmut_* ${C}_fault__mutmut_* ${C}leased_experts__mutmut_* ${C}outstanding_leases__mutmut_*
 ${C}staging_free__mutmut_* ${C}staging_reserved__mutmut_* ${T}ǁEventǁ* ${T}ǁTransportǁ__init____mutmut_*
 ${T}ǁTransportǁalloc_storage__mutmut_* ${T}ǁTransportǁalloc_staging__mutmut_* ${T}ǁTransportǁdescribe__mutmut_*
 ${T}ǁCpuTransportǁ__init____mutmut_*" ;;
placement-prefetch) SCOPE="${C}prefetch__mutmut_* $R.cache.xǁRequestǁacquire__mutmut_* ${C}_acquire__mutmut_*
 ${C}_transaction__mutmut_115 ${C}_transaction__mutmut_126" ;;
pace) SCOPE="$R.transport.x_pace__mutmut_*" ;;
host-read) SCOPE="${C}promote__mutmut_* ${C}promote_step__mutmut_* ${C}_promotion_candidates__mutmut_*
 ${C}_promote_layer__mutmut_* ${C}_resident_mask__mutmut_* ${C}_used_mask__mutmut_* ${C}note_host_read_step__mutmut_*
 ${C}_note_host_reads__mutmut_* ${C}_check_noting__mutmut_* ${C}_count_host_reads__mutmut_*
 $R.cache.xǁRequestǁnote_host_reads__mutmut_* $R.cache.xǁRequestǁmapping__mutmut_*
 $R.eviction.xǁEvictionPolicyǁtouch_layers__mutmut_* $R.eviction.xǁEvictionPolicyǁ_touch_mask__mutmut_*
 $R.eviction.xǁEvictionPolicyǁ_grow__mutmut_* $R.eviction.xǁLFUDecayPolicyǁ_touch_mask__mutmut_*
 $R.eviction.xǁLFUDecayPolicyǁvalues_all__mutmut_* $R.eviction.xǁLRUPolicyǁvalues_all__mutmut_*" ;;
*) SCOPE=$MUTATION_SCOPE ;;
esac
[ "$SCOPE" = all ] && SCOPE=""
if [ -n "${MUTATION_RERUN:-}" ]; then
    python3 "$ROOT/benchmarks/mutation_report.py" --workdir "$WORK" --label "$LABEL" --rev "$first_rev" \
        --seconds "$first_seconds" --scope "$SCOPE" --first-run mutmut-results-first.txt --equivalent "$EQUIV" \
        --note "$RERUN_NOTE" --out "$ROOT/results/contract/mutation/$LABEL.json"
    exit 0
fi
t0=$(date +%s)
# RUNMAP_MUTATION=1: the contract tests skip Hypothesis shrinking (a killed mutant needs no minimal example)
OMP_NUM_THREADS=1 TRITON_INTERPRET=1 RUNMAP_MUTATION=1 PYTHONHASHSEED=0 mutmut run --max-children "${JOBS:-1}" $SCOPE > mutmut-run.log 2>&1 || {
    tail -40 mutmut-run.log; exit 1; }
t1=$(date +%s)
echo "${REV:-working-tree} $((t1 - t0)) ${MUTATION_SCOPE:-default}" > run-info
mutmut results --all true > mutmut-results.txt 2>&1 || true
python3 "$ROOT/benchmarks/mutation_report.py" --workdir "$WORK" --label "$LABEL" --rev "${REV:-working-tree}" \
    --seconds $((t1 - t0)) --scope "$SCOPE" --equivalent "$EQUIV" --out "$ROOT/results/contract/mutation/$LABEL.json"
