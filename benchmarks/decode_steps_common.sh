# Sourced by decode_ab_h200.sh and decode_env_ab_h200.sh (after they define LOGS, WORK, left and step): the optional
# probe under a budget and the directly synthesized packs both scripts time decode on.

run_probe() {  # DEFAULT_KEEP_S: PROBE (python3's arguments; {dir} is LOGS) given what the budget leaves beyond
  # PROBE_KEEP_S (default DEFAULT_KEEP_S) for the decode rows; nothing when PROBE is unset
  [ -n "${PROBE:-}" ] || return 0
  local keep=${PROBE_KEEP_S:-$1}
  if [ "$(left)" -gt $(( keep + 30 )) ]; then
    PYTHONPATH=. timeout $(( $(left) - keep )) python3 ${PROBE//\{dir\}/$LOGS} > "$LOGS/probe.log" 2>&1
    step "probe exit $?"; tail -12 "$LOGS/probe.log"
  else
    step "probe skipped ($(left) s left, $keep kept for the decode rows)"
  fi
}

pack() {  # NAME PRESET: WORK/pk-NAME at the preset's real dimensions, random INT4 codes (speed runs), unless present
  [ -f "$WORK/pk-$1/manifest.json" ] && return 0
  PYTHONPATH=. python3 -m runmap synth "$WORK/pk-$1" --preset "$2" --direct-pack --force --no-progress \
    > "$LOGS/prepare-$1.log" 2>&1
  step "pack $1: exit $?"
}
