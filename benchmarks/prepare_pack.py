"""Build a synthetic checkpoint at a preset's real dimensions (seed 0) and pack it, on the GPU machine; the
checkpoint is deleted once packed. A pack already present is kept. INIT is runmap synth's --init (hf, the
default, or routing: docs/routing-workloads.md); it is printed, so the log says which checkpoint was packed.

    PYTHONPATH=. python3 benchmarks/prepare_pack.py NAME PRESET WORK [DEVICE [INIT]]   # -> WORK/pk-NAME
"""
import shutil
import sys
import time
from pathlib import Path

from runmap.arch.config import load_preset
from runmap.format.pack import pack_checkpoint
from runmap.synth.checkpoint import write_synthetic

if len(sys.argv) not in (4, 5, 6):
    sys.exit(__doc__)
name, preset, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
dev = sys.argv[4] if len(sys.argv) >= 5 else "cuda"
init = sys.argv[5] if len(sys.argv) == 6 else "hf"
ck, pk = work / f"ck-{name}", work / f"pk-{name}"
t0 = time.perf_counter()
if not (pk / "manifest.json").is_file():
    write_synthetic(load_preset(preset)[0], ck, seed=0, device=dev, overwrite=True, init=init)
    t1 = time.perf_counter()
    pack_checkpoint(ck, pk, device=dev, overwrite=True)
    shutil.rmtree(ck)
    print(f"{name}: synth (init {init}) {t1 - t0:.1f} s, pack {time.perf_counter() - t1:.1f} s", flush=True)
else:
    print(f"{name}: pack already present", flush=True)
