"""Read a qpack directory written by ``runmap pack`` (see ``runmap.format.pack`` for the layout).

``PackReader`` is the one way the cache and the engine read a pack. Every data read is a positioned
read into a fresh, process-owned, contiguous CPU tensor (no mmap, so nothing aliases the file) and
is counted in ``bytes_read``. After ``close()`` every data read raises ``PackClosedError`` and is
counted in ``reads_after_close``: the cache uses these counters to *observe* that requests never
read the pack. Offsets and sizes come from the manifest and are checked against the file before
reading; an overrun is a ``PackError`` naming the file and the layer.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from runmap.arch.config import ModelConfig
from runmap.format.qpack import QUANT_RULE, RowLayout
from runmap.format.safetensors_io import DTYPE_FROM_STR, SafetensorsFormatError, read_header, read_into

FORMAT_NAME = "runmap-qpack"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
NONROUTED_FILE = "nonrouted.safetensors"
EXPERTS_TENSOR = "experts"


def layer_file(layer: int) -> str:
    return f"experts-layer-{layer:03d}.safetensors"


class PackError(ValueError):
    """A pack directory, manifest or file is missing, inconsistent or corrupt. The message names it."""


class PackClosedError(PackError):
    """A read was attempted on a closed PackReader."""


class PackReader:
    """Reader of one pack directory. Use as a context manager or call ``close()``.

    Attributes (in memory, usable after close): path, manifest (dict), identity (sha256 hex of
    manifest.json), config (ModelConfig), layout (RowLayout), num_layers, num_experts, tokenizer_dir.
    Counters: bytes_read (every byte read from pack data files), reads_after_close.
    """

    def __init__(self, pack_dir: str | Path):
        self.path = Path(pack_dir)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise PackError(f"{mpath}: not found ({self.path} is not a complete pack)")
        raw = mpath.read_bytes()
        try:
            self.manifest = json.loads(raw)
        except json.JSONDecodeError as e:
            raise PackError(f"{mpath}: not valid JSON ({e})") from e
        self.identity = hashlib.sha256(raw).hexdigest()
        m = self.manifest
        fmt = m.get("format") or {}
        if fmt.get("name") != FORMAT_NAME or fmt.get("version") != FORMAT_VERSION:
            raise PackError(f"{mpath}: format {fmt!r}, this reader reads {FORMAT_NAME} v{FORMAT_VERSION}")
        try:
            self.config = ModelConfig(**m["model"])
            self.layout = RowLayout.from_dict(m["row_layout"])
            self._layers = {int(e["layer"]): e for e in m["layers"]}
            self._nonrouted_names = list(m["nonrouted"]["tensors"])
            self._nonrouted_file = self.path / m["nonrouted"]["file"]
        except (KeyError, TypeError, ValueError) as e:
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

    def nonrouted(self, name: str) -> torch.Tensor:
        """One non-routed tensor: torch.float16, its HF shape, a fresh CPU copy."""
        self._check_open(f"non-routed tensor {name!r}")
        if name not in self._nonrouted_names:
            raise PackError(f"{self.path / MANIFEST}: no non-routed tensor {name!r}")
        if self._nonrouted_header is None:
            try:
                self._nonrouted_header = read_header(self._nonrouted_file)
                self.bytes_read += self._nonrouted_header[1]  # header bytes, read once
            except (SafetensorsFormatError, OSError) as e:
                raise PackError(f"{self._nonrouted_file}: {e}") from e
        header, data_start = self._nonrouted_header
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
