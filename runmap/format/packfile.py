"""Read a qpack directory written by ``runmap pack`` (see ``runmap.format.pack`` for the layout).

``PackReader`` is the one way the cache and the engine read a pack. Every data read is a positioned
read into a fresh, process-owned, contiguous CPU tensor (no mmap, so nothing aliases the file) and
is counted in ``bytes_read``. After ``close()`` every data read raises ``PackClosedError`` and is
counted in ``reads_after_close``: the cache uses these counters to *observe* that requests never
read the pack. Offsets and sizes come from the manifest and are checked against the file before
reading; an overrun is a ``PackError`` naming the file and the layer.

Integrity (format v2): the manifest's ``files`` lists every file of the pack with its size and sha256.
Opening a reader checks that every file name in the manifest is a plain name inside the pack directory
(no separator, no ``..``, not absolute) and, unless ``verify=False`` (or ``RUNMAP_PACK_VERIFY=0`` in the
environment, for callers that cannot pass the argument), hashes the non-routed file and every small file
(config, tokenizer) before any of them is used. Expert files are not hashed here: their rows are checked
against the per-expert sha256 where they are read from host storage (``verify_expert_hashes``; the host
source does it once at startup). ``check_pack`` recomputes everything, for ``runmap validate``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from runmap.arch.config import ModelConfig
from runmap.format.qpack import QUANT_RULE, RowLayout
from runmap.format.safetensors_io import DTYPE_FROM_STR, SafetensorsFormatError, read_header, read_into

FORMAT_NAME = "runmap-qpack"
FORMAT_VERSION = 2  # v2: the manifest records a sha256 of every file (v1 packs must be repacked)
MANIFEST = "manifest.json"
VERIFY_ENV = "RUNMAP_PACK_VERIFY"  # "0": PackReader skips hashing the non-routed and small files
LAYER_FILE_RE = re.compile(r"experts-layer-\d{3,}\.safetensors")
HASH_CHUNK = 8 << 20
NONROUTED_FILE = "nonrouted.safetensors"
EXPERTS_TENSOR = "experts"


def layer_file(layer: int) -> str:
    return f"experts-layer-{layer:03d}.safetensors"


class PackError(ValueError):
    """A pack directory, manifest or file is missing, inconsistent or corrupt. The message names it."""


class PackClosedError(PackError):
    """A read was attempted on a closed PackReader."""


def member_path(pack_dir: Path, name, where: str) -> Path:
    """``pack_dir / name`` for a file name taken from the manifest (``where`` says which field), refusing
    anything that is not one plain file name inside the pack directory."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or os.path.isabs(name):
        raise PackError(f"{pack_dir / MANIFEST}: {where} is {name!r}; a pack file must be a plain file name "
                        "inside the pack directory (no path separator, no '..', not absolute)")
    return pack_dir / name


def file_sha256(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in chunks."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            h.update(view[:k])
            n += k
    return n, h.hexdigest()


def is_pack_dir(path: Path) -> bool:
    """True when ``path`` is a directory whose manifest.json says it is a runmap pack (any format version)."""
    m = Path(path) / MANIFEST
    if not Path(path).is_dir() or not m.is_file():
        return False
    try:
        fmt = json.loads(m.read_bytes()).get("format") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(fmt, dict) and fmt.get("name") == FORMAT_NAME


def looks_half_written(path: Path) -> bool:
    """A directory holding pack data files (or a manifest being written) but no manifest.json: a pack whose
    writer stopped before its last step (the manifest is written last, atomically)."""
    path = Path(path)
    if not path.is_dir() or (path / MANIFEST).exists():
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n == NONROUTED_FILE or n == MANIFEST + ".part" or LAYER_FILE_RE.fullmatch(n) for n in names)


def check_format_version(mpath: Path, manifest) -> None:
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    fmt = fmt if isinstance(fmt, dict) else {}
    if fmt.get("name") == FORMAT_NAME and isinstance(fmt.get("version"), int) and fmt["version"] < FORMAT_VERSION:
        raise PackError(f"{mpath}: pack format v{fmt['version']} was written by an older runmap and records no "
                        f"digest of its files; this runmap reads v{FORMAT_VERSION}: repack it "
                        "(runmap pack CHECKPOINT_DIR OUT_DIR --force)")
    if fmt.get("name") != FORMAT_NAME or fmt.get("version") != FORMAT_VERSION:
        raise PackError(f"{mpath}: format {fmt!r}, this reader reads {FORMAT_NAME} v{FORMAT_VERSION}")


