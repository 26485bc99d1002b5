"""Helpers for the model/engine equivalence tests (no tests here).

``ReferenceCase`` holds one tiny model three ways: the FP16 non-routed tensors under HF names (what a
pack stores), the qpacked expert rows per layer, and transformers' own model in FP32 loaded with the
same FP16-rounded non-routed weights and the DEQUANTIZED expert weights. ``hf_reference`` builds the
last one from any source of those tensors (an in-memory case or a PackReader).
"""
from __future__ import annotations

import torch

from runmap.arch.config import ModelConfig
from runmap.format.qpack import RowLayout


def hf_classes(cfg: ModelConfig):
    """(transformers config class, causal-LM class) of the family, as its adapter names them."""
    return cfg.adapter.hf_config_class(), cfg.adapter.hf_model_class()


def hf_reference(cfg: ModelConfig, get_nonrouted, expert_rows, layout: RowLayout):
    """transformers' model in FP32 (eager attention) with the given weights.
    get_nonrouted(name) -> fp16 tensor; expert_rows(layer) -> uint8 (E, row_bytes)."""
    C, M = hf_classes(cfg)
    hf_cfg = C(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    model = M(hf_cfg).float().eval()
    sd = model.state_dict()
    # transformers' in-memory names are the fused layout's; the adapter renames some there (Mixtral's router)
    ours = {cfg.adapter.fused_layout_name(n): n for n in cfg.adapter.nonrouted_tensors(cfg)}
    new = {}
    for name in sd:
        if ".mlp.experts." in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        new[name] = get_nonrouted(ours.get(name, name)).float()
    for layer in range(cfg.num_layers):
        rows = expert_rows(layer)
        deq = [layout.dequantize_expert(rows[e]) for e in range(cfg.num_experts)]
        p = f"model.layers.{layer}.mlp.experts."
        new[p + "gate_up_proj"] = torch.stack([torch.cat([d["gate"], d["up"]], 0) for d in deq])  # (E, 2I, H)
        new[p + "down_proj"] = torch.stack([d["down"] for d in deq])  # (E, H, I)
    missing = set(sd) - set(new)
    assert not missing or missing == {"lm_head.weight"}, missing
    model.load_state_dict(new, strict=False)
    return model


class RouteRecorder:
    """Records the top-k ids transformers' routers pick: one (N, k) tensor per MoE call, in call order."""

    def __init__(self, model):
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def fn(mod, inp, out):
            self.calls.append((i, out[2].reshape(-1, out[2].shape[-1]).detach().cpu()))
        return fn

    def take(self):
        c, self.calls = self.calls, []
        return c


def random_case(cfg: ModelConfig, seed: int = 0, block_size: int = 256):
    """A random tiny model: (nonrouted fp16 dict under HF names, list of uint8 (E, row_bytes) per layer, layout).
    Norm weights are 1 + noise (so a misplaced norm shows), router weights are large enough that routing
    has clear margins (fp16 vs fp32 rounding must not flip a top-k choice)."""
    g = torch.Generator().manual_seed(seed)
    C, M = hf_classes(cfg)
    names_shapes = {k: tuple(v.shape) for k, v in M(C(**cfg.to_hf_dict())).state_dict().items()}
    ours = {cfg.adapter.fused_layout_name(n): n for n in cfg.adapter.nonrouted_tensors(cfg)}  # stored under runmap's names
    H = cfg.hidden_size
    nonrouted = {}
    for name, shape in names_shapes.items():
        if ".mlp.experts." in name:
            continue
        if name.endswith("norm.weight"):
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("mlp.gate.weight"):
            t = torch.randn(shape, generator=g) * (3.0 / H ** 0.5)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name:
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        nonrouted[ours.get(name, name)] = t.to(torch.float16)
    layout = RowLayout.build(H, cfg.moe_intermediate_size, block_size)
    I = cfg.moe_intermediate_size
    rows = []
    for layer in range(cfg.num_layers):
        r = []
        for e in range(cfg.num_experts):
            w = {"gate": torch.randn(I, H, generator=g) / H ** 0.5, "up": torch.randn(I, H, generator=g) / H ** 0.5,
                 "down": torch.randn(H, I, generator=g) / I ** 0.5}
            r.append(layout.pack_expert(w, name=f"layer{layer}.expert{e}"))
        rows.append(torch.stack(r))  # (E, row_bytes)
    return nonrouted, rows, layout


PACK_PRESETS = ("tiny-olmoe", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral")
_PACKS: dict = {}


def build_packs(tmp_path_factory) -> dict:
    """{preset: pack dir} of the tiny synthetic checkpoints (runmap synth + runmap pack), built once per
    session even when several test modules ask (the result is memoized here)."""
    if not _PACKS:
        from runmap.arch.config import load_preset
        from runmap.format.pack import pack_checkpoint
        from runmap.synth.checkpoint import write_synthetic

        root = tmp_path_factory.mktemp("engine-packs")
        for name in PACK_PRESETS:
            cfg, _ = load_preset(name)
            ck = write_synthetic(cfg, root / f"ck-{name}", seed=3)
            pack_checkpoint(ck, root / f"pk-{name}", device="cpu")
            _PACKS[name] = root / f"pk-{name}"
    return dict(_PACKS)
