# Sourced by the device-call scripts that run GPU tests (two_site_h200.sh, two_site_graph_h200.sh,
# host_read_h200.sh, grouped_chain_h200.sh): strict mode, $OUT checked and made, the call's clock started,
# unbuffered Python on the repository, and jsonschema from the carried wheels/ (the tests validate telemetry against
# its schema; the GPU machine lacks it).
set -uo pipefail
: "${OUT:?set OUT to the directory whose files come back}"
mkdir -p "$OUT"
SECONDS=0  # bash counts the call's seconds from here
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -c "import jsonschema" 2>/dev/null || { [ -d wheels ] && python3 -m pip install -q --no-index --find-links wheels/ \
  --break-system-packages jsonschema==4.26.0; }
