"""Pack a local HF MoE checkpoint into the qpack format (docs/architecture.md#the-qpack-format).

Pack directory layout (format ``runmap-qpack`` v2)::

    OUT_DIR/
      manifest.json                    schemas/manifest.schema.json; written last (the completion marker):
                                       records size + sha256 of every other file ("files")
      nonrouted.safetensors            every non-routed tensor, FP16, under its HF name
      experts-layer-000.safetensors    one tensor "experts": uint8 (E, row_bytes), one qpacked row per expert
      ...                              (data section page-aligned; absolute byte offset in the manifest)
      config.json, generation_config.json, tokenizer.json, tokenizer_config.json, ...  (copied if present)

Routed experts: per layer, the gate/up/down weights of all experts are quantized together on the
chosen device (``runmap.format.qpack.quantize`` on a (E*N, K) view; per-row blocks make that identical to
quantizing each expert alone) and scattered into ``RowLayout`` rows. Everything else is converted
BF16 -> FP16 after a finite / FP16-range check.

Streaming: one non-routed tensor at a time, then per layer one projection of all experts at a time
(quantized in chunks of ``CHUNK_VALUES``); peak host memory is about one layer of source experts,
whatever the model size. Atomic: everything is written into ``.OUT_DIR.tmp-PID-XXXX`` in the same parent
directory (dot-prefixed), manifest last, then renamed to OUT_DIR; on any error or interrupt the temporary
directory is removed. A killed process leaves only that dir (``runmap validate`` reports it as a half-written
pack); the next pack of the same OUT_DIR removes such leftovers whose process is gone. ``overwrite`` only
ever replaces a directory that is a pack (a manifest.json naming the format): a regular file or any other
directory is refused before anything is written.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

import runmap
from runmap.format.checkpoint import CheckpointReader
from runmap.format.packfile import (EXPERTS_TENSOR, FORMAT_NAME, FORMAT_VERSION, MANIFEST, NONROUTED_FILE, PackError,
                                    file_sha256, is_pack_dir, layer_file)
from runmap.format.qpack import DEFAULT_BLOCK_SIZE, PROJECTIONS, QUANT_RULE, RowLayout, dequantize, quantize
from runmap.format.safetensors_io import StreamingWriter
from runmap.atomic import remove_stale_temporaries, replace_dir
from runmap.provenance import sha256_file, utc_timestamp

COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
              "chat_template.jinja")
EXPERT_FILE_ALIGN = 4096  # expert data starts page-aligned in its file


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda if available else cpu; "cuda" without a GPU is an error (never a silent fallback)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PackError("--device cuda requested but torch.cuda.is_available() is False")
    if device != "cpu" and not device.startswith("cuda"):
        raise PackError(f"--device must be auto, cpu or cuda, got {device!r}")
    return torch.device(device)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM on Linux, else getrusage)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


CHUNK_VALUES = 1 << 24  # weight values quantized per step: bounds the FP32 temporaries (~0.5 GB)


def quantize_projection_into(rows: torch.Tensor, w: torch.Tensor, proj: str, layout: RowLayout, layer: int = 0) -> dict:
    """Quantize one projection of every expert of a layer into its sections of ``rows``.

    Args:
        rows: uint8 (E, row_bytes), written in place (the ``proj`` weight and scale sections).
        w: (E, N, K) float (any float dtype), same device as rows; N, K = layout.proj_dims(proj).
    Returns {"rel_fro": [E floats], "max_abs": [E floats]}: ||W - W_hat||_F / ||W||_F (0 for an all-zero
    W) and max |W - W_hat| per expert, with W the source values in FP32.
    Experts are processed in chunks of about CHUNK_VALUES values; blocks are per row, so chunking
    (and the (E*N, K) flattening) gives the same bytes as quantizing each expert alone.
    """
    n_exp = rows.shape[0]
    n, k = layout.proj_dims(proj)
    if tuple(w.shape) != (n_exp, n, k):
        raise PackError(f"layer {layer} {proj}: stacked shape {tuple(w.shape)}, expected {(n_exp, n, k)}")
    ws, ss = layout.section(f"{proj}.weight"), layout.section(f"{proj}.scale")
    step = max(1, CHUNK_VALUES // (n * k))
    rel, mx = [], []
    for e0 in range(0, n_exp, step):
        e1 = min(n_exp, e0 + step)
        c = e1 - e0
        flat = w[e0:e1].reshape(c * n, k)  # (c*N, K)
        packed, scales = quantize(flat, layout.block_size, name=f"layer {layer} experts[{e0}:{e1}].{proj}")
        rows[e0:e1, ws.offset:ws.offset + ws.nbytes] = packed.view(c, -1)  # (c, N*K/2)
        rows[e0:e1, ss.offset:ss.offset + ss.nbytes] = scales.view(c, -1).view(torch.uint8)  # (c, 2*N*nb)
        w32 = flat.float().view(c, n * k)  # (c, N*K)
        diff = dequantize(packed, scales, k, layout.block_size).view(c, n * k).sub_(w32)  # (c, N*K)
        denom = w32.norm(dim=1)  # (c,)
        num = diff.norm(dim=1)
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        rel += torch.where(denom > 0, num / safe, torch.zeros_like(num)).cpu().tolist()
        mx += diff.abs_().amax(dim=1).cpu().tolist()
        del packed, scales, w32, diff
    return {"rel_fro": rel, "max_abs": mx}


def quantize_layer(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, layout: RowLayout, layer: int = 0):
    """Quantize one layer's routed experts into rows.

    Args:
        gate, up: (E, I, H) float (any float dtype), on the compute device.
        down: (E, H, I) float, same device.
        layout: RowLayout for (H, I, block_size).
    Returns:
        rows: uint8 (E, row_bytes) on the same device (padding bytes zero); equal, row for row, to
            ``layout.pack_expert``.
        errors: {proj: {"rel_fro": [E floats], "max_abs": [E floats]}} (see quantize_projection_into).
    """
    rows = torch.zeros((gate.shape[0], layout.row_bytes), dtype=torch.uint8, device=gate.device)  # (E, row_bytes)
    errors = {proj: quantize_projection_into(rows, w, proj, layout, layer) for proj, w in zip(PROJECTIONS, (gate, up, down))}
    return rows, errors


def pack_layer(reader: CheckpointReader, layer: int, layout: RowLayout, dev: torch.device):
    """Read and quantize one layer one projection at a time (peak: one projection + the rows).
    Returns (rows uint8 (E, row_bytes) on dev, errors) like quantize_layer."""
    rows = torch.zeros((reader.config.num_experts, layout.row_bytes), dtype=torch.uint8, device=dev)
    errors = {}
    for proj in PROJECTIONS:
        w = reader.expert_projection(layer, proj, dev)  # (E, N, K) source dtype
        errors[proj] = quantize_projection_into(rows, w, proj, layout, layer)
        del w
    return rows, errors


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an existing ``out`` unless ``overwrite`` and it is a pack directory (never a file, a symlink or
    a directory that is not a pack: --force must not delete what ``runmap pack`` did not make)."""
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise PackError(f"{out}: already exists (pass --force to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise PackError(f"{out}: exists and is not a directory; --force replaces only a pack directory, "
                        "refusing to delete it")
    if not is_pack_dir(out):
        raise PackError(f"{out}: exists and is not a pack (no {MANIFEST} of format {FORMAT_NAME}); --force "
                        "replaces only a pack directory, refusing to delete it")


