"""Read a local Hugging Face checkpoint of a supported MoE family (OLMoE, Qwen2-MoE), tensor by tensor.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or several shards
listed in ``model.safetensors.index.json``. Routed experts come in one of two on-disk layouts, chosen
per layer (the names below are the llama-like defaults; each family's adapter in runmap/arch/ states its own):

* ``per-expert`` (the hub checkpoints, and what transformers 5.x ``save_pretrained`` writes after
  reversing its in-memory fusion): ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``
  with shapes (I, H), (I, H), (H, I).
* ``fused`` (transformers 5.x in-memory parameter names): ``model.layers.{l}.mlp.experts.gate_up_proj``
  (E, 2I, H) with gate rows first then up rows, and ``model.layers.{l}.mlp.experts.down_proj`` (E, H, I).

Opening a checkpoint checks the whole inventory from the headers only (no tensor data is read):
every expected tensor present with the expected shape, no unknown tensors, every shard present and
not truncated. Tensor values are checked when they are read (``check_values``): finite, and within
the FP16 range because the runtime computes in FP16. Every error is a ``CheckpointError`` naming the
file and the tensor.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from runmap.arch.base import EXPERT_LAYOUTS
from runmap.arch.config import ConfigError, ModelConfig
from runmap.arch.registry import hf_architecture_names
from runmap.format.qpack import FP16_MAX, PROJECTIONS
from runmap.format.safetensors_io import DTYPE_FROM_STR, ITEMSIZE, SafetensorsFormatError, read_header, read_into

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports store; recomputed from config


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or out of range. The message names both."""


