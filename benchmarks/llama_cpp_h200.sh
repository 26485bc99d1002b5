#!/usr/bin/env bash
# llama.cpp as a peer in the H200 campaign (issue 25 item 5), in ONE device call, inside a time budget:
#
#   bash benchmarks/llama_cpp_h200.sh [BUDGET_S]     (repo root, $OUT set; the device tool: carry=[".llama-cpp"])
#
# 0. checks the machine: nvidia-smi, nvcc (PATH, /usr/local/cuda*/bin), cmake, a C++ compiler, ninja, the Python
#    modules the converter needs, free disk; says clearly what is missing. No nvcc: a CPU-only build (said in
#    every record: backends CPU) so that the conversion and the records are still exercised.
# 1. unpacks .llama-cpp/llama-cpp-src.tar.gz (benchmarks/llama_cpp_source.py: the pinned llama-cpp-python
#    sdist's vendor/llama.cpp, build + converter only; its sha256 is checked against llama-cpp-src.json);
# 2. in the background: configures (CMake flags in BUILD_FLAGS below: CUDA for sm_90 only, FlashAttention CUDA
#    kernels compiled (GGML_CUDA_FA=ON, llama.cpp's default; llama-bench runs with -fa on), no NCCL, no server /
#    tests / examples, the llama.cpp commit stamped in) and builds llama-bench and llama-quantize on all cores;
# 3. meanwhile: the campaign's synthetic checkpoint (runmap synth: same preset, seed 0, init routing, drawn on
#    the GPU, per-expert layout, as benchmarks/prepare_pack.py makes it for run_h200_campaign.sh), converted by
#    llama.cpp's own convert_hf_to_gguf.py to a bf16 GGUF (benchmarks/llama_cpp_convert.py: the pre-tokenizer
#    check answered "gpt-2", benchmarks/README.md says why); the checkpoint is deleted once converted;
# 4. llama-quantize bf16 -> Q4_K_M (the bf16 GGUF deleted after);
# 5. llama-bench -m Q4_K_M -p 0 -n 128 -b 1 -ub 1 -ngl 99 -fa on -o json: full GPU (--n-cpu-moe 0) and
#    --n-cpu-moe 4 / 8 / 12 / 16 (the pinned llama-bench has -ncmoe / --n-cpu-moe; checked in its --help); batch 8:
#    llama-batched-bench -npp 32 -ntg 128 -npl 8 --output-format jsonl at the same --n-cpu-moe values;
# 6. benchmarks/llama_cpp_records.py: one record per test (schemas/llama-cpp-bench.schema.json).
# Everything lands in $OUT/llama-cpp/: steps.log (every step with its elapsed time), env.txt, logs/, runs/
# (llama-bench's JSON + command), records/; at the end all of it is archived as $OUT/llama-cpp.tar.gz (the
# device tool returns at most 8 files) and only steps.log stays beside it. Each step runs past the failure of an earlier one where it can.
# A machine left warm keeps $WORK (build, GGUF) and a second call reuses them.
# RUNMAP_LLAMA_PRESET, RUNMAP_LLAMA_NCMOE ("0 4 8 12 16"), RUNMAP_LLAMA_BATCHES ("1 8"), RUNMAP_LLAMA_WORK, RUNMAP_LLAMA_SYNTH_DEVICE (cuda),
# RUNMAP_LLAMA_JOBS (build jobs, default all cores), RUNMAP_LLAMA_CONFIGURE_ONLY=1 (configure, build nothing),
# RUNMAP_LLAMA_LIB_ROOTS (more folders to search for nvidia/*/lib) override the defaults (a CPU rehearsal:
# RUNMAP_LLAMA_PRESET=tiny-olmoe RUNMAP_LLAMA_SYNTH_DEVICE=cpu RUNMAP_LLAMA_JOBS=1).
set -uo pipefail
BUDGET=${1:-560}
T0=$(date +%s)
: "${OUT:?set OUT to the directory whose files come back}"
WORK=${RUNMAP_LLAMA_WORK:-/tmp/runmap-llama}
PRESET=${RUNMAP_LLAMA_PRESET:-olmoe-1b-7b-0924}
NCMOE=${RUNMAP_LLAMA_NCMOE:-0 4 8 12 16}
BATCHES=${RUNMAP_LLAMA_BATCHES:-1 8}  # 1: llama-bench tg128; more: llama-batched-bench with that many sequences
SYNTH_DEVICE=${RUNMAP_LLAMA_SYNTH_DEVICE:-cuda}
SEED=0
INIT=routing
QUANT=Q4_K_M
TARBALL=.llama-cpp/llama-cpp-src.tar.gz
META=.llama-cpp/llama-cpp-src.json
R=$OUT/llama-cpp
export PYTHONUNBUFFERED=1
mkdir -p "$WORK" "$R/logs" "$R/runs" "$R/records"
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
log() { echo "[$(elapsed)s] $*" | tee -a "$R/steps.log"; }
NPROC=$(nproc)
JOBS=${RUNMAP_LLAMA_JOBS:-$NPROC}  # build jobs (a CPU rehearsal on a shared machine: 1)