def _row_hashes(rows_cpu: torch.Tensor, pool: cf.Executor) -> list[str]:
    data = rows_cpu.numpy()
    return list(pool.map(lambda e: hashlib.sha256(memoryview(data[e])).hexdigest(), range(data.shape[0])))


def pack_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    block_size: int = DEFAULT_BLOCK_SIZE,
    device: str = "auto",
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Pack ``checkpoint_dir`` into ``out_dir`` (layout in the module docstring). Returns out_dir.

    Raises CheckpointError (bad input, before anything is written), UnsupportedLayerError (a dense
    layer, naming it, before anything is written), QPackError (bad block size), PackError (device,
    existing output). On any failure no ``out_dir`` is created or changed.
    """
    t0 = time.perf_counter()
    dev = resolve_device(device)
    out = Path(out_dir)
    check_output(out, overwrite)
    reader = CheckpointReader(checkpoint_dir)  # validates the whole inventory from headers
    cfg = reader.config
    # a dense layer has no experts to qpack and the engine cannot run one yet: refuse before writing anything
    cfg.adapter.require_routed_layers(cfg, f"{reader.path}: runmap pack")
    layout = RowLayout.build(cfg.hidden_size, cfg.moe_intermediate_size, block_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out, ".tmp-")  # what a killed pack of the same OUT_DIR left
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    pool = cf.ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)))
    try:
        src_files = reader.source_files()
        src_hashes = {p: pool.submit(sha256_file, p) for p in src_files}  # overlaps with packing
        timing = {}

        # -- non-routed tensors, FP16 --------------------------------------------------------------
        t = time.perf_counter()
        names = reader.nonrouted_names()
        w = StreamingWriter(tmp / NONROUTED_FILE, [(n, torch.float16, reader.shape(n)) for n in names],
                            {"format": "pt", "runmap": "nonrouted-fp16"})
        try:
            for n in names:
                w.write(n, reader.tensor_fp16(n, dev).cpu())
            w.close()
        except BaseException:
            w.abort()
            raise
        file_hashes = {NONROUTED_FILE: pool.submit(file_sha256, tmp / NONROUTED_FILE)}
        timing["nonrouted_s"] = time.perf_counter() - t

        # -- routed experts, one layer at a time ---------------------------------------------------
        layers, layer_s = [], []
        it = range(cfg.num_layers)
        if progress:
            from tqdm import tqdm
            it = tqdm(it, desc=f"pack {out.name}", unit="layer")
        for l in it:
            t = time.perf_counter()
            rows, errors = pack_layer(reader, l, layout, dev)
            rows_cpu = rows.cpu()  # (E, row_bytes)
            del rows
            fname = layer_file(l)
            w = StreamingWriter(tmp / fname, [(EXPERTS_TENSOR, torch.uint8, tuple(rows_cpu.shape))],
                                {"format": "pt", "runmap": "qpack-experts", "layer": str(l)}, align=EXPERT_FILE_ALIGN)
            try:
                w.write(EXPERTS_TENSOR, rows_cpu)
                w.close()
            except BaseException:
                w.abort()
                raise
            file_hashes[fname] = pool.submit(file_sha256, tmp / fname)
            layers.append({
                "layer": l, "file": fname, "tensor": EXPERTS_TENSOR, "offset": w.offsets[EXPERTS_TENSOR],
                "row_bytes": layout.row_bytes, "num_experts": cfg.num_experts,
                "nbytes": cfg.num_experts * layout.row_bytes, "file_bytes": w.total_bytes,
                "source_layout": reader.expert_layout[l],
                "expert_sha256": _row_hashes(rows_cpu, pool),
                "quant_error": errors,
            })
            del rows_cpu
            layer_s.append(time.perf_counter() - t)
        timing["layers_s"] = layer_s

        copied = []
        for fname in COPY_FILES:
            if (reader.path / fname).is_file():
                shutil.copyfile(reader.path / fname, tmp / fname)
                copied.append(fname)
                file_hashes[fname] = pool.submit(file_sha256, tmp / fname)
        files = []
        for fname in sorted(file_hashes):
            nbytes, digest = file_hashes[fname].result()
            files.append({"file": fname, "bytes": nbytes, "sha256": digest})

        t = time.perf_counter()
        source = [{"file": p.name, "bytes": p.stat().st_size, "sha256": f.result()} for p, f in src_hashes.items()]
        timing["source_hash_wait_s"] = time.perf_counter() - t
        h, i, e_n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        largest_src_layer = 3 * e_n * h * i * 2  # BF16 bytes of one layer's routed experts
        timing["total_s"] = time.perf_counter() - t0
        manifest = {
            "format": {"name": FORMAT_NAME, "version": FORMAT_VERSION},
            "tool": {"name": "horizon-runmap", "version": runmap.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
            "created_utc": utc_timestamp(),
            "source": {"path": str(reader.path.resolve()), "architecture": cfg.hf_architecture,
                       "expert_layouts": sorted(set(reader.expert_layout.values())), "files": source},
            "model": cfg.to_manifest_dict(),
            "quant_rule": QUANT_RULE,
            "block_size": block_size,
            "row_layout": layout.to_dict(),
            "nonrouted": {"file": NONROUTED_FILE, "dtype": "float16", "tensors": names,
                          "file_bytes": (tmp / NONROUTED_FILE).stat().st_size},
            "layers": layers,
            "copied_files": copied,
            "files": files,
            "compute_device": str(dev) if dev.type == "cpu" else f"cuda ({torch.cuda.get_device_name(dev)})",
            "timing": timing,
            "memory": {"peak_rss_bytes": peak_rss_bytes(), "largest_layer_source_bytes": largest_src_layer,
                       "largest_layer_packed_bytes": e_n * layout.row_bytes},
        }
        publish_pack(tmp, out, manifest)
    except BaseException:
        # stop the workers first: a job still running would otherwise write into the folder being removed
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return out


def publish_pack(tmp: Path, out: Path, manifest: dict) -> None:
    """Write ``manifest`` into the finished temporary pack folder ``tmp`` (fsynced, last: a folder without it is
    not a pack), then put ``tmp`` in the place of ``out`` atomically."""
    mtmp = tmp / (MANIFEST + ".part")
    with open(mtmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(mtmp, tmp / MANIFEST)
    os.chmod(tmp, 0o755)
    replace_dir(tmp, out)
