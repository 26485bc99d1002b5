"""Measure `runmap pack` on a synthetic checkpoint with real model dimensions: wall time and peak RSS.

Usage (H200 machine, repo root; no jsonschema there, none imported here):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/measure_pack.py --preset olmoe-1b-7b-0924 \
        --synth-device cuda --pack-device cuda --out $OUT/h200-olmoe-1b-7b.json

Steps, each in its own child process so each peak RSS (VmHWM) is that step's alone:
  1. synth: write the synthetic BF16 checkpoint (per-expert layout, 2 GiB shards) to --workdir.
  2. pack:  pack it with ``runmap.format.pack.pack_checkpoint`` on --pack-device.
  3. check: open the pack with PackReader, verify every layer's per-expert sha256, and compare layer 0
            expert 0 with a CPU ``RowLayout.pack_expert`` of the source weights (byte equality); pack
            a tiny preset on cpu and on --pack-device and compare every output tensor byte for byte.
``--layers N`` truncates the model (for a CPU dry run); the JSON records it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _vmhwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def _cfg(preset: str, layers: int | None):
    from runmap.arch.config import load_preset

    cfg, _ = load_preset(preset)
    return dataclasses.replace(cfg, num_layers=layers) if layers else cfg


def child_synth(a) -> dict:
    from runmap.synth.checkpoint import write_synthetic

    t = time.perf_counter()
    write_synthetic(_cfg(a.preset, a.layers), a.ckpt, seed=0, device=a.synth_device, overwrite=True)
    return {"wall_s": time.perf_counter() - t, "peak_rss_bytes": _vmhwm()}


def child_pack(a) -> dict:
    from runmap.format.pack import pack_checkpoint

    t = time.perf_counter()
    pack_checkpoint(a.ckpt, a.pack, device=a.pack_device, overwrite=True)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "peak_rss_bytes": _vmhwm()}


def child_check(a) -> dict:
    import torch

    from runmap.format.checkpoint import CheckpointReader
    from runmap.format.pack import pack_checkpoint
    from runmap.format.packfile import PackReader
    from runmap.synth.checkpoint import write_synthetic

    out = {}
    t = time.perf_counter()
    with PackReader(a.pack) as r:
        for layer in range(r.num_layers):
            r.verify_expert_hashes(layer, r.read_expert_rows(layer))
        out["hash_verify_s"] = time.perf_counter() - t
        out["pack_bytes_read"] = r.bytes_read
        rows0 = r.read_expert_rows(0)
        ref = r.layout.pack_expert(CheckpointReader(a.ckpt).expert_weights(0, 0))
        out["layer0_expert0_equals_cpu_reference"] = bool(torch.equal(rows0[0], ref))
    tiny = Path(a.workdir) / "tiny"
    ck = write_synthetic(_cfg("tiny-qwen2-moe", None), tiny / "ck", seed=1, overwrite=True)
    p_cpu = pack_checkpoint(ck, tiny / "cpu", device="cpu", overwrite=True)
    p_dev = pack_checkpoint(ck, tiny / "dev", device=a.pack_device, overwrite=True)
    same = all((p_cpu / f.name).read_bytes() == f.read_bytes() for f in p_dev.glob("*.safetensors"))
    out["tiny_pack_cpu_equals_device_bytes"] = same
    return out


def _run_child(step: str, a) -> dict:
    cmd = [sys.executable, __file__, "--child", step] + [x for x in a.passthrough]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(p.stderr[-3000:])
    if p.returncode != 0:
        raise SystemExit(f"{step} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    res["process_wall_s"] = time.perf_counter() - t  # includes interpreter start, imports, CUDA init
    return res


def _fs_type(path: Path) -> str:
    """Filesystem type of the mount holding path (from /proc/mounts), e.g. ext4 or tmpfs."""
    best, fs = "", "unknown"
    p = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, typ, *_ = line.split()
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fs = mnt, typ
    except OSError:
        pass
    return f"{fs} ({best})"


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="olmoe-1b-7b-0924")
    ap.add_argument("--layers", type=int, default=None, help="truncate to N layers (dry runs)")
    ap.add_argument("--synth-device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--pack-device", default="cuda", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--workdir", default=os.environ.get("RUNMAP_MEASURE_DIR", "/tmp/runmap-measure"))
    ap.add_argument("--out", default=None, help="result JSON path")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and pack")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.ckpt, a.pack = str(Path(a.workdir) / "ckpt"), str(Path(a.workdir) / "pack")
    if a.child:
        res = {"synth": child_synth, "pack": child_pack, "check": child_check}[a.child](a)
        print("RESULT " + json.dumps(res))
        return 0
    a.passthrough = [x for x in sys.argv[1:] if x != "--keep"]
    a.passthrough = _strip(a.passthrough, "--out")
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    disk_free = shutil.disk_usage(a.workdir).free

    import torch  # after the children's argv is built; only for device facts

    from runmap.provenance import utc_timestamp

    rec = {
        "kind": "runmap-pack-measurement",
        "command": "PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/measure_pack.py " + " ".join(sys.argv[1:]),
        "created_utc": utc_timestamp(),
        "preset": a.preset, "layers_override": a.layers,
        "synth_device": a.synth_device, "pack_device": a.pack_device,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
        "disk_free_bytes_before": disk_free,
    }
    rec["workdir_fs"] = _fs_type(Path(a.workdir))

    def save():  # after every step, so a timeout still leaves what was measured
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(rec, indent=2) + "\n")

    save()
    rec["synth"] = _run_child("synth", a)
    save()
    rec["checkpoint_bytes"] = _du(Path(a.ckpt))
    rec["pack"] = _run_child("pack", a)
    rec["pack_dir_bytes"] = _du(Path(a.pack))
    m = json.loads((Path(a.pack) / "manifest.json").read_text())
    rec["manifest_timing"] = m["timing"]
    rec["manifest_memory"] = m["memory"]
    rec["compute_device"] = m["compute_device"]
    rec["max_rel_fro_error"] = max(max(v["rel_fro"]) for l in m["layers"] for v in l["quant_error"].values())
    save()
    rec["check"] = _run_child("check", a)
    rec["notes"] = ("pack peak_rss_bytes is VmHWM of the packing process (includes the CUDA context); "
                    "compare with manifest_memory.largest_layer_source_bytes (BF16 experts of one layer). "
                    "The checkpoint was just written, so its files were likely in the page cache when packed.")
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)
    save()
    gb = 1e9
    print(f"{'step':8} {'wall_s':>8} {'proc_s':>8} {'peakRSS_GB':>10}")
    for step in ("synth", "pack"):
        r = rec[step]
        print(f"{step:8} {r['wall_s']:8.1f} {r['process_wall_s']:8.1f} {r['peak_rss_bytes'] / gb:10.2f}")
    print(f"checkpoint {rec['checkpoint_bytes'] / gb:.2f} GB -> pack {rec['pack_dir_bytes'] / gb:.2f} GB; "
          f"largest layer (BF16 experts) {m['memory']['largest_layer_source_bytes'] / gb:.2f} GB; "
          f"max rel err {rec['max_rel_fro_error']:.4f}; checks {rec['check']}")
    return 0


def _strip(argv: list[str], opt: str) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x == opt:
            skip = True
            continue
        if x.startswith(opt + "="):
            continue
        out.append(x)
    return out


if __name__ == "__main__":
    sys.exit(main())