def recorded_files(pack_dir: Path, manifest: dict) -> dict[str, dict]:
    """The manifest's ``files`` as {name: {"bytes", "sha256"}}, every name checked by ``member_path``, and
    every file the manifest refers to elsewhere (non-routed, layer files, copied files) present in it."""
    mpath = pack_dir / MANIFEST
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise PackError(f"{mpath}: malformed manifest: 'files' must be a non-empty list of "
                        "{file, bytes, sha256}")
    out: dict[str, dict] = {}
    for i, e in enumerate(files):
        if not isinstance(e, dict) or not isinstance(e.get("bytes"), int) or \
                not isinstance(e.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", e["sha256"]):
            raise PackError(f"{mpath}: malformed manifest: files[{i}] must be {{file, bytes, sha256}}, got {e!r}")
        member_path(pack_dir, e.get("file"), f"files[{i}].file")
        if e["file"] in out or e["file"] == MANIFEST:
            raise PackError(f"{mpath}: files[{i}].file {e['file']!r} is listed twice or is the manifest itself")
        out[e["file"]] = e
    nonrouted, layers, copied = manifest.get("nonrouted"), manifest.get("layers"), manifest.get("copied_files")
    if not isinstance(nonrouted, dict) or not isinstance(layers, list) or not isinstance(copied, list):
        raise PackError(f"{mpath}: malformed manifest: 'nonrouted' must be an object, 'layers' and "
                        "'copied_files' lists")
    refs = [("nonrouted.file", nonrouted.get("file"))]
    refs += [(f"layers[{i}].file", l.get("file") if isinstance(l, dict) else None) for i, l in enumerate(layers)]
    refs += [(f"copied_files[{i}]", c) for i, c in enumerate(copied)]
    for where, name in refs:
        member_path(pack_dir, name, where)
        if name not in out:
            raise PackError(f"{mpath}: {where} {name!r} has no entry in 'files' (no digest to verify it by)")
    return out


def verify_file(pack_dir: Path, entry: dict) -> int:
    """Hash one recorded file; PackError naming it on a missing file, a size or a sha256 mismatch.
    Returns the bytes read."""
    path = member_path(pack_dir, entry["file"], "file")
    if not path.is_file():
        raise PackError(f"{path}: missing (the manifest records it)")
    try:
        n, digest = file_sha256(path)
    except OSError as e:
        raise PackError(f"{path}: cannot read: {e}") from e
    if n != entry["bytes"]:
        raise PackError(f"{path}: {n} bytes, the manifest records {entry['bytes']} (truncated or replaced)")
    if digest != entry["sha256"]:
        raise PackError(f"{path}: sha256 {digest[:16]}... does not match the manifest's {entry['sha256'][:16]}... "
                        "(the file is corrupt or was changed after packing)")
    return n


def check_pack(pack_dir: str | Path) -> list[tuple[str, str]]:
    """Every integrity problem of a pack, as (file, message): the manifest's format and file names, each
    recorded file's size and sha256, each expert row's sha256, and files in the directory the manifest does
    not record. Empty when the pack is intact. Never raises for a bad pack."""
    pack_dir = Path(pack_dir)
    mpath = pack_dir / MANIFEST
    try:
        manifest = json.loads(mpath.read_bytes())
    except (OSError, ValueError) as e:
        return [(str(mpath), f"cannot read the manifest: {e}")]
    try:
        check_format_version(mpath, manifest)
        files = recorded_files(pack_dir, manifest)
    except PackError as e:
        return [(str(mpath), str(e))]
    problems = []
    for name, entry in files.items():
        try:
            verify_file(pack_dir, entry)
        except PackError as e:
            problems.append((str(pack_dir / name), str(e)))
    try:
        listed = set(files) | {MANIFEST}
        extra = sorted(n for n in os.listdir(pack_dir) if not n.startswith(".") and n not in listed)
    except OSError as e:
        extra, problems = [], problems + [(str(pack_dir), f"cannot list: {e}")]
    for n in extra:
        problems.append((str(pack_dir / n), "not recorded in the manifest's 'files' (no digest covers it)"))
    if not problems:
        try:
            with PackReader(pack_dir, verify=False) as r:
                r.check_nonrouted_tensors()
                for layer in range(r.num_layers):
                    r.verify_expert_hashes(layer, r.read_expert_rows(layer))
        except PackError as e:
            problems.append((str(pack_dir), str(e)))
        except (ValueError, TypeError, KeyError, OSError) as e:  # a manifest the reader cannot make sense of
            problems.append((str(mpath), f"cannot open the pack: {type(e).__name__}: {e}"))
    return problems


class PackReader:
    """Reader of one pack directory. Use as a context manager or call ``close()``.

    Attributes (in memory, usable after close): path, manifest (dict), identity (sha256 hex of
    manifest.json), config (ModelConfig), layout (RowLayout), num_layers, num_experts, tokenizer_dir.
    Counters: bytes_read (every byte read from pack data files), reads_after_close.
    """

    @property
    def nonrouted_file_bytes(self) -> int:
        """Size of the non-routed weights file (what the device holds of it: the budget planner's input)."""
        return self._nonrouted_file.stat().st_size

    def __init__(self, pack_dir: str | Path, verify: bool | None = None):
        self.path = Path(pack_dir)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise PackError(f"{mpath}: not found ({self.path} is not a complete pack; make one with `runmap pack`)")
        raw = mpath.read_bytes()
        try:
            self.manifest = json.loads(raw)
        except json.JSONDecodeError as e:
            raise PackError(f"{mpath}: not valid JSON ({e})") from e
        self.identity = hashlib.sha256(raw).hexdigest()
        m = self.manifest
        if not isinstance(m, dict):
            raise PackError(f"{mpath}: malformed manifest (a JSON object expected, got {type(m).__name__})")
        check_format_version(mpath, m)
        self.files = recorded_files(self.path, m)  # every name checked to lie inside the pack
        try:
            self.config = ModelConfig(**m["model"])
            self.layout = RowLayout.from_dict(m["row_layout"])
            self._layers = {int(e["layer"]): e for e in m["layers"]}
            self._nonrouted_names = list(m["nonrouted"]["tensors"])
            if not all(isinstance(n, str) for n in self._nonrouted_names):
                raise TypeError("nonrouted.tensors must be a list of tensor names (strings)")
            self._nonrouted_file = self.path / m["nonrouted"]["file"]
            for e in self._layers.values():
                int(e["offset"]), int(e["num_experts"]), int(e["row_bytes"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PackError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from e
        self.num_layers = self.config.num_layers
        self.num_experts = self.config.num_experts
        self._check_format(mpath)
        if sorted(self._layers) != list(range(self.num_layers)):
            raise PackError(f"{mpath}: layers {sorted(self._layers)} do not cover 0..{self.num_layers - 1}")
        self.tokenizer_dir = self.path
        self.bytes_read = 0
        self.reads_after_close = 0
        self._closed = False
        self._nonrouted_header: tuple[dict, int] | None = None
        self.bytes_verified = 0
        self.verify_s = 0.0
        if verify is None:
            verify = os.environ.get(VERIFY_ENV, "1") != "0"
        self.verified = bool(verify)
        if self.verified:
            self._verify_files()
        self._check_config_json(mpath)

    def _check_config_json(self, mpath: Path) -> None:
        """The manifest's model config is what the engine uses; it must be the one of the pack's config.json
        (covered by its digest), so an edited manifest cannot silently change the model."""
        from runmap.arch.config import ConfigError

        try:
            on_disk = ModelConfig.from_checkpoint_dir(self.path)
        except (ConfigError, OSError, ValueError, TypeError, KeyError) as e:
            raise PackError(f"{self.path / 'config.json'}: cannot read the pack's model config: {e}") from e
        if on_disk != self.config:
            diff = sorted(k for k in vars(on_disk) if getattr(on_disk, k) != getattr(self.config, k))
            raise PackError(f"{mpath}: model config differs from the pack's config.json in {diff} (manifest edited "
                            "or files mixed from two packs)")

    def _verify_files(self) -> None:
        """Hash the non-routed file and every recorded file that is not an expert-layer file (config,
        tokenizer, generation config) against the manifest, before any of them is used."""
        import time

        t = time.perf_counter()
        layer_files = {e["file"] for e in self._layers.values()}
        for name, entry in sorted(self.files.items()):
            if name in layer_files:
                continue  # rows are checked by sha256 where they are read (verify_expert_hashes)
            n = verify_file(self.path, entry)
            self.bytes_verified += n
            self.bytes_read += n
        self.check_nonrouted_tensors()
        self.verify_s = time.perf_counter() - t

    def _check_format(self, mpath: Path) -> None:
        """The quantization rule and the row layout must be the ones this reader (and the kernels) decode,
        and must fit the model: a mismatch would be misread, not just fail later."""
        rule = self.manifest.get("quant_rule") or {}
        for key in ("name", "int_range", "nibble_offset", "nibble_order", "scale_dtype"):
            if rule.get(key) != QUANT_RULE[key]:
                raise PackError(f"{mpath}: quant_rule.{key} is {rule.get(key)!r}; this reader decodes "
                                f"{QUANT_RULE[key]!r}")
        cfg, lay = self.config, self.layout
        if (lay.hidden_size, lay.intermediate_size) != (cfg.hidden_size, cfg.moe_intermediate_size):
            raise PackError(f"{mpath}: row_layout is for hidden={lay.hidden_size}, intermediate="
                            f"{lay.intermediate_size}, but the model has hidden={cfg.hidden_size}, "
                            f"moe_intermediate={cfg.moe_intermediate_size}")
        block = self.manifest.get("block_size", lay.block_size)
        if block != lay.block_size:
            raise PackError(f"{mpath}: block_size {block} differs from row_layout.block_size {lay.block_size}")
        for layer, e in self._layers.items():
            if int(e.get("row_bytes", -1)) != lay.row_bytes or int(e.get("num_experts", -1)) != self.num_experts:
                raise PackError(f"{mpath}: layer {layer} records row_bytes={e.get('row_bytes')}, num_experts="
                                f"{e.get('num_experts')}; the row layout and model give {lay.row_bytes}, "
                                f"{self.num_experts}")

    # ---- lifecycle --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _check_open(self, what: str) -> None:
        if self._closed:
            self.reads_after_close += 1
            raise PackClosedError(f"{self.path}: read of {what} after the pack reader was closed")

    # ---- non-routed FP16 tensors ------------------------------------------------------------------
    def nonrouted_names(self) -> list[str]:
        """HF names of every non-routed tensor (embeddings, attention, norms, router, shared expert, lm_head)."""
        return list(self._nonrouted_names)

    def _nonrouted_index(self) -> tuple[dict, int]:
        if self._nonrouted_header is None:
            try:
                self._nonrouted_header = read_header(self._nonrouted_file)
                self.bytes_read += self._nonrouted_header[1]  # header bytes, read once
            except (SafetensorsFormatError, OSError) as e:
                raise PackError(f"{self._nonrouted_file}: {e}") from e
        return self._nonrouted_header

    def check_nonrouted_tensors(self) -> None:
        """The manifest's non-routed tensor list must be exactly the F16 tensors of the file's header (a name
        dropped from the manifest would make a complete file unusable; an extra one, a missing tensor)."""
        header, _ = self._nonrouted_index()
        in_file = {k for k in header if k != "__metadata__"}
        listed = set(self._nonrouted_names)
        if in_file != listed or len(listed) != len(self._nonrouted_names):
            raise PackError(f"{self.path / MANIFEST}: nonrouted.tensors does not list the tensors of "
                            f"{self._nonrouted_file.name}: missing {sorted(in_file - listed)[:5]}, extra "
                            f"{sorted(listed - in_file)[:5]}, {len(self._nonrouted_names) - len(listed)} repeated")
        bad = sorted(k for k in in_file if header[k].get("dtype") != "F16")
        if bad:
            raise PackError(f"{self._nonrouted_file}: tensors {bad[:5]} are not F16")

    def nonrouted(self, name: str) -> torch.Tensor:
        """One non-routed tensor: torch.float16, its HF shape, a fresh CPU copy."""
        self._check_open(f"non-routed tensor {name!r}")
        if name not in self._nonrouted_names:
            raise PackError(f"{self.path / MANIFEST}: no non-routed tensor {name!r}")
        header, data_start = self._nonrouted_index()
        e = header.get(name)
        if e is None or e["dtype"] != "F16":
            raise PackError(f"{self._nonrouted_file}: tensor {name!r} missing or not F16")
        out = torch.empty(e["shape"], dtype=DTYPE_FROM_STR[e["dtype"]])
        try:
            self.bytes_read += read_into(self._nonrouted_file, data_start + e["data_offsets"][0], out)
        except (SafetensorsFormatError, OSError) as err:
            raise PackError(f"{self._nonrouted_file}: tensor {name!r}: {err}") from err
        return out

    # ---- routed experts ---------------------------------------------------------------------------
    def _layer(self, layer: int) -> dict:
        if layer not in self._layers:
            raise PackError(f"{self.path / MANIFEST}: no layer {layer} (num_layers={self.num_layers})")
        return self._layers[layer]

    def read_expert_rows(self, layer: int) -> torch.Tensor:
        """All expert rows of one layer: torch.uint8 (E, row_bytes), a fresh contiguous CPU copy read
        at the manifest's byte offset. Raises PackError (file, layer) if the range overruns the file."""
        self._check_open(f"expert rows of layer {layer}")
        e = self._layer(layer)
        fpath = self.path / e["file"]
        n_exp, row_bytes, offset = int(e["num_experts"]), int(e["row_bytes"]), int(e["offset"])
        if row_bytes != self.layout.row_bytes or n_exp != self.num_experts:
            raise PackError(
                f"{fpath}: layer {layer}: manifest says {n_exp} experts x {row_bytes} bytes, the pack's layout "
                f"and config say {self.num_experts} x {self.layout.row_bytes}"
            )
        if not fpath.is_file():
            raise PackError(f"{fpath}: missing expert file of layer {layer}")
        size = fpath.stat().st_size
        end = offset + n_exp * row_bytes
        if offset < 0 or end > size:
            raise PackError(
                f"{fpath}: layer {layer}: expert bytes [{offset}, {end}) overrun the file ({size} bytes)"
            )
        self._check_header(fpath, layer, e.get("tensor", EXPERTS_TENSOR), offset, (n_exp, row_bytes))
        out = torch.empty((n_exp, row_bytes), dtype=torch.uint8)  # (E, row_bytes)
        try:
            self.bytes_read += read_into(fpath, offset, out)
        except (SafetensorsFormatError, OSError) as err:
            raise PackError(f"{fpath}: layer {layer}: {err}") from err
        return out

    def _check_header(self, fpath: Path, layer: int, tensor: str, offset: int, shape: tuple[int, int]) -> None:
        """The manifest's offset and shape must be those of ``tensor`` in the file's own header."""
        try:
            header, data_start = read_header(fpath)
        except (SafetensorsFormatError, OSError) as err:
            raise PackError(f"{fpath}: layer {layer}: {err}") from err
        self.bytes_read += data_start  # the header is a read of the pack too
        ent = header.get(tensor)
        if ent is None or ent["dtype"] != "U8" or tuple(ent["shape"]) != shape or \
                data_start + ent["data_offsets"][0] != offset:
            found = None if ent is None else (ent["dtype"], ent["shape"], data_start + ent["data_offsets"][0])
            raise PackError(
                f"{fpath}: layer {layer}: manifest says tensor {tensor!r} U8 {list(shape)} at byte {offset}, "
                f"the file's header says {found}"
            )

    def expert_sha256(self, layer: int) -> list[str]:
        """Per-expert sha256 hex digests recorded at pack time (from the manifest, no file read)."""
        h = list(self._layer(layer)["expert_sha256"])
        if len(h) != self.num_experts:
            raise PackError(f"{self.path / MANIFEST}: layer {layer}: {len(h)} expert hashes for {self.num_experts} experts")
        return h

    def verify_expert_hashes(self, layer: int, rows: torch.Tensor) -> None:
        """Check rows uint8 (E, row_bytes) against the manifest; PackError naming layer and expert."""
        want = self.expert_sha256(layer)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (self.num_experts, self.layout.row_bytes):
            raise PackError(f"layer {layer}: rows {rows.dtype} {tuple(rows.shape)}, expected uint8 "
                            f"({self.num_experts}, {self.layout.row_bytes})")
        data = rows.cpu().contiguous().numpy()
        for e in range(self.num_experts):
            got = hashlib.sha256(memoryview(data[e])).hexdigest()
            if got != want[e]:
                raise PackError(
                    f"{self.path / self._layer(layer)['file']}: layer {layer} expert {e}: sha256 {got[:16]}... "
                    f"does not match the manifest's {want[e][:16]}..."
                )
