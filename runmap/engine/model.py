"""The whole model in one file: OLMoE and Qwen2-MoE decoder stacks over qpacked routed experts.

What runs where (docs/architecture.md#route-to-result):

* Non-routed path (embeddings, attention, norms, router, the Qwen shared expert and its gate, lm_head):
  FP16 weights. On CUDA every matmul is a true FP16 matmul (FP32 accumulation inside cuBLAS). On CPU,
  FP16 matmuls are slow and imprecise in torch, so there each matmul computes in FP32 from the FP16
  weights and rounds the result back to FP16: activations between ops are FP16 on both devices.
* RMSNorm, RoPE, softmax (attention and router) compute in FP32 and store FP16.
* Router logits are computed in FP32 from the FP16 router weight (a 64 x 2048 GEMV: negligible cost),
  so routing decisions match an FP32 reference as closely as possible; top-k is never renormalised
  unless the config says ``norm_topk_prob``.
* Routed experts are NOT computed here: every MoE layer calls ``experts(layer, x, topk_ids, topk_weights)``,
  which the engine wires to the expert cache and an executor (runmap.kernels.executors.moe_experts).

Architecture facts mirrored from transformers' modeling_olmoe / modeling_qwen2_moe:

* OLMoE: q_norm / k_norm are RMSNorms over the FULL projected q (H) and k (Hkv * D), applied before the
  heads are split and before RoPE. No biases. Router: softmax over experts, top-8.
* Qwen2-MoE: q/k/v projections have biases, o_proj has none. Shared expert = SiLU-gated MLP scaled by
  sigmoid(shared_expert_gate(x)) (a (1, H) weight), added to the routed output.
* RoPE: rotate-half convention, inv_freq = theta^(-2i/D), cos/sin of (position * inv_freq) duplicated.

KV cache layout: ``k``, ``v`` float16 (L, B, Hkv, S, D), written at slot indices given as a device tensor
(so a decode step can be captured in a CUDA graph); attention masks are built on the device from
``slots`` and per-row ``pad`` counts (left padding).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from runmap.arch.base import QK_NORM_PER_HEAD
from runmap.arch.config import ModelConfig

# experts(layer, x fp16 (N, H), topk_ids int64 (N, k), topk_weights fp32 (N, k)) -> fp16 (N, H)
ExpertsFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# The fused decode attention runs one program per (row, head) over the KV prefix: right for short
# prefixes; longer ones go to SDPA (at 4,096 keys the fused kernel measured 158 tok/s vs 486 with SDPA).
DECODE_ATTN_MAX_KEYS = 512


class ModelError(ValueError):
    """A pack is missing a non-routed tensor or a tensor has the wrong shape."""


# ---- numerics helpers --------------------------------------------------------------------------

def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x fp16 (..., K) @ w fp16 (N, K)^T (+ b fp16 (N,)) -> fp16 (..., N).
    CUDA: FP16 matmul. CPU: FP32 compute from the FP16 values, FP16 result (see module docstring)."""
    if x.is_cuda:
        return F.linear(x, w, b)
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def rides_shared(experts, n_rows: int = 1) -> bool:
    """Whether a routed-experts callback takes a shared expert of ``n_rows`` rows (``shared=``, computed in its
    launches): its ``rides_shared(n_rows)``, or that of the object a bound-method callback belongs to; False for a
    callback without one."""
    ask = getattr(experts, "rides_shared", None) or getattr(getattr(experts, "__self__", None), "rides_shared", None)
    return bool(ask is not None and ask(n_rows))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x fp16 (..., N), w fp16 (N,) -> fp16 (..., N); statistics in FP32.
    CUDA: torch's fused rms_norm (one launch; FP32 math inside for FP16 inputs)."""
    if x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., N) fp32
    return (y * w.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    """positions int64 (B, T), inv_freq fp32 (D/2,) -> cos, sin fp32 (B, 1, T, D)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x fp16 (B, nh, T, D), cos/sin fp32 (B, 1, T, D) -> fp16 (B, nh, T, D) (rotate-half form)."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rot = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)  # (B, nh, T, D)
    return (x32 * cos + rot * sin).to(x.dtype)


def route(h: torch.Tensor, router32: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """h fp16 (N, H), router32 fp32 (E, H) -> topk_ids int64 (N, k), topk_weights fp32 (N, k)."""
    logits = F.linear(h.float(), router32)  # (N, E) fp32
    probs = torch.softmax(logits, dim=-1)  # (N, E)
    w, ids = torch.topk(probs, top_k, dim=-1)  # (N, k), (N, k)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def imposed_weights(h: torch.Tensor, router32: torch.Tensor, ids: torch.Tensor, top_k: int,
                    norm_topk_prob: bool) -> torch.Tensor:
    """Gate weights of imposed expert ids: the router's own probabilities of ``ids``, rescaled so that they sum
    to what the router's own top-k weights sum to (1 under norm_topk_prob), keeping the routed output's scale.
    h fp16 (N, H), router32 fp32 (E, H), ids int64 (N, k) -> fp32 (N, k)."""
    probs = torch.softmax(F.linear(h.float(), router32), dim=-1)  # (N, E)
    w = probs.gather(1, ids)  # (N, k)
    own = 1.0 if norm_topk_prob else torch.topk(probs, top_k, dim=-1).values.sum(-1, keepdim=True)  # (N, 1)
    return w * (own / w.sum(-1, keepdim=True))


# ---- weights ----------------------------------------------------------------------------------

@dataclasses.dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (H,)
    qkv: torch.Tensor  # (nh*D + 2*nkv*D, H) fused q, k, v projections
    qkv_bias: torch.Tensor | None  # (nh*D + 2*nkv*D,) families with adapter.qkv_bias (Qwen2-MoE)
    o: torch.Tensor  # (H, nh*D)
    q_norm: torch.Tensor | None  # (nh*D,) whole-projection norm (OLMoE) or (D,) per-head norm; None without
    k_norm: torch.Tensor | None  # (nkv*D,) or (D,), like q_norm
    mlp_norm: torch.Tensor  # (H,)
    router32: torch.Tensor  # (E, H) fp32 copy of the fp16 router weight (see module docstring)
    shared_gate_up: torch.Tensor | None  # (2*Is, H) shared expert gate|up (routed+shared layers, Qwen2-MoE)
    shared_down: torch.Tensor | None  # (H, Is)
    shared_expert_gate: torch.Tensor | None  # (1, H)
    # (2*Is + 1, H): gate | up | shared_expert_gate in one tensor, of which the two above are views (the fused
    # one-token shared expert reads all three in one GEMV)
    shared_gate_up_gate: torch.Tensor | None = None


@dataclasses.dataclass
class Weights:
    embed: torch.Tensor  # (V, H)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (H,)
    lm_head: torch.Tensor  # (V, H) (the embedding when tied)
    inv_freq: torch.Tensor  # (D/2,) fp32

    def nbytes(self) -> int:
        seen, total = set(), 0
        tensors = [self.embed, self.final_norm, self.lm_head, self.inv_freq]
        for lw in self.layers:
            # fields, not dataclasses.astuple: astuple deep-copies every tensor (the whole model, on its device)
            views = ("shared_gate_up", "shared_expert_gate") if lw.shared_gate_up_gate is not None else ()
            tensors += [t for t in (getattr(lw, f.name) for f in dataclasses.fields(lw) if f.name not in views)
                        if isinstance(t, torch.Tensor)]  # the shared expert's views of shared_gate_up_gate: once
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def nonrouted_names(cfg: ModelConfig) -> list[str]:
    """The HF tensor names the model needs from a pack (lm_head omitted when tied), as the family's
    adapter names them (runmap/arch/<family>.py)."""
    return list(cfg.adapter.nonrouted_tensors(cfg))


def load_weights(get: Callable[[str], torch.Tensor], cfg: ModelConfig, device) -> Weights:
    """Build ``Weights`` from ``get(hf_name) -> fp16 tensor`` (e.g. PackReader.nonrouted).
    Tensors are found by role in the adapter's inventory (names and shapes); each is checked for dtype
    and shape; fused tensors (qkv, shared gate|up) are built on device. A dense layer is refused
    (UnsupportedLayerError naming it): the forward pass runs routed MoE layers only."""
    adapter = cfg.adapter
    adapter.require_routed_layers(cfg, "runmap engine")
    D = cfg.head_dim

    def t(named, role):
        name, shape = named[role]
        x = get(name)
        if x.dtype != torch.float16:
            raise ModelError(f"{name}: expected float16, got {x.dtype}")
        if tuple(x.shape) != tuple(shape):
            raise ModelError(f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}")
        return x.to(device)

    def opt(named, role):
        return t(named, role) if role in named else None

    layers = []
    for i in range(cfg.num_layers):
        lt = adapter.layer_tensors(cfg, i)
        qkv = torch.cat([t(lt, "q_proj"), t(lt, "k_proj"), t(lt, "v_proj")], dim=0)  # (nh*D + 2*nkv*D, H)
        qkv_bias = None
        if cfg.qkv_bias:
            qkv_bias = torch.cat([t(lt, "q_bias"), t(lt, "k_bias"), t(lt, "v_bias")])  # (nh*D + 2*nkv*D,)
        sg = sd = sgate = sgug = None
        if "shared_gate" in lt:
            sgug = torch.cat([t(lt, "shared_gate"), t(lt, "shared_up"), t(lt, "shared_expert_gate")])  # (2*Is + 1, H)
            sg, sgate = sgug[:-1], sgug[-1:]  # (2*Is, H), (1, H) views
            sd = t(lt, "shared_down")
        layers.append(LayerWeights(
            attn_norm=t(lt, "attn_norm"),
            qkv=qkv, qkv_bias=qkv_bias,
            o=t(lt, "o_proj"),
            q_norm=opt(lt, "q_norm"),
            k_norm=opt(lt, "k_norm"),
            mlp_norm=t(lt, "mlp_norm"),
            router32=t(lt, "router").float(),
            shared_gate_up=sg, shared_down=sd, shared_expert_gate=sgate, shared_gate_up_gate=sgug,
        ))
    head, tail = adapter.head_tensors(cfg), adapter.tail_tensors(cfg)
    embed = t(head, "embed")
    lm_head = embed if cfg.tie_word_embeddings else t(tail, "lm_head")
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
    return Weights(embed, layers, t(tail, "final_norm"), lm_head, inv_freq)


# ---- KV cache -----------------------------------------------------------------------------------

class KVCache:
    """Preallocated keys and values: float16 (L, B, Hkv, S, D) each, allocated once per engine."""

    def __init__(self, cfg: ModelConfig, max_batch: int, max_seq_len: int, device, dtype=torch.float16):
        shape = (cfg.num_layers, max_batch, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def rows(self, lo: int, hi: int) -> "KVCache":
        """A view of rows [lo, hi) as a cache of hi - lo rows (no copy): a pass over it writes those rows."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, lo:hi], self.v[:, lo:hi]  # (L, hi - lo, Hkv, S, D) views
        view.max_batch, view.max_seq_len = hi - lo, self.max_seq_len
        return view


def attention_mask(slots: torch.Tensor, pad: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Boolean mask (B, 1, T, n_keys): query at slot s of row b sees key slot j iff pad[b] <= j <= s.
    A padding query (s < pad[b]) sees only itself, so its softmax is never empty (its output is unused).
    slots int64 (T,) query slots, pad int64 (B,) left-padding counts."""
    j = torch.arange(n_keys, device=slots.device)  # (S,)
    causal = j[None, :] <= slots[:, None]  # (T, S)
    valid = j[None, :] >= pad[:, None]  # (B, S)
    m = causal[None] & valid[:, None, :]  # (B, T, S)
    m = m | (j[None, None, :] == slots[None, :, None])  # (B, T, S) every query sees its own slot
    return m.unsqueeze(1)


def run_pieces(pieces):
    """Run a pass that yields between its pieces (``Transformer.forward_pieces``, ``Engine.prefill_pieces``) to its
    end; returns what it returns."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def _sdpa_backends_without_cudnn():
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# ---- the model --------------------------------------------------------------------------------

class Transformer:
    """Decoder stack for OLMoE / Qwen2-MoE. Stateless apart from the weights; the KV cache and the
    routed-experts function are passed in, so the engine owns residency and CUDA graphs."""

    def __init__(self, cfg: ModelConfig, weights: Weights):
        cfg.adapter.require_routed_layers(cfg, "Transformer")  # dense layers have no forward path yet
        self.cfg, self.w = cfg, weights
        # q/k norm over each head (width D) instead of over the whole projection; the fused prologue
        # kernel implements only the whole-projection form
        self.per_head_qk_norm = cfg.qk_norm_kind == QK_NORM_PER_HEAD
        self.route_log: list | None = None  # set to [] to record (layer, topk_ids cpu) per MoE call
        # Routing workloads (runmap.workload.routing): imposed int64 (L, n, k) device ids replace the router's
        # top-k of the n routed rows of the next forward pass (the router still runs and weighs them);
        # route_sink(layer, ids) sees every MoE layer's ids (device tensors, no host sync) for route traces.
        self.imposed: torch.Tensor | None = None
        # with next-layer prefetch under a routing workload: the workload's prediction of the same rows' ids, int64
        # (L, n, k) device (-1 = none), made from each stream's past before its step was drawn (ImposedRouting)
        self.imposed_pred: torch.Tensor | None = None
        self.route_sink: Callable[[int, torch.Tensor], None] | None = None
        # CUDA only: which fused Triton ops (runmap.kernels.fused_ops) replace torch sequences; empty = pure torch.
        # "prologue": q/k norm + RoPE + KV write; "norm": residual add + RMSNorm; "router": logits + softmax
        # + top-k; "attn": decode attention (T = 1); "gemv": the q|k|v and o projections of a single token.
        # Together in a decode step: "prologue" + "attn" run as one launch, "norm" + "router" as one (and top-k).
        # "imposed" (with "router"): a routing workload's gate weights from those logits in one launch.
        # "shared": a shared expert of several rows in two launches between its two GEMMs; with "gemv" one token's rides
        # in the grouped executor's launches where the experts callback takes it (rides_shared), else "gemv"'s two
        self.fused: frozenset = frozenset()
        # CUDA prefill without grouped KV heads (OLMoE): the scaled_dot_product_attention backends torch may pick from
        # (None: all of torch's). cuDNN attention is left out: it builds an execution plan for every new shape
        # (PyTorch caches it), and a server meets a new shape -- rows x longest prompt -- at most joins
        # (results/serve/probe/). Families with grouped heads keep torch's choice (not measured)
        self.sdpa_backends = _sdpa_backends_without_cudnn()

    def _fused_router(self) -> bool:
        return "router" in self.fused and self.cfg.top_k & (self.cfg.top_k - 1) == 0  # kernels tile k as a power of 2

    def _fused_imposed(self) -> bool:
        """Imposed ids' gate weights in one launch on the fused router's logits (fused op "imposed"), instead of
        ``imposed_weights``' torch ops (~7 launches per MoE layer)."""
        return "imposed" in self.fused and self._fused_router()

    def moe_block(self, layer: int, h: torch.Tensor, experts: ExpertsFn, token_rows: torch.Tensor | None,
                  logits: torch.Tensor | None = None):
        """h fp16 (N, H) -> fp16 (N, H). token_rows int64 (n,), ascending: the rows that are routed (padding
        rows are left out of the batch union and get a zero routed output); None = all rows. (Indices, not a
        boolean mask: a mask's selection waits for the device to count its rows, once per layer.)
        logits: fp32 (N, E) router logits of h already computed (fused with the norm; token_rows None only)."""
        cfg, lw = self.cfg, self.w.layers[layer]
        hr = h if token_rows is None else h.index_select(0, token_rows)  # (n, H)
        if self.imposed is not None:
            ids = self.imposed[layer]  # (n, k) int64: the workload's experts for these rows
            if self._fused_imposed():  # one launch on the logits (the fused norm's, or the router kernel's)
                from runmap.kernels.fused_ops import imposed_weights_from_logits, router_logits

                if logits is None:
                    logits = router_logits(hr.contiguous(), lw.router32)  # (n, E) fp32
                gw = imposed_weights_from_logits(logits, ids.contiguous(), cfg.top_k, cfg.norm_topk_prob)  # (n, k)
            else:
                gw = imposed_weights(hr, lw.router32, ids, cfg.top_k, cfg.norm_topk_prob)  # (n, k) fp32
        elif logits is not None:
            from runmap.kernels.fused_ops import route_topk

            ids, gw = route_topk(logits, cfg.top_k, cfg.norm_topk_prob)  # (n, k) each
        elif self._fused_router():
            from runmap.kernels.fused_ops import route_fused

            ids, gw = route_fused(hr.contiguous(), lw.router32, cfg.top_k, cfg.norm_topk_prob)  # (n, k) each
        else:
            ids, gw = route(hr, lw.router32, cfg.top_k, cfg.norm_topk_prob)  # (n, k) each
        if self.route_log is not None:
            self.route_log.append((layer, ids.cpu()))
        if self.route_sink is not None:
            self.route_sink(layer, ids)
        if token_rows is None and lw.shared_gate_up_gate is not None and {"gemv", "shared"} <= self.fused \
                and h.shape[0] == 1 and rides_shared(experts):
            from runmap.kernels.grouped import SharedExpert

            # one token: the shared expert's programs ride in the routed launches (runmap.kernels.grouped.SharedExpert)
            x = h.contiguous()  # (1, H): hr is h here (no token_rows)
            return experts(layer, x, ids, gw, shared=SharedExpert(x, lw.shared_gate_up_gate, lw.shared_down))
        y = experts(layer, hr.contiguous(), ids, gw)  # (n, H) fp16
        if token_rows is not None:
            y = torch.zeros_like(h).index_copy_(0, token_rows, y)  # (N, H)
        if lw.shared_gate_up_gate is not None and "gemv" in self.fused and h.shape[0] == 1:
            from runmap.kernels.fused_ops import shared_expert_one_row

            return shared_expert_one_row(h, lw.shared_gate_up_gate, lw.shared_down, y)  # (1, H): two launches
        if lw.shared_gate_up is not None and "shared" in self.fused:
            from runmap.kernels.fused_ops import shared_gate_add, silu_mul_rows

            s = linear(silu_mul_rows(linear(h, lw.shared_gate_up)), lw.shared_down)  # (N, H): two GEMMs, one launch
            return shared_gate_add(h, lw.shared_expert_gate, s, y.contiguous())  # (N, H): gate, product, sum
        if lw.shared_gate_up is not None:
            gu = linear(h, lw.shared_gate_up)  # (N, 2*Is)
            g, u = gu.chunk(2, dim=-1)
            s = linear((F.silu(g.float()) * u.float()).to(h.dtype), lw.shared_down)  # (N, H)
            gate = torch.sigmoid(linear(h, lw.shared_expert_gate).float())  # (N, 1) fp32
            y = (y.float() + gate * s.float()).to(h.dtype)
        return y

    def _proj(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """A dense attention projection: the fused one-row GEMV for a single token ("gemv"), ``linear`` otherwise."""
        if "gemv" in self.fused and x.numel() == x.shape[-1]:
            from runmap.kernels.fused_ops import gemv

            return gemv(x, w, b)
        return linear(x, w, b)

    def attention(self, layer, h, positions, rope, kv: KVCache, slots, pad, mask, n_keys):
        """h fp16 (B, T, H) -> fp16 (B, T, H); writes k, v at ``slots`` (int64 (T,)) of rows 0..B-1.
        rope: (cos, sin) fp32 (B, 1, T, D) for the torch prologue; mask: bool (B, 1, T, n_keys), or None for
        plain causal attention (prefill from slot 0 without padding)."""
        lw = self.w.layers[layer]
        qkv = self._proj(h, lw.qkv, lw.qkv_bias)  # (B, T, (nh + 2 nkv) D)
        o = self._attend(layer, qkv, positions, rope, kv, slots, pad, mask, n_keys)  # (B, T, nh*D)
        return self._proj(o, lw.o)

    def _attend(self, layer, qkv, positions, rope, kv: KVCache, slots, pad, mask, n_keys):
        """The attention between the projections: qkv fp16 (B, T, (nh + 2 nkv) D) -> o fp16 (B, T, nh*D), before the
        output projection; q/k norm, RoPE and the KV write at ``slots`` of rows 0..B-1 of ``kv`` included (arguments
        as ``attention``)."""
        cfg, lw = self.cfg, self.w.layers[layer]
        B, T, _ = qkv.shape
        nh, nkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kc, vc = kv.k[layer, :B], kv.v[layer, :B]  # (B, nkv, S, D) views
        decode_attn = T == 1 and "attn" in self.fused and n_keys <= DECODE_ATTN_MAX_KEYS
        if "prologue" in self.fused and self.per_head_qk_norm:
            raise ModelError(f"{cfg.arch}: the fused 'prologue' op normalizes q/k over the whole projection; "
                             "this family normalizes per head (leave 'prologue' out of Transformer.fused)")
        if decode_attn and "prologue" in self.fused and D & (D - 1) == 0:
            from runmap.kernels.fused_ops import decode_attention_with_prologue

            # the prologue folded into the attention launch (a power-of-two head dim: both real families use 128)
            return decode_attention_with_prologue(qkv, lw.q_norm, lw.k_norm, positions, slots, self.w.inv_freq, kc,
                                                  vc, pad, n_keys, num_heads=nh, num_kv_heads=nkv,
                                                  eps=cfg.rms_norm_eps)  # (B, 1, nh*D)
        if "prologue" in self.fused:
            from runmap.kernels.fused_ops import qk_norm_rope_kv

            q = qk_norm_rope_kv(qkv, lw.q_norm, lw.k_norm, positions, slots, self.w.inv_freq, kc, vc,
                                num_heads=nh, num_kv_heads=nkv, eps=cfg.rms_norm_eps)  # (B, nh, T, D)
        else:
            q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
            if lw.q_norm is not None and self.per_head_qk_norm:  # RMSNorm of width D over each head, before RoPE
                q = rms_norm(q.reshape(B, T, nh, D), lw.q_norm, cfg.rms_norm_eps).reshape(B, T, nh * D)
                k = rms_norm(k.reshape(B, T, nkv, D), lw.k_norm, cfg.rms_norm_eps).reshape(B, T, nkv * D)
            elif lw.q_norm is not None:  # OLMoE: RMSNorm over the whole projection, before head split and RoPE
                q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
            q = q.reshape(B, T, nh, D).transpose(1, 2)  # (B, nh, T, D)
            k = k.reshape(B, T, nkv, D).transpose(1, 2)  # (B, nkv, T, D)
            v = v.reshape(B, T, nkv, D).transpose(1, 2)
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc.index_copy_(2, slots, k)
            vc.index_copy_(2, slots, v)
        if decode_attn:
            from runmap.kernels.fused_ops import decode_attention

            return decode_attention(q.contiguous(), kc, vc, slots, pad, n_keys)  # (B, 1, nh*D)
        keys, vals = kc[:, :, :n_keys], vc[:, :, :n_keys]  # (B, nkv, n_keys, D)
        gqa = nkv != nh
        if q.is_cuda:
            with self._sdpa_backends(T, gqa):
                if mask is None and T == n_keys:  # prefill from slot 0 without padding: plain causal (flash)
                    o = F.scaled_dot_product_attention(q, keys, vals, is_causal=True, enable_gqa=gqa)
                elif mask is None:
                    # a later chunk of an unpadded prefill: its T queries are the last T of n_keys keys, so the
                    # causal diagonal is aligned to the lower right; torch's CausalBias runs that in the flash
                    # kernel instead of materializing a (T, n_keys) mask for the memory-efficient one (3.4x on
                    # the H200 at 8,192 tokens in chunks of 1,024: results/campaigns/h200-floor)
                    o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=causal_lower_right(T, n_keys))
                else:
                    o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=gqa)
        else:
            if mask is None:
                mask = attention_mask(slots, torch.zeros(B, dtype=torch.long), n_keys)
            o = F.scaled_dot_product_attention(q.float(), keys.float(), vals.float(), attn_mask=mask,
                                               enable_gqa=gqa).to(qkv.dtype)
        return o.transpose(1, 2).reshape(B, T, nh * D)  # (B, T, nh*D)

    def _sdpa_backends(self, T: int, gqa: bool):
        """The backends context of a CUDA attention call over T new tokens per row: ``sdpa_backends`` for a prefill
        pass without grouped KV heads; torch's own choice otherwise (a decode step keeps it, and with grouped heads
        and a mask the backends left would be the math one only: torch's memory-efficient kernel takes no GQA)."""
        if self.sdpa_backends is None or T == 1 or gqa:
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self.sdpa_backends)

    @staticmethod
    def _last(h: torch.Tensor, last_position: torch.Tensor | None) -> torch.Tensor:
        """h (B, T, H) -> (B, H) at position T - 1, or at ``last_position`` (int64 (1,) device; no host read)."""
        if last_position is None:
            return h[:, -1]
        return h.index_select(1, last_position).squeeze(1)

    def forward(self, tokens, positions, kv: KVCache, slots, pad, n_keys: int, experts: ExpertsFn, *,
                token_rows=None, causal_fresh=False, all_logits=False, last_position=None):
        """One forward pass over T new tokens per row (``forward_pieces`` run to its end; arguments there)."""
        return run_pieces(self.forward_pieces(tokens, positions, kv, slots, pad, n_keys, experts, token_rows=token_rows,
                                              causal_fresh=causal_fresh, all_logits=all_logits,
                                              last_position=last_position))

    def forward_pieces(self, tokens, positions, kv: KVCache, slots, pad, n_keys: int, experts: ExpertsFn, *,
                       token_rows=None, causal_fresh=False, all_logits=False, last_position=None):
        """One forward pass over T new tokens per row, as a generator that yields (None) after each layer's work
        is queued and returns the logits: a caller can run other work between layers (a server's decode steps
        between the layers of a joining request's prefill). Nothing here holds state across a yield but its
        own tensors.

        tokens     int64 (B, T) token ids (any id at padding positions)
        positions  int64 (B, T) RoPE positions (per row: slot - pad)
        kv         KVCache; rows 0..B-1 used, new keys written at ``slots``
        slots      int64 (T,) KV slots of the new tokens (same for every row: left padding)
        pad        int64 (B,) left-padding count of each row
        n_keys     attend to KV slots [0, n_keys) (>= max(slots) + 1); a Python int
        experts    routed-experts function (see ExpertsFn)
        token_rows int64 (n,) ascending: the rows of the (B*T) positions routed to experts (None = all)
        causal_fresh  True when no row is padded and slots are the last T of the n_keys (n_keys-T .. n_keys-1):
                   causal attention without a mask (flash), aligned to the lower right for a later chunk
        all_logits return logits for every position (B, T, V) instead of the last (B, V)
        last_position int64 (1,) device: the position whose logits are returned instead of T - 1 (a captured
                   prefill pass padded on the right, runmap.engine.prefill_graph)
        returns    float32 logits
        """
        cfg, w = self.cfg, self.w
        B, T = tokens.shape
        x = w.embed[tokens]  # (B, T, H) fp16
        rope = None if "prologue" in self.fused else rope_cos_sin(positions, w.inv_freq)  # (B, 1, T, D) x2
        # a later chunk with grouped KV heads keeps the mask: CausalBias's flash route takes no grouped heads
        causal = causal_fresh and (T == n_keys or cfg.num_kv_heads == cfg.num_heads)
        need_mask = not causal and not (T == 1 and "attn" in self.fused and n_keys <= DECODE_ATTN_MAX_KEYS)
        mask = attention_mask(slots, pad, n_keys) if need_mask else None  # (B, 1, T, n_keys), once per pass

        def attention(layer, h):  # h fp16 (B, T, H) -> (B, T, H)
            return self.attention(layer, h, positions, rope, kv, slots, pad, mask, n_keys)

        t, normed = yield from self._decoder_layers(x, attention, experts, token_rows)
        # (B, V): only the last position is sampled from; (B, T, V) with all_logits
        return self._logits(t, normed, (lambda t: t) if all_logits else (lambda t: self._last(t, last_position)))

    def _decoder_layers(self, x, attention, experts: ExpertsFn, token_rows):
        """The decoder layers over the pass's embeddings x fp16 (..., H), as a generator that yields after each layer's
        work is queued. attention(layer, h) -> fp16 shaped like h: the pass's attention over its normed input. Returns
        (t, normed): with the fused norm ("norm") the final-normed hidden states (normed True), otherwise the residual
        stream, which ``_logits`` normalizes after selecting the rows sampled from (normed False)."""
        w, eps, H = self.w, self.cfg.rms_norm_eps, x.shape[-1]
        if "norm" in self.fused:
            from runmap.kernels.fused_ops import NORM_ROUTER_MAX_ROWS, add_norm_router_logits, add_rms_norm

            norms = [lw.attn_norm for lw in w.layers] + [w.final_norm]
            _, h = add_rms_norm(x, None, norms[0], eps)
            # decode steps: the router's logits come out of the norm's launch (fused_ops.add_norm_router_logits)
            norm_router = (self._fused_router() and (self.imposed is None or self._fused_imposed())
                           and token_rows is None and x.numel() // H <= NORM_ROUTER_MAX_ROWS)
            for layer, lw in enumerate(w.layers):
                a = attention(layer, h)
                logits = None
                if norm_router:
                    x, h, logits = add_norm_router_logits(x, a, lw.mlp_norm, lw.router32, eps)  # ..., (rows, E)
                else:
                    x, h = add_rms_norm(x, a, lw.mlp_norm, eps)
                y = self.moe_block(layer, h.reshape(-1, H), experts, token_rows, logits).reshape(h.shape)
                x, h = add_rms_norm(x, y, norms[layer + 1], eps)  # next layer's input norm, or the final norm
                yield
            return h, True
        for layer, lw in enumerate(w.layers):
            x = x + attention(layer, rms_norm(x, lw.attn_norm, eps))
            h = rms_norm(x, lw.mlp_norm, eps).reshape(-1, H)  # (rows, H)
            x = x + self.moe_block(layer, h, experts, token_rows).reshape(x.shape)
            yield
        return x, False

    def _logits(self, t, normed: bool, select) -> torch.Tensor:
        """float32 logits of the rows ``select(t)`` picks from ``_decoder_layers``' result (t, normed)."""
        t = select(t)
        if not normed:
            t = rms_norm(t, self.w.final_norm, self.cfg.rms_norm_eps)
        return linear(t, self.w.lm_head).float()

    def forward_mixed(self, dec_tok, dec_pos, slot, dec_pad, join_tok, join_pos, join_slots, join_pad, kv: KVCache,
                      join_row: int, n_keys: int, experts: ExpertsFn):
        """A decode step of Bd rows and a joining prompt's prefill as one pass (a server's mixed join): every dense
        projection, norm, router and routed-experts call runs once over the N = Bd + Pb tokens of both, so the
        weights are read once for the two; only attention runs apart, each part with its own rows, slots and mask.

        dec_tok    int64 (Bd, 1)  the running rows' tokens, written at KV slot ``slot`` of rows 0..Bd-1
        dec_pos    int64 (Bd, 1)  their RoPE positions (slot - dec_pad)
        slot       int64 (1,)     the step's shared KV slot
        dec_pad    int64 (Bd,)    the running rows' left padding
        join_tok   int64 (1, Pb)  the joining prompt, left-padded so that its last token lands at ``slot``
        join_pos   int64 (1, Pb)  its RoPE positions (0.. for the prompt; padding positions clamped to 0)
        join_slots int64 (Pb,)    its KV slots, slot - Pb + 1 .. slot, in row ``join_row`` of ``kv``
        join_pad   int64 (1,)     its left padding (slot + 1 - prompt length): the mask hides slots below it
        n_keys     both parts attend KV slots [0, n_keys) (> slot); a Python int
        returns    float32 logits (Bd + 1, V): the running rows' next tokens and the prompt's first
        Every position is routed (the prompt's left padding too: a graph cannot select a data-dependent row count);
        padding rows' outputs are never read, and their keys sit below the row's pad."""
        w = self.w
        Bd, Pb = dec_tok.shape[0], join_tok.shape[1]
        N = Bd + Pb
        x = w.embed[torch.cat([dec_tok.reshape(-1), join_tok.reshape(-1)])]  # (N, H) fp16
        kv_join = kv.rows(join_row, join_row + 1)
        rope_dec = rope_join = None
        if "prologue" not in self.fused:
            rope_dec = rope_cos_sin(dec_pos, w.inv_freq)  # (Bd, 1, 1, D) x2
            rope_join = rope_cos_sin(join_pos, w.inv_freq)  # (1, 1, Pb, D) x2
        fused_decode_attn = "attn" in self.fused and n_keys <= DECODE_ATTN_MAX_KEYS
        mask_dec = None if fused_decode_attn else attention_mask(slot, dec_pad, n_keys)  # (Bd, 1, 1, n_keys)
        mask_join = attention_mask(join_slots, join_pad, n_keys)  # (1, 1, Pb, n_keys)

        def attention(layer, h):  # h fp16 (N, H) -> fp16 (N, H)
            lw = w.layers[layer]
            qkv = linear(h, lw.qkv, lw.qkv_bias)  # (N, (nh + 2 nkv) D): one read of the weights for both parts
            o_dec = self._attend(layer, qkv[:Bd].view(Bd, 1, -1), dec_pos, rope_dec, kv, slot, dec_pad, mask_dec,
                                 n_keys)  # (Bd, 1, nh*D)
            o_join = self._attend(layer, qkv[Bd:].view(1, Pb, -1), join_pos, rope_join, kv_join, join_slots,
                                  join_pad, mask_join, n_keys)  # (1, Pb, nh*D)
            return linear(torch.cat([o_dec.reshape(Bd, -1), o_join.reshape(Pb, -1)]), lw.o)  # (N, H)

        def last(t):  # (N, H) -> (Bd + 1, H): the rows sampled from, every running row and the prompt's last position
            return torch.cat([t[:Bd], t[N - 1:]])  # slices: no index tensor to copy in (a graph captures this)

        t, normed = run_pieces(self._decoder_layers(x, attention, experts, None))
        return self._logits(t, normed, last)  # (Bd + 1, V)


# ---- torch reference for routed experts (tests and the fp16 baseline) -----------------------------

def experts_dense_torch(x: torch.Tensor, ids: torch.Tensor, gw: torch.Tensor, get_expert) -> torch.Tensor:
    """Routed experts by plain torch, one routed expert at a time (one host sync per call; not for CUDA graphs).

    x fp16 (N, H), ids int64 (N, k), gw fp32 (N, k),
    get_expert(e) -> (gate (I, H), up (I, H), down (H, I)) float tensors on x.device.
    Returns fp16 (N, H); accumulation in FP32 (dtype of the expert weights decides the matmul dtype)."""
    n, k = ids.shape
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (N, H)
    flat = ids.reshape(-1)  # (N*k,) pair p = (row p // k, slot p % k)
    order = torch.argsort(flat, stable=True)  # (N*k,) pairs grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    rows_sorted = order // k  # (N*k,)
    w_sorted = gw.reshape(-1)[order]  # (N*k,)
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):  # the one host sync
        rows, w = rows_sorted[start:start + c], w_sorted[start:start + c]  # (c,), (c,)
        start += c
        g, u, d = get_expert(e)
        xe = x[rows].to(g.dtype)  # (c, H)
        a = F.silu(F.linear(xe, g).float()) * F.linear(xe, u).float()  # (c, I) fp32
        y = F.linear(a.to(d.dtype), d).float()  # (c, H)
        out.index_add_(0, rows, y * w[:, None])
    return out.to(x.dtype)