# --- 0. the machine -------------------------------------------------------------------------------------------
log "llama.cpp peer: preset $PRESET, budget ${BUDGET}s, work $WORK, $NPROC cores"
{
  echo "== nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  echo "== lscpu"; lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|Flags)' | cut -c1-300
  echo "== python"; python3 --version 2>&1
  echo "== df"; df -h "$WORK" | tail -1
} > "$R/env.txt" 2>&1
NVCC=""  # the toolkit's own nvcc first (a PATH entry may be a wrapper script)
for c in /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)" $(ls -d /usr/local/cuda-*/bin/nvcc 2>/dev/null | sort -V -r); do
  [ -n "$c" ] && [ -x "$c" ] && { NVCC=$c; break; }
done
CMAKE=$(command -v cmake || true)
CXX_OK=$(command -v c++ || command -v g++ || true)
NINJA=$(command -v ninja || true)
MISSING=()
[ -n "$NVCC" ] && log "nvcc: $NVCC ($("$NVCC" --version | tail -2 | head -1))" || { MISSING+=(nvcc); log "MISSING: nvcc (no CUDA toolkit on PATH or in /usr/local/cuda*): no CUDA build; llama.cpp is built for the CPU only and every record says backends CPU"; }
[ -n "$CMAKE" ] && log "cmake: $CMAKE ($(cmake --version | head -1))" || { MISSING+=(cmake); log "MISSING: cmake: llama.cpp cannot be built; only the conversion runs"; }
[ -n "$CXX_OK" ] && log "c++: $CXX_OK ($("$CXX_OK" --version | head -1))" || { MISSING+=(c++); log "MISSING: a C++ compiler: llama.cpp cannot be built"; }
[ -n "$NINJA" ] && log "ninja: $NINJA" || log "no ninja: CMake's Makefiles instead"
PYMISS=$(python3 - <<'EOF'
import importlib.util
mods = ["torch", "numpy", "transformers", "tokenizers", "safetensors", "yaml", "tqdm", "requests"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
EOF
)
[ -z "$PYMISS" ] && log "python modules for the converter: present" || { MISSING+=("python:$PYMISS"); log "MISSING python modules: $PYMISS (the converter needs them)"; }
FREE_GB=$(df --output=avail -B1G "$WORK" | tail -1 | tr -d ' ')
log "free disk in $WORK: ${FREE_GB} GB (bf16 checkpoint + bf16 GGUF at the conversion's peak: OLMoE-1B-7B ~28, Qwen1.5-MoE-A2.7B ~57)"
if [ "${FREE_GB:-0}" -lt 30 ] && [ ! -f "$WORK/$PRESET-Q4_K_M.gguf" ]; then
  log "WARNING: under 30 GB free: the conversion may run out of disk (a warm machine's campaign packs in /tmp/runmap-h200: $(du -sh /tmp/runmap-h200 2>/dev/null | cut -f1))"
fi

# --- 1. the source --------------------------------------------------------------------------------------------
if [ ! -f "$TARBALL" ] || [ ! -f "$META" ]; then
  log "MISSING: $TARBALL / $META: run python benchmarks/llama_cpp_source.py and carry .llama-cpp"; exit 1
fi
WANT_SHA=$(python3 -c "import json; print(json.load(open('$META'))['sha256'])")
HAVE_SHA=$(sha256sum "$TARBALL" | cut -d' ' -f1)
if [ "$WANT_SHA" != "$HAVE_SHA" ]; then log "tarball sha256 $HAVE_SHA != $WANT_SHA in $META: stop"; exit 1; fi
SRC=$WORK/src-${HAVE_SHA:0:12}/llama.cpp
if [ ! -f "$SRC/RUNMAP_SOURCE.json" ]; then
  rm -rf "$WORK/src-${HAVE_SHA:0:12}"; mkdir -p "$WORK/src-${HAVE_SHA:0:12}"
  tar -xzf "$TARBALL" -C "$WORK/src-${HAVE_SHA:0:12}" || { log "unpacking failed"; exit 1; }
fi
cp "$SRC/RUNMAP_SOURCE.json" "$R/"
COMMIT=$(python3 -c "import json; print(json.load(open('$SRC/RUNMAP_SOURCE.json'))['llama_cpp_commit'])")
log "source: $(python3 -c "import json; d=json.load(open('$SRC/RUNMAP_SOURCE.json')); print(d['package'], d['version'], 'llama.cpp', d['llama_cpp_commit'])") in $SRC"

# --- 2. build (background) ------------------------------------------------------------------------------------
# CMake's FindCUDAToolkit needs libcublas(.so), libcublasLt and the driver's libcuda as unversioned files next
# to the toolkit. An image whose toolkit is assembled from NVIDIA's pip wheels (as on the development machine:
# nvcc, cudart, no cuBLAS) has cuBLAS only in the Python environment's nvidia/*/lib (PyTorch's dependency) and
# libcuda.so.1 only in the driver's folder: find them, link them into $WORK/cuda-shim (unversioned names, the
# cuBLAS headers alone) and name them to CMake. No libcuda: -DGGML_CUDA_NO_VMM=ON (llama.cpp's legacy memory
# pool instead of CUDA virtual memory), said in the flags. No cuBLAS anywhere: a CPU-only build.
if [ -n "$NVCC" ]; then
  CUDA_LIBS=$(python3 - "$NVCC" "$WORK/cuda-shim" <<'EOF'
import glob, os, re, shlex, site, subprocess, sys
nvcc, shim = sys.argv[1], sys.argv[2]
root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
tk = [os.path.join(root, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
dirs = tk + ["/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
             "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/wsl/lib"]
for sp in site.getsitepackages() + sys.path + os.environ.get("RUNMAP_LLAMA_LIB_ROOTS", "").split(":"):
    dirs += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib")))
try:
    dirs += sorted({os.path.dirname(ln.split("=>")[-1].strip()) for ln in
                    subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.splitlines() if "=>" in ln})
except OSError:
    pass
dirs = [d for d in dict.fromkeys(dirs) if d and os.path.isdir(d)]


def find(name):  # (dir, files) of the first folder holding lib<name>.so or lib<name>.so.N
    pat = re.compile(rf"^lib{re.escape(name)}\.so(\.[0-9]+)*$")
    for d in dirs:
        files = sorted(f for f in os.listdir(d) if pat.match(f))
        if files:
            return d, files
    return None, []


out, notes, ld = [], [], []
os.makedirs(os.path.join(shim, "lib"), exist_ok=True)
for name, var in (("cublas", "CUDA_cublas_LIBRARY"), ("cublasLt", "CUDA_cublasLt_LIBRARY"),
                  ("cuda", "CUDA_cuda_driver_LIBRARY")):
    d, files = find(name)
    if d is None:
        notes.append(f"lib{name}.so: not found")
        continue
    for f in files:  # every name, the versioned ones too, so that the build's RPATH finds the soname
        link = os.path.join(shim, "lib", f)
        if not os.path.lexists(link):
            os.symlink(os.path.join(d, f), link)
    unversioned = os.path.join(shim, "lib", f"lib{name}.so")
    if not os.path.lexists(unversioned):
        os.symlink(os.path.join(d, max(files, key=len)), unversioned)
    out.append(f"-D{var}={unversioned}")
    notes.append(f"lib{name}: {d} ({', '.join(files)})")
    if d not in tk:
        ld.append(d)
candidates = [os.path.join(root, "include", "cublas_v2.h")] + [
    os.path.join(os.path.dirname(d), "include", "cublas_v2.h") for d in dirs]
header = next((h for h in candidates if os.path.isfile(h)), None)
if header and os.path.dirname(header) != os.path.join(root, "include"):
    inc = os.path.join(shim, "include")  # the cuBLAS headers alone: no second copy of the toolkit's own
    os.makedirs(inc, exist_ok=True)
    for h in glob.glob(os.path.join(os.path.dirname(header), "cublas*.h")):
        if not os.path.lexists(os.path.join(inc, os.path.basename(h))):
            os.symlink(h, os.path.join(inc, os.path.basename(h)))
    out += [f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]
notes.append(f"cublas_v2.h: {header or 'not found'}")
have_cublas = any(o.startswith("-DCUDA_cublas_LIBRARY") for o in out) and header is not None
if not any(o.startswith("-DCUDA_cuda_driver_LIBRARY") for o in out):
    out.append("-DGGML_CUDA_NO_VMM=ON")
print("CUDA_OK=" + ("1" if have_cublas else "0"))
print("CUDA_CMAKE=" + shlex.quote(" ".join(out)))
print("CUDA_LD=" + shlex.quote(":".join(dict.fromkeys(ld))))
print("CUDA_NOTES=" + shlex.quote("; ".join(notes)))
EOF
)
  eval "$CUDA_LIBS"
  log "CUDA libraries: ${CUDA_NOTES:-none found}"
  [ -n "${CUDA_LD:-}" ] && export LD_LIBRARY_PATH="$CUDA_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [ "${CUDA_OK:-0}" != 1 ]; then
    log "MISSING: cuBLAS (library or cublas_v2.h) in the toolkit, the driver folders and the Python environment: no CUDA build; a CPU-only build, every record says backends CPU"
    MISSING+=(cublas)
    NVCC=""
  fi
fi
if [ -n "$NVCC" ]; then
  BUILD_FLAGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA=ON -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NCCL=OFF"
  BUILD_FLAGS="$BUILD_FLAGS -DCMAKE_CUDA_COMPILER=$NVCC $CUDA_CMAKE"
  NGL=99
else
  BUILD_FLAGS="-DGGML_CUDA=OFF"
  NGL=0
fi
BUILD_FLAGS="$BUILD_FLAGS -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMIT=${COMMIT:0:7}"
BUILD=$WORK/build-${HAVE_SHA:0:12}-$([ -n "$NVCC" ] && echo cuda || echo cpu)
BENCH_BIN=$BUILD/bin/llama-bench
QUANT_BIN=$BUILD/bin/llama-quantize
BATCHED_BIN=$BUILD/bin/llama-batched-bench
echo "$BUILD_FLAGS" > "$R/build-flags.txt"
BPID=""
if [ -x "$BENCH_BIN" ] && [ -x "$QUANT_BIN" ] && [ -x "$BATCHED_BIN" ] && [ "$(cat "$BUILD/runmap-build-flags.txt" 2>/dev/null)" = "$BUILD_FLAGS" ]; then
  log "build: reusing $BUILD (a warm machine, the same flags)"
elif [ -n "$CMAKE" ] && [ -n "$CXX_OK" ]; then
  log "build: configure + llama-bench, llama-batched-bench, llama-quantize with -j$JOBS in the background; flags: $BUILD_FLAGS"
  # a cold build beside the checkpoint's conversion reached 233 of 293 steps in the 278 s a budget of 420 left it
  # (2026-12-06, results/campaigns/h100-auto-sites-b1-probe); the budgets of 470 that built it left ~330
  if [ $(( $(left) - 140 )) -lt 350 ]; then
    log "WARNING: the build gets $(( $(left) - 140 ))s of this budget; a cold build beside the conversion needs ~350s:" \
        "expect it to be cut (give a budget of 500 or more on a cold machine)"
  fi
  rm -f "$BENCH_BIN" "$QUANT_BIN" "$BATCHED_BIN" "$BUILD/runmap-build-flags.txt"  # a failed build leaves no older binary behind
  (
    B0=$(date +%s)
    # shellcheck disable=SC2086
    cmake -S "$SRC" -B "$BUILD" ${NINJA:+-G Ninja} $BUILD_FLAGS > "$R/logs/configure.log" 2>&1 \
      || { echo "configure failed (exit $?)"; exit 2; }
    echo "configure $(( $(date +%s) - B0 ))s"
    [ -n "${RUNMAP_LLAMA_CONFIGURE_ONLY:-}" ] && { echo "RUNMAP_LLAMA_CONFIGURE_ONLY: not built"; exit 4; }
    # what is left after the build: quantize (~45-50 s on 16 cores) and the ten rows (~40 s, each started only while
    # 45 s are left, so ~85 s)
    timeout $(( $(left) - 140 > 60 ? $(left) - 140 : 60 )) \
      cmake --build "$BUILD" --target llama-bench llama-quantize llama-batched-bench -j "$JOBS" > "$R/logs/build.log" 2>&1 \
      || { echo "build failed or timed out (exit $?)"; exit 3; }
    echo "$BUILD_FLAGS" > "$BUILD/runmap-build-flags.txt"
    echo "configure + build $(( $(date +%s) - B0 ))s"
  ) > "$R/logs/build-summary.log" 2>&1 &
  BPID=$!
else
  log "build: skipped (missing ${MISSING[*]})"
fi

# --- 3. checkpoint and conversion (meanwhile) -----------------------------------------------------------------
Q4=$WORK/$PRESET-$QUANT.gguf
BF16=$WORK/$PRESET-bf16.gguf
CK=$WORK/ck-$PRESET
STAMP="$PRESET seed $SEED init $INIT synth $SYNTH_DEVICE source ${HAVE_SHA:0:12}"
if [ -f "$Q4" ] && [ "$(cat "$Q4.stamp" 2>/dev/null)" = "$STAMP" ]; then
  log "GGUF: reusing $Q4 ($STAMP)"
else
  rm -f "$Q4" "$Q4.stamp"
  if [ ! -f "$BF16" ] || [ "$(cat "$BF16.stamp" 2>/dev/null)" != "$STAMP" ]; then
    rm -f "$BF16" "$BF16.stamp"
    log "synth: runmap synth $CK --preset $PRESET --seed $SEED --init $INIT --device $SYNTH_DEVICE"
    if PYTHONPATH=. timeout $(( $(left) - 200 > 30 ? $(left) - 200 : 30 )) python3 -m runmap synth "$CK" \
        --preset "$PRESET" --seed "$SEED" --init "$INIT" --device "$SYNTH_DEVICE" --force --no-progress \
        > "$R/logs/synth.log" 2>&1; then
      log "synth done: $(tail -1 "$R/logs/synth.log"); $(du -sh "$CK" | cut -f1)"
      log "convert: llama.cpp convert_hf_to_gguf.py --outtype bf16 (pre-tokenizer check answered by benchmarks/llama_cpp_convert.py)"
      if PYTHONPATH="$SRC:." timeout $(( $(left) - 150 > 30 ? $(left) - 150 : 30 )) python3 benchmarks/llama_cpp_convert.py \
          "$CK" --outtype bf16 --outfile "$BF16" > "$R/logs/convert.log" 2>&1; then
        echo "$STAMP" > "$BF16.stamp"
        log "convert done: $(du -h "$BF16" | cut -f1); $(grep -m1 'pre-tokenizer answer' "$R/logs/convert.log"); $(grep -m1 'chkhsh' "$R/logs/convert.log" | sed 's/.*chkhsh/unknown chkhsh/')"
      else
        log "convert FAILED (exit $?): $(tail -3 "$R/logs/convert.log" | tr '\n' ' ')"
        rm -f "$BF16"
      fi
      rm -rf "$CK"
    else
      log "synth FAILED (exit $?): $(tail -3 "$R/logs/synth.log" | tr '\n' ' ')"
    fi
  else
    log "bf16 GGUF: reusing $BF16"
  fi
fi

if [ -n "$BPID" ]; then
  log "waiting for the build"
  wait "$BPID"; BRC=$?
  log "build exit $BRC: $(tr '\n' ';' < "$R/logs/build-summary.log")"
  [ "$BRC" = 0 ] || tail -20 "$R/logs/build.log" "$R/logs/configure.log" 2>/dev/null | tee -a "$R/steps.log"
  grep -E 'CUDA Toolkit found|Using CMAKE_CUDA_ARCHITECTURES|CUDA_ARCH|ggml version|llama.cpp version' "$R/logs/configure.log" 2>/dev/null | tee -a "$R/steps.log"
fi

# --- 4. quantize ------------------------------------------------------------------------------------------------
if [ ! -f "$Q4" ] && [ -f "$BF16" ] && [ -x "$QUANT_BIN" ]; then
  log "quantize: llama-quantize bf16 -> $QUANT with $NPROC threads"
  if timeout $(( $(left) - 90 > 30 ? $(left) - 90 : 30 )) "$QUANT_BIN" "$BF16" "$Q4" "$QUANT" "$NPROC" > "$R/logs/quantize.log" 2>&1; then
    echo "$STAMP" > "$Q4.stamp"
    log "quantize done: $(du -h "$Q4" | cut -f1) ($(stat -c %s "$Q4") bytes); $(grep -E 'model size|quant size' "$R/logs/quantize.log" | tr '\n' ' ')"
    rm -f "$BF16" "$BF16.stamp"
  else
    log "quantize FAILED (exit $?): $(tail -3 "$R/logs/quantize.log" | tr '\n' ' ')"; rm -f "$Q4"
  fi
fi

# --- 5. llama-bench ---------------------------------------------------------------------------------------------
if [ -x "$BENCH_BIN" ] && [ -f "$Q4" ]; then
  "$BENCH_BIN" --help > "$R/logs/llama-bench-help.txt" 2>&1
  HAVE_NCMOE=$(grep -c -- '--n-cpu-moe' "$R/logs/llama-bench-help.txt")
  [ "$HAVE_NCMOE" -gt 0 ] && log "llama-bench has --n-cpu-moe" \
    || log "llama-bench --help has no --n-cpu-moe: only the full-GPU row runs (the pinned source has it: check the build)"
  for n in $NCMOE; do
    if [ "$n" != 0 ] && [ "$HAVE_NCMOE" = 0 ]; then continue; fi
    if [ "$(left)" -lt 45 ]; then log "ncmoe $n: skipped (${BUDGET}s budget: $(left)s left)"; continue; fi
    CMD="$BENCH_BIN -m $Q4 -p 0 -n 128 -b 1 -ub 1 -ngl $NGL -fa on"
    [ "$n" != 0 ] && CMD="$CMD -ncmoe $n"
    CMD="$CMD -o json"
    echo "$CMD" > "$R/runs/ncmoe-$n.cmd"
    # shellcheck disable=SC2086
    timeout $(( $(left) - 30 < 150 ? $(left) - 30 : 150 )) $CMD > "$R/runs/ncmoe-$n.json" 2> "$R/logs/llama-bench-ncmoe-$n.log"
    RC=$?
    TS=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(' '.join(f\"{t['avg_ts']:.1f}+-{t['stddev_ts']:.1f}\" for t in r))" "$R/runs/ncmoe-$n.json" 2>/dev/null)
    log "llama-bench ncmoe $n: exit $RC, tok/s ${TS:-none}"
    [ "$RC" = 0 ] || tail -5 "$R/logs/llama-bench-ncmoe-$n.log" | tee -a "$R/steps.log"
  done
  # several sequences at once: llama-batched-bench (prompt of PP tokens per sequence, then TG steps of all)
  for pl in $BATCHES; do
    [ "$pl" = 1 ] && continue  # batch 1 is llama-bench's tg test above
    [ -x "$BATCHED_BIN" ] || { log "llama-batched-bench: missing, batch $pl not run"; break; }
    for n in $NCMOE; do
      if [ "$(left)" -lt 45 ]; then log "batch $pl ncmoe $n: skipped (${BUDGET}s budget: $(left)s left)"; continue; fi
      CMD="$BATCHED_BIN -m $Q4 -c 4096 -b 512 -ub 512 -npp 32 -ntg 128 -npl $pl -ngl $NGL -fa on"
      [ "$n" != 0 ] && CMD="$CMD -ncmoe $n"
      CMD="$CMD --output-format jsonl"
      echo "$CMD" > "$R/runs/batched$pl-ncmoe-$n.cmd"
      # shellcheck disable=SC2086
      timeout $(( $(left) - 30 < 150 ? $(left) - 30 : 150 )) $CMD > "$R/runs/batched$pl-ncmoe-$n.jsonl" 2> "$R/logs/batched$pl-ncmoe-$n.log"
      RC=$?
      TS=$(grep -h '"speed_tg"' "$R/runs/batched$pl-ncmoe-$n.jsonl" "$R/logs/batched$pl-ncmoe-$n.log" 2>/dev/null | python3 -c "import json,sys; print(' '.join(f\"{json.loads(l)['speed_tg']:.1f}\" for l in sys.stdin))" 2>/dev/null)
      # the result line is llama.cpp's LOG(): stdout, but keep it wherever it went
      grep -qh '"speed_tg"' "$R/runs/batched$pl-ncmoe-$n.jsonl" || grep -h '"speed_tg"' "$R/logs/batched$pl-ncmoe-$n.log" >> "$R/runs/batched$pl-ncmoe-$n.jsonl"
      log "llama-batched-bench batch $pl ncmoe $n: exit $RC, tok/s ${TS:-none}"
      [ "$RC" = 0 ] || tail -5 "$R/logs/batched$pl-ncmoe-$n.log" | tee -a "$R/steps.log"
    done
  done
else
  log "llama-bench: not run (binary $([ -x "$BENCH_BIN" ] && echo present || echo missing), GGUF $([ -f "$Q4" ] && echo present || echo missing))"
fi

# --- 6. records -------------------------------------------------------------------------------------------------
RUNS=$(ls "$R"/runs/ncmoe-*.json "$R"/runs/batched*-ncmoe-*.jsonl 2>/dev/null)
if [ -n "$RUNS" ]; then
  # shellcheck disable=SC2086
  PYTHONPATH=. python3 benchmarks/llama_cpp_records.py --preset "$PRESET" --seed "$SEED" --init "$INIT" --gguf "$Q4" \
    --quant "$QUANT" --converted-from "bf16 GGUF (convert_hf_to_gguf.py --outtype bf16 of the bf16 checkpoint)" \
    --source "$SRC/RUNMAP_SOURCE.json" --build-flags="$BUILD_FLAGS" --out-dir "$R/records" $RUNS 2>&1 | tee -a "$R/steps.log"
fi
log "end ($(ls "$R"/records/*.json 2>/dev/null | wc -l) records; missing: ${MISSING[*]:-nothing})"
# The device tool brings back at most 8 files from $OUT: everything in one archive, the timeline beside it.
tar -czf "$OUT/llama-cpp.tar.gz" -C "$OUT" llama-cpp && find "$R" -mindepth 1 ! -name steps.log -delete
