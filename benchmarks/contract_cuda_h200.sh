#!/usr/bin/env bash
# The cache contract on the H200 (resident-qpacked-cache-v1, docs/cache-contract.md), two reports:
#
#   h200-cuda-events.json  the Hypothesis state machine with the real CudaTransport's events alone deciding copy
#                          completion (6.5 MB rows, copy stream kept busy, each row compared with its expert's bytes
#                          the moment its event completes, on a stream not ordered after the copies), with the mutants
#                          that can show there, the broken event-before-copy transport among them
#   h200-controlled.json   the controlled-transport mode on CUDA (failures and interrupts injected at every step)
#
# Run from the repository root of a bare source tree (no install needed; torch and hypothesis present):
#   PYTHONUNBUFFERED=1 PYTHONPATH=. bash benchmarks/contract_cuda_h200.sh
#   CONTRACT=v2 ... bash benchmarks/contract_cuda_h200.sh    # resident-qpacked-cache-v2: h200-*-v2.json
# Reports go to $OUT/contract/ (OUT defaults to results); under 6 minutes in all (each run has its own timeout).
# Commit them under results/contract/ and check them with `runmap validate results/contract/h200-*.json`.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
DIR=${OUT:-results}/contract
CONTRACT=${CONTRACT:-v1}
SUFFIX=$([ "$CONTRACT" = v1 ] || echo "-$CONTRACT")
mkdir -p "$DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$DIR/h200-contract-gpu.txt" 2>&1 || true
python3 -c "import torch, hypothesis; print('torch', torch.__version__, 'hypothesis', hypothesis.__version__)" \
    | tee -a "$DIR/h200-contract-gpu.txt"
rc=0
timeout 200 python3 -m runmap.cli.contract --device cuda --events cuda --contract "$CONTRACT" --no-progress \
    --examples 40 --steps 20 --mutant-examples 30 --out "$DIR/h200-cuda-events$SUFFIX.json" \
    > "$DIR/h200-cuda-events$SUFFIX.log" 2>&1 || rc=1
tail -25 "$DIR/h200-cuda-events$SUFFIX.log"
timeout 130 python3 -m runmap.cli.contract --device cuda --events controlled --contract "$CONTRACT" --no-progress \
    --examples 80 --steps 30 --mutant-examples 200 --out "$DIR/h200-controlled$SUFFIX.json" \
    > "$DIR/h200-controlled$SUFFIX.log" 2>&1 || rc=1
tail -25 "$DIR/h200-controlled$SUFFIX.log"
exit $rc
