"""Synthesize a qpack directly, without a checkpoint: speed runs at real dimensions (issue 19, item 3).

A bf16 checkpoint of Mixtral-8x7B is ~93 GB and packing it takes longer than one device call; the pack's
*speed* depends on shapes and on routing, not on the values of the experts. ``write_direct_pack`` writes a
pack of the same format (``runmap-qpack`` v2, same manifest schema, same files, every size and sha256
recorded, the per-expert row sha256 the host source verifies) whose values are drawn, not quantized:

* routed experts: every weight byte is random with both nibbles forced odd (``| 0x11``), i.e. codes
  q in {-7, -5, ..., 5, 7}, all inside the quantization rule's [-7, 7] (a raw random nibble 0 would be
  q = -8, which no packer writes); every FP16 scale is ``EXPERT_STD / sqrt(E[q^2])`` times a uniform jitter
  in [1 - SCALE_JITTER, 1 + SCALE_JITTER], so dequantized weights have the standard deviation of the
  synthetic checkpoints' experts (runmap.synth.checkpoint.WEIGHT_STD) and activations stay finite;
* non-routed tensors: FP16, uniform with the checkpoints' standard deviation (norms around 1), drawn from
  random 16-bit integers (a uniform draw from raw bits is several times cheaper than a normal one);
* config.json, generation_config.json and the synthetic tokenizer as ``runmap synth`` writes them.

Labelled: the manifest has a top-level ``synthesized`` object (kind ``direct-pack``), its ``source`` names no
checkpoint and no files, and every layer's ``source_layout`` is ``synthesized-direct`` with no
``quant_error`` (nothing was quantized, so no error exists to record). ``runmap bench`` copies the label into
every record built on such a pack.

Speed: values come from numpy's SFC64 generator in whole-layer arrays (no per-element Python); layers are
generated, hashed and written by a pool of threads (numpy, hashlib and file writes release the GIL), at most
``workers`` layers in memory at once, so peak memory is about ``workers`` x one layer whatever the model size.
Every array is seeded from sha256(seed, what it is), so the bytes depend on the seed only, not on the
number of threads or their order. Atomic like ``runmap pack``: a hidden temporary directory, manifest last,
one rename.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import math
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import runmap
from runmap.arch.config import ModelConfig
from runmap.atomic import remove_stale_temporaries
from runmap.format.pack import EXPERT_FILE_ALIGN, check_output, peak_rss_bytes, publish_pack
from runmap.format.packfile import EXPERTS_TENSOR, FORMAT_NAME, FORMAT_VERSION, MANIFEST, NONROUTED_FILE, file_sha256, \
    layer_file
from runmap.format.qpack import DEFAULT_BLOCK_SIZE, PROJECTIONS, QUANT_RULE, RowLayout
from runmap.format.safetensors_io import StreamingWriter
from runmap.provenance import utc_timestamp
from runmap.synth.checkpoint import NORM_STD, WEIGHT_STD
from runmap.synth.tokenizer import write_tokenizer

DIRECT_KIND = "direct-pack"
DIRECT_LAYOUT = "synthesized-direct"  # layers[].source_layout and source.expert_layouts of such a pack
EXPERT_STD = WEIGHT_STD
CODE_MASK = 0x11  # forces both nibbles of a byte odd: stored 1..15 odd, q = stored - 8 in {-7, -5, ..., 7}
CODE_RMS = math.sqrt(sum(q * q for q in range(-7, 8, 2)) / 8)  # sqrt(E[q^2]) of those codes = sqrt(21)
SCALE_JITTER = 0.15
# non-routed values per drawn chunk: the chunks of one tensor are drawn in parallel, so a chunk is small enough
# that one attention projection (Mixtral's q_proj: 16.8 M values) keeps every worker busy
CHUNK_VALUES = 1 << 20
NOTE = ("synthesized directly for speed runs: random INT4 codes and FP16 scales, random FP16 non-routed weights; "
        "no checkpoint was packed, outputs are not any model's")


def _rng(seed: int, key: str) -> np.random.SFC64:
    """The bit generator of one array, from (seed, key) only."""
    return np.random.SFC64(int.from_bytes(hashlib.sha256(f"direct:{seed}:{key}".encode()).digest()[:16], "little"))


def _random_bytes(bits: np.random.SFC64, nbytes: int) -> np.ndarray:
    """uint8 (nbytes,) of raw generator output (64 bits per draw; nbytes is rounded up to whole draws)."""
    return bits.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]


def _uniform_fp16(out: np.ndarray, seed: int, key: str, mean: float, std: float) -> None:
    """Fill float16 ``out`` (1-D) with mean + U(-a, a), a = std * sqrt(3), from random int16."""
    raw = _random_bytes(_rng(seed, key), 2 * out.size).view(np.int16)
    vals = raw.astype(np.float32)
    vals *= np.float32(std * math.sqrt(3) / 32768.0)
    if mean:
        vals += np.float32(mean)
    out[:] = vals


def expert_scale() -> float:
    """The scale that gives dequantized experts the standard deviation EXPERT_STD with the codes drawn here."""
    return EXPERT_STD / CODE_RMS


def synth_layer_rows(layout: RowLayout, num_experts: int, seed: int, layer: int) -> np.ndarray:
    """uint8 (E, row_bytes) of one layer: random odd codes, jittered scales, zero padding."""
    bits = _rng(seed, f"layer-{layer}")
    rows = _random_bytes(bits, num_experts * layout.row_bytes).reshape(num_experts, layout.row_bytes)
    base = expert_scale()
    for proj in PROJECTIONS:
        w, s = layout.section(f"{proj}.weight"), layout.section(f"{proj}.scale")
        codes = rows[:, w.offset:w.offset + w.nbytes]
        np.bitwise_or(codes, CODE_MASK, out=codes)
        n_scales = s.nbytes // 2
        jitter = np.random.Generator(_rng(seed, f"layer-{layer}-{proj}-scale")).random(
            (num_experts, n_scales), dtype=np.float32)
        scales = (np.float32(base * (1 - SCALE_JITTER)) + jitter * np.float32(2 * base * SCALE_JITTER)).astype(np.float16)
        rows[:, s.offset:s.offset + s.nbytes] = scales.view(np.uint8)
    end = 0
    for sec in sorted(layout.sections, key=lambda x: x.offset):  # alignment padding is zero in packed rows too
        rows[:, end:sec.offset] = 0
        end = sec.offset + sec.nbytes
    rows[:, end:] = 0
    return rows


def _write_layer(tmp: Path, layout: RowLayout, num_experts: int, seed: int, layer: int) -> tuple[dict, tuple[int, str], float]:
    """Generate, hash and write one layer's expert file. Returns (manifest layer entry, (bytes, sha256), seconds)."""
    t = time.perf_counter()
    rows = synth_layer_rows(layout, num_experts, seed, layer)
    hashes = [hashlib.sha256(memoryview(rows[e])).hexdigest() for e in range(num_experts)]
    fname = layer_file(layer)
    w = StreamingWriter(tmp / fname, [(EXPERTS_TENSOR, torch.uint8, rows.shape)],
                        {"format": "pt", "runmap": "qpack-experts", "layer": str(layer), "runmap_synthesized": DIRECT_KIND},
                        align=EXPERT_FILE_ALIGN)
    try:
        w.write(EXPERTS_TENSOR, torch.from_numpy(rows))
        # no fsync per layer: the kernel writes back while later layers are drawn; the manifest (fsync'd, last)
        # records every file's sha256, so a file the disk lost is found by PackReader / runmap validate
        w.close(fsync=False)
    except BaseException:
        w.abort()
        raise
    # the file's digest from the header just written and the rows in memory: no second read of the data
    with open(tmp / fname, "rb") as f:
        head = f.read(w.data_start)
    h = hashlib.sha256(head)
    h.update(memoryview(rows.reshape(-1)))
    entry = {"layer": layer, "file": fname, "tensor": EXPERTS_TENSOR, "offset": w.offsets[EXPERTS_TENSOR],
             "row_bytes": layout.row_bytes, "num_experts": num_experts, "nbytes": num_experts * layout.row_bytes,
             "file_bytes": w.total_bytes, "source_layout": DIRECT_LAYOUT, "expert_sha256": hashes}
    return entry, (w.total_bytes, h.hexdigest()), time.perf_counter() - t