def expected_nonrouted(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every non-routed tensor, in a fixed order (embeddings, layers, norm, lm_head),
    as the family's adapter names them."""
    return cfg.adapter.nonrouted_tensors(cfg)


def expert_names(cfg: ModelConfig, layer: int, layout: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of the routed expert tensors of one layer in the given on-disk layout
    (empty for a dense layer)."""
    return cfg.adapter.routed_expert_tensors(cfg, layer, layout)


CHECK_CHUNK = 1 << 22  # values per step of the value check: no full-size temporaries


def _bad_values(t: torch.Tensor) -> tuple[int, float]:
    """(number of NaN/Inf values, max |x| over the finite values) of ``t``, in chunks, on t's device."""
    flat = t.reshape(-1)
    n_bad, amax = 0, 0.0
    for c in flat.split(CHECK_CHUNK):
        fin = torch.isfinite(c)
        n_bad += int((~fin).sum())
        if c.numel():
            amax = max(amax, float(torch.where(fin, c, torch.zeros_like(c)).abs().amax()))
    return n_bad, amax


def check_values(t: torch.Tensor, name: str, file: str) -> None:
    """Raise CheckpointError unless every value of ``t`` is finite and |x| <= 65504 (FP16 max).

    t: any float tensor on any device (the check runs where the tensor is, chunk by chunk)."""
    n_bad, amax = _bad_values(t)
    if n_bad:
        raise CheckpointError(f"{file}: tensor {name!r} has {n_bad} NaN/Inf value(s)")
    if amax > FP16_MAX:
        raise CheckpointError(
            f"{file}: tensor {name!r} overflows FP16: max |x| = {amax:g} > {FP16_MAX:g} (BF16 -> FP16 conversion)"
        )


def _bad_flag(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on t's device: any NaN/Inf or |x| > FP16 max in t (no host sync)."""
    return (~torch.isfinite(t)).any() | (t.abs().amax() > FP16_MAX)


class CheckpointReader:
    """Streaming view of a local HF MoE checkpoint. Never loads more than the tensor asked for.

    Attributes:
        path: the checkpoint directory.
        config: ModelConfig parsed from config.json.
        hf_config: the raw config.json dict.
        files: shard file names (relative to path), sorted.
        expert_layout: {layer: "per-expert" | "fused"} for every routed (MoE) layer; dense layers are absent.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        cfg_path = self.path / "config.json"
        try:
            self.config = ModelConfig.from_checkpoint_dir(self.path)
        except ConfigError as e:
            raise CheckpointError(str(e)) from e
        self.hf_config = json.loads(cfg_path.read_text())
        archs = self.hf_config.get("architectures") or []
        known = hf_architecture_names()
        if archs and any(a not in known for a in archs):
            raise CheckpointError(f"{cfg_path}: unsupported architectures {archs}; supported: {sorted(known)}")
        self._weight_map = self._load_weight_map()  # tensor name -> file name
        self.files = sorted(set(self._weight_map.values()))
        self._headers: dict[str, tuple[dict, int]] = {}
        for fname in self.files:
            fpath = self.path / fname
            try:
                self._headers[fname] = read_header(fpath)
            except (SafetensorsFormatError, OSError) as e:
                raise CheckpointError(f"{fpath}: unreadable safetensors file: {e}") from e
        self._check_index_agrees()
        self.adapter = self.config.adapter
        self.expert_layout = {l: self._detect_layout(l) for l in self.adapter.routed_layers(self.config)}
        # runmap's name of a non-routed tensor -> its name in this checkpoint, where they differ (Mixtral's
        # router in a fused layer); everything outside the reader uses runmap's names
        self._on_disk = {}
        for l, layout in self.expert_layout.items():
            if layout == "fused":
                for name, _ in self.adapter.layer_tensors(self.config, l).values():
                    if self.adapter.fused_layout_name(name) != name:
                        self._on_disk[name] = self.adapter.fused_layout_name(name)
        self._check_inventory()

    # ---- discovery --------------------------------------------------------------------------------
    def _load_weight_map(self) -> dict[str, str]:
        idx = self.path / INDEX_FILE
        if idx.is_file():
            try:
                wm = json.loads(idx.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{idx}: malformed index ({e})") from e
            for name, fname in sorted(wm.items()):
                if not (self.path / fname).is_file():
                    raise CheckpointError(f"{self.path / fname}: missing shard (listed in {INDEX_FILE} for tensor {name!r})")
            return dict(wm)
        single = self.path / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE} and no {INDEX_FILE}")
        try:
            header, _ = read_header(single)
        except (SafetensorsFormatError, OSError) as e:
            raise CheckpointError(f"{single}: unreadable safetensors file: {e}") from e
        return {name: SINGLE_FILE for name in header}

    def _check_index_agrees(self) -> None:
        for name, fname in self._weight_map.items():
            if name not in self._headers[fname][0]:
                raise CheckpointError(f"{self.path / fname}: tensor {name!r} listed in {INDEX_FILE} is not in this shard")

    def _detect_layout(self, layer: int) -> str:
        fused = self.adapter.fused_expert_names(layer)["gate_up"]
        return "fused" if fused in self._weight_map else "per-expert"

    def _check_inventory(self) -> None:
        want = {self._on_disk.get(n, n): s for n, s in expected_nonrouted(self.config).items()}
        for l, layout in self.expert_layout.items():
            want.update(expert_names(self.config, l, layout))
        for name, shape in want.items():
            if name not in self._weight_map:
                kind = "expert tensor" if self.adapter.is_routed_expert_tensor(name) else "tensor"
                raise CheckpointError(f"{self.path}: missing {kind} {name!r} (no shard contains it)")
            entry = self._entry(name)
            if tuple(entry["shape"]) != shape:
                raise CheckpointError(
                    f"{self.path / self._weight_map[name]}: tensor {name!r} has shape {tuple(entry['shape'])}, "
                    f"expected {shape} for this config"
                )
            if entry["dtype"] not in ("BF16", "F16", "F32"):
                raise CheckpointError(f"{self.path / self._weight_map[name]}: tensor {name!r} has dtype {entry['dtype']}, expected a float type")
        extra = [n for n in self._weight_map if n not in want and not n.endswith(IGNORED_SUFFIXES)]
        if extra:
            raise CheckpointError(
                f"{self.path / self._weight_map[extra[0]]}: unexpected tensor {extra[0]!r} (and {len(extra) - 1} more); "
                "packing would drop it"
            )

    # ---- metadata ---------------------------------------------------------------------------------
    def _entry(self, name: str) -> dict:
        name = self._on_disk.get(name, name)
        return self._headers[self._weight_map[name]][0][name]

    def file_of(self, name: str) -> Path:
        """The shard that holds tensor ``name``."""
        name = self._on_disk.get(name, name)
        if name not in self._weight_map:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        return self.path / self._weight_map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        self.file_of(name)
        return tuple(self._entry(name)["shape"])

    def nonrouted_names(self) -> list[str]:
        """Every non-routed tensor name, in a fixed order (embeddings, per layer, final norm, lm_head)."""
        return list(expected_nonrouted(self.config))

    def source_files(self) -> list[Path]:
        """Every file that defines the checkpoint: config.json, the index (if any), the shards."""
        out = [self.path / "config.json"]
        if (self.path / INDEX_FILE).is_file():
            out.append(self.path / INDEX_FILE)
        return out + [self.path / f for f in self.files]

    # ---- data -------------------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored (dtype and shape of the file), a fresh CPU copy. Values unchecked."""
        path = self.file_of(name)
        disk = self._on_disk.get(name, name)
        header, data_start = self._headers[self._weight_map[disk]]
        e = header[disk]
        out = torch.empty(e["shape"], dtype=DTYPE_FROM_STR[e["dtype"]])
        try:
            read_into(path, data_start + e["data_offsets"][0], out)
        except (SafetensorsFormatError, OSError) as err:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {err}") from err
        return out

    def tensor_fp16(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Tensor ``name`` converted to float16 on ``device`` after ``check_values`` (finite, in FP16 range)."""
        t = self.tensor(name).to(device)
        check_values(t, name, str(self.file_of(name)))
        return t.to(torch.float16)

    def _expert_slab(self, layer: int, proj: str, e: int) -> tuple[str, Path, int, tuple[int, int], torch.dtype]:
        """Where expert e's ``proj`` weight lives: (display name, file, absolute byte offset, shape, dtype).

        Both layouts store one expert's projection as contiguous bytes: per-expert tensors directly;
        in the fused (E, 2I, H) gate_up tensor the gate rows of expert e are rows [0, I) of slice e and
        the up rows are [I, 2I); in (E, H, I) down_proj slice e is contiguous."""
        i = self.config.moe_intermediate_size
        if layer not in self.expert_layout:
            raise CheckpointError(f"{self.path}: layer {layer} has no routed experts (a dense MLP layer)")
        if self.expert_layout[layer] == "fused":
            name = self.adapter.fused_expert_names(layer)["down" if proj == "down" else "gate_up"]
            entry = self._entry(name)
            _, d1, d2 = entry["shape"]
            item = ITEMSIZE[entry["dtype"]]
            r0 = i if proj == "up" else 0
            rows = d1 if proj == "down" else i
            off = entry["data_offsets"][0] + (e * d1 + r0) * d2 * item
            shown = f"{name}[{e}]" + ("" if proj == "down" else f"[{proj} half]")
            shape = (rows, d2)
        else:
            name = self.adapter.expert_tensor_name(layer, e, proj)
            entry = self._entry(name)
            off, shown, shape = entry["data_offsets"][0], name, tuple(entry["shape"])
        fname = self._weight_map[name]
        return shown, self.path / fname, self._headers[fname][1] + off, shape, DTYPE_FROM_STR[entry["dtype"]]

    def _read_slab(self, shown: str, path: Path, offset: int, out: torch.Tensor) -> None:
        try:
            read_into(path, offset, out)
        except (SafetensorsFormatError, OSError) as err:
            raise CheckpointError(f"{path}: cannot read tensor {shown!r}: {err}") from err

    def expert_projection(self, layer: int, proj: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """All experts of one projection of one layer, stacked, in the stored dtype, values checked.

        Returns (E, I, H) for gate/up, (E, H, I) for down, on ``device``. Reads expert by expert
        straight into the result (CPU) or through one reusable one-expert staging buffer (GPU), so
        host memory stays at one projection of one layer at most."""
        if proj not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {proj!r}")
        device = torch.device(device)
        n_exp = self.config.num_experts
        slabs = [self._expert_slab(layer, proj, e) for e in range(n_exp)]
        _, _, _, shape, dtype = slabs[0]
        out = torch.empty((n_exp, *shape), dtype=dtype, device=device)  # (E, N, K)
        staging = None if device.type == "cpu" else torch.empty(shape, dtype=dtype, pin_memory=True)
        for e, (shown, path, off, shp, dt) in enumerate(slabs):
            if shp != shape or dt != dtype:
                raise CheckpointError(f"{path}: tensor {shown!r} is {dt} {shp}, expert 0 is {dtype} {shape}")
            if staging is None:
                self._read_slab(shown, path, off, out[e])
            else:
                self._read_slab(shown, path, off, staging)
                out[e].copy_(staging)  # synchronous: staging is reused for the next expert
        flags = torch.stack([_bad_flag(out[e]) for e in range(n_exp)]).cpu()  # one device sync
        if bool(flags.any()):
            e = int(flags.nonzero()[0, 0])
            shown, path, *_ = slabs[e]
            check_values(out[e], shown, str(path))
        return out

    def expert_weights(self, layer: int, e: int) -> dict[str, torch.Tensor]:
        """One expert's weights as stored: {"gate": (I, H), "up": (I, H), "down": (H, I)}, values checked."""
        if not 0 <= e < self.config.num_experts:
            raise CheckpointError(f"{self.path}: expert {e} out of range (num_experts={self.config.num_experts})")
        out = {}
        for proj in PROJECTIONS:
            shown, path, off, shape, dtype = self._expert_slab(layer, proj, e)
            t = torch.empty(shape, dtype=dtype)
            self._read_slab(shown, path, off, t)
            check_values(t, shown, str(path))
            out[proj] = t
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