def _nonrouted_stats(name: str) -> tuple[float, float]:
    """(mean, std) of a non-routed tensor, as runmap.synth.checkpoint draws it."""
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0, NORM_STD
    return 0.0, WEIGHT_STD


def write_direct_pack(cfg: ModelConfig, out_dir: str | Path, *, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                      workers: int | None = None, overwrite: bool = False, preset: str | None = None,
                      progress: bool = False) -> Path:
    """Write a synthesized-direct pack of ``cfg`` to ``out_dir`` (module docstring). Returns out_dir.

    Raises PackError (existing output, see runmap.format.pack.check_output), QPackError (bad block size),
    UnsupportedLayerError (a dense layer). Nothing is left at ``out_dir`` on any failure."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    check_output(out, overwrite)
    cfg.adapter.require_routed_layers(cfg, f"{out}: runmap synth --direct-pack")
    layout = RowLayout.build(cfg.hidden_size, cfg.moe_intermediate_size, block_size)
    workers = max(1, workers or min(16, os.cpu_count() or 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out, ".tmp-")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    pool = cf.ThreadPoolExecutor(max_workers=workers)
    try:
        timing = {}
        t = time.perf_counter()
        shapes = cfg.adapter.nonrouted_tensors(cfg)
        names = list(shapes)
        w = StreamingWriter(tmp / NONROUTED_FILE, [(n, torch.float16, shapes[n]) for n in names],
                            {"format": "pt", "runmap": "nonrouted-fp16", "runmap_synthesized": DIRECT_KIND})
        try:
            for n in names:
                buf = np.empty(int(np.prod(shapes[n])), dtype=np.float16)
                mean, std = _nonrouted_stats(n)
                jobs = [pool.submit(_uniform_fp16, buf[i:i + CHUNK_VALUES], seed, f"{n}:{i // CHUNK_VALUES}", mean, std)
                        for i in range(0, buf.size, CHUNK_VALUES)]
                for j in jobs:
                    j.result()
                w.write(n, torch.from_numpy(buf).view(shapes[n]))
                del buf
            w.close()
        except BaseException:
            w.abort()
            raise
        file_hashes = {NONROUTED_FILE: pool.submit(file_sha256, tmp / NONROUTED_FILE)}
        timing["nonrouted_s"] = time.perf_counter() - t

        # small files first, so the layer pool below has the threads to itself
        (tmp / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), "runmap_synthetic": {
            "seed": seed, "kind": DIRECT_KIND}}, indent=2) + "\n")
        gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id),
                                 ("pad_token_id", cfg.pad_token_id)) if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        write_tokenizer(cfg, tmp)
        copied = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != NONROUTED_FILE)
        for fname in copied:
            file_hashes[fname] = pool.submit(file_sha256, tmp / fname)

        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.num_layers, desc=f"synth pack {out.name}", unit="layer")
        layers, layer_s = [None] * cfg.num_layers, [0.0] * cfg.num_layers
        jobs = {pool.submit(_write_layer, tmp, layout, cfg.num_experts, seed, l): l for l in range(cfg.num_layers)}
        for job in cf.as_completed(jobs):
            l = jobs[job]
            entry, (nbytes, digest), secs = job.result()
            layers[l], layer_s[l] = entry, secs
            file_hashes[entry["file"]] = (nbytes, digest)
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        timing["layers_s"] = layer_s
        files = []
        for fname in sorted(file_hashes):
            v = file_hashes[fname]
            nbytes, digest = v if isinstance(v, tuple) else v.result()
            files.append({"file": fname, "bytes": nbytes, "sha256": digest})
        timing["total_s"] = time.perf_counter() - t0
        total_bytes = sum(f["bytes"] for f in files)
        timing["write_gb_s"] = total_bytes / timing["total_s"] / 1e9
        manifest = {
            "format": {"name": FORMAT_NAME, "version": FORMAT_VERSION},
            "tool": {"name": "horizon-runmap", "version": runmap.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
            "created_utc": utc_timestamp(),
            "synthesized": {
                "kind": DIRECT_KIND, "seed": seed, "preset": preset, "generator": "numpy SFC64",
                "expert_codes": "uniform random bytes | 0x11: q in {-7, -5, ..., 7}",
                "expert_scales": f"{expert_scale():.6g} x U[{1 - SCALE_JITTER}, {1 + SCALE_JITTER}] (dequantized std "
                                 f"{EXPERT_STD})",
                "nonrouted": f"uniform, std {WEIGHT_STD} (norms 1 +- std {NORM_STD})",
                "note": NOTE,
            },
            "source": {"path": "(none: synthesized directly, no checkpoint)", "architecture": cfg.hf_architecture,
                       "expert_layouts": [DIRECT_LAYOUT], "files": []},
            "model": cfg.to_manifest_dict(),
            "quant_rule": QUANT_RULE,
            "block_size": block_size,
            "row_layout": layout.to_dict(),
            "nonrouted": {"file": NONROUTED_FILE, "dtype": "float16", "tensors": names,
                          "file_bytes": (tmp / NONROUTED_FILE).stat().st_size},
            "layers": layers,
            "copied_files": copied,
            "files": files,
            "compute_device": "cpu",
            "timing": timing,
            "memory": {"peak_rss_bytes": peak_rss_bytes(), "largest_layer_source_bytes": 0,
                       "largest_layer_packed_bytes": cfg.num_experts * layout.row_bytes},
        }
        publish_pack(tmp, out, manifest)
    except BaseException:
        # stop the workers first: a layer job still running would otherwise write into the folder being removed
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return out


def weights_label(pack_dir: str | Path) -> str:
    """What a record says a pack's weights are: "synthesized-direct pack (seed N)" (never mistaken for a packed
    checkpoint) or "packed checkpoint"."""
    label = synthesized_label(pack_dir)
    return "packed checkpoint" if label is None else f"synthesized-direct pack (seed {label.get('seed')})"


def synthesized_label(pack_dir: str | Path) -> dict | None:
    """The manifest's ``synthesized`` object of a pack (None for a pack of a checkpoint, or an unreadable one)."""
    try:
        m = json.loads((Path(pack_dir) / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    s = m.get("synthesized") if isinstance(m, dict) else None
    return s if isinstance(s, dict) else None
