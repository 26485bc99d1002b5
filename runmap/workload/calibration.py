"""The calibrated routing workload: a seeded stochastic routing model per layer, fitted to published cache
hit rates of trained models (docs/routing-workloads.md gives the sources, the fit and its residuals).

The model of one layer, for one sequence of tokens (a stream):

* **popularity**: each expert e has a weight ``p_e = exp(sigma * z_e)``, z_e ~ N(0, 1) drawn once per layer
  (trained routers are load-balanced but not uniform; ``sigma`` sets the spread);
* **reuse**: each expert of the previous token's top-k is kept by the next token with probability ``reuse``
  (consecutive tokens share experts: the local routing consistency that caches live on);
* **recall**: of the remaining slots, Binomial(slots, ``recall``) are drawn by popularity among the experts
  used in the last ``window`` tokens (a segment's topic keeps a working set), the rest by popularity among all;
* no expert twice in one token (draws are without replacement, Gumbel-top-k over log popularity).

Parameters are dimensionless, so a family's parameters apply to a checkpoint of any size; they were fitted at
the family's real expert count and top-k (``FAMILIES``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from runmap.workload import replay

# arXiv 2505.16056 (Liang et al., "Not All Models Suit Expert Offloading"), figures made by its released code
# (github.com/ljcleo/moe-lrc): LRU hit rates on 512-token text samples, one cache budget shared by all
# layers, expressed here per layer (cached experts per layer -> hit rate). Per-layer caches score ~0.02-0.04
# lower in the same source. Only these points are read from the source; other cache sizes are predictions.
PUBLISHED_LRU = {
    "olmoe": {16: 0.61, 32: 0.83},
    "qwen2_moe": {16: 0.43, 30: 0.66},
    "mixtral": {4: 0.61},
    "qwen3_moe": {32: 0.83, 64: 0.97},
}
PUBLISHED_BELADY = {"olmoe": {16: 0.79, 32: 0.93}}
PUBLISHED_SOURCE = ("arXiv 2505.16056 (Liang et al.), LRU / Belady hit-rate figures of github.com/ljcleo/moe-lrc; "
                    "512-token samples, shared cache budget across layers")
SEQUENCE_TOKENS = 512  # the published measurements' sample length
TOLERANCE = 0.03  # the fit's allowed residual at every published point


@dataclasses.dataclass(frozen=True)
class RoutingParams:
    """One family's routing model (module docstring)."""
    sigma: float  # spread of log expert popularity
    reuse: float  # probability that an expert of the previous token is routed again
    recall: float  # probability that a new slot reuses an expert of the recent window
    window: int  # tokens of the recent window


@dataclasses.dataclass(frozen=True)
class Family:
    num_experts: int
    top_k: int
    params: RoutingParams


# Fitted by tools/explore/fit_routing.py (seeds 0..7, 16 layers, 512-token streams); residuals in
# docs/routing-workloads.md and checked by tests/test_routing_workload.py.
FAMILIES: dict[str, Family] = {
    "olmoe": Family(64, 8, RoutingParams(sigma=0.984, reuse=0.308, recall=0.265, window=16)),
    "qwen2_moe": Family(60, 4, RoutingParams(sigma=0.035, reuse=0.189, recall=0.233, window=16)),
    "mixtral": Family(8, 2, RoutingParams(sigma=0.44, reuse=0.179, recall=0.117, window=64)),
    "qwen3_moe": Family(128, 8, RoutingParams(sigma=1.221, reuse=0.54, recall=0.671, window=64)),
}


def family_params(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown calibrated routing family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


class StreamSampler:
    """The routing model of one stream, every layer at once: ``next()`` draws the next token's top-k ids of all
    layers, int64 (L, k). Vectorised over layers (a decode step of OLMoE's 16 layers costs tens of
    microseconds of host time): fresh draws without replacement are Gumbel-top-k over log popularity."""

    def __init__(self, params: RoutingParams, popularity: np.ndarray, top_k: int, rng: np.random.Generator):
        L, E = popularity.shape
        if not 1 <= top_k <= E:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={E}]")
        self.p, self.L, self.E, self.k, self.rng = params, L, E, top_k, rng
        self.logw = np.log(popularity)  # (L, E)
        self.prev: np.ndarray | None = None  # (L, k)
        self.recent = np.zeros((params.window, L, E), dtype=bool)  # ring of the last tokens' experts
        self.t = 0

    def _pick(self, allowed: np.ndarray, n: np.ndarray) -> np.ndarray:
        """bool (L, E): for each layer l, n[l] experts among ``allowed`` drawn by popularity without replacement."""
        keys = self.logw - np.log(-np.log(self.rng.random((self.L, self.E))))  # log w + Gumbel noise
        keys[~allowed] = -np.inf
        order = np.argsort(-keys, axis=1)  # (L, E) best first
        n = np.minimum(n, allowed.sum(1))
        take = np.arange(self.E)[None, :] < n[:, None]  # (L, E) the first n[l] of each row
        out = np.zeros((self.L, self.E), dtype=bool)
        np.put_along_axis(out, order, take, axis=1)
        return out

    def predict(self) -> np.ndarray:
        """int64 (L, k): per layer the k experts most likely in the next draw, from this stream's past and the model's
        parameters only (no random draw, so a prediction never changes the routes). Each expert is scored by an
        approximation of its chance to be drawn: an expert of the previous token ``reuse + (1 - reuse) q_e``, any
        other ``q_e``, where ``q_e`` spreads the expected fresh slots ``k (1 - reuse)`` by popularity, the ``recall``
        share over the recent window's experts and the rest over all, each pool's weight less the expected weight of
        the kept experts (each term capped at 1). Before the first token: the most popular.
        What this cannot see is what a next-layer router would: the token's own hidden state (the model has no
        cross-layer signal), so it predicts mostly the previous token's experts."""
        p, k = self.p, self.k
        w = np.exp(self.logw)  # (L, E) popularity
        kept = np.zeros(w.shape, dtype=bool)
        if self.prev is not None:
            np.put_along_axis(kept, self.prev, True, axis=1)
        reuse = p.reuse if self.prev is not None else 0.0
        fresh = k * (1.0 - reuse)  # expected slots not kept from the previous token
        held = reuse * np.where(kept, w, 0.0)  # expected weight the kept experts take out of the fresh draws
        recall = p.recall if self.t else 0.0
        q = np.minimum(1.0, fresh * (1.0 - recall) * w / (w.sum(1, keepdims=True) - held.sum(1, keepdims=True)))
        if self.t:
            win = self.recent[:min(self.t, p.window)].any(0)  # (L, E)
            ww = np.where(win, w, 0.0)
            rest = np.maximum(ww.sum(1, keepdims=True) - np.where(win, held, 0.0).sum(1, keepdims=True), 1e-300)
            q = np.minimum(1.0, q + np.minimum(1.0, fresh * recall * ww / rest))
        score = np.where(kept, reuse + (1.0 - reuse) * q, q)
        return np.argsort(-score, axis=1, kind="stable")[:, :k].astype(np.int64)  # (L, k) most likely first

    def next(self) -> np.ndarray:
        L, k, rng, p = self.L, self.k, self.rng, self.p
        chosen = np.zeros((L, self.E), dtype=bool)
        if self.prev is not None:
            keep = rng.random((L, k)) < p.reuse  # (L, k)
            rows = np.repeat(np.arange(L)[:, None], k, axis=1)
            chosen[rows[keep], self.prev[keep]] = True
        need = k - chosen.sum(1)  # (L,)
        if self.t:
            pool = self.recent[:min(self.t, p.window)].any(0) & ~chosen  # (L, E) used lately, not yet taken
            chosen |= self._pick(pool, rng.binomial(need, p.recall))
        chosen |= self._pick(~chosen, k - chosen.sum(1))
        ids = np.argsort(~chosen, axis=1, kind="stable")[:, :k]  # (L, k) the chosen ids, ascending
        self.prev = ids
        self.recent[self.t % p.window] = chosen
        self.t += 1
        return ids


def popularity(params: RoutingParams, num_experts: int, rng: np.random.Generator) -> np.ndarray:
    """float64 (E,) expert popularity of one layer, summing to 1."""
    w = np.exp(params.sigma * rng.standard_normal(num_experts))
    return w / w.sum()


def simulate(params: RoutingParams, num_experts: int, top_k: int, *, layers: int = 16,
             tokens: int = SEQUENCE_TOKENS, streams: int = 4, seed: int = 0) -> list[list[list[int]]]:
    """Routes of ``streams`` independent sequences: a list (layer, stream) of step lists, each step one token's
    experts (the layout replay.hit_rate takes; each stream replays from an empty cache)."""
    rng = np.random.default_rng(seed)
    pop = np.stack([popularity(params, num_experts, rng) for _ in range(layers)])  # (L, E)
    out = []
    for _ in range(streams):
        s = StreamSampler(params, pop, top_k, rng)
        steps = np.stack([s.next() for _ in range(tokens)])  # (T, L, k)
        out += [steps[:, layer].tolist() for layer in range(layers)]
    return out


def lru_curve(params: RoutingParams, num_experts: int, top_k: int, capacities, *, policy: str = "lru",
              **kw) -> dict[int, float]:
    """Hit rate of the model at each cache size (experts per layer)."""
    routes = simulate(params, num_experts, top_k, **kw)
    return {int(c): replay.hit_rate(routes, int(c), policy) for c in capacities}


def load_cv(routes: list[list[list[int]]], num_experts: int) -> float:
    """Mean over layers-streams of the coefficient of variation of per-expert load (std / mean of counts)."""
    cvs = []
    for steps in routes:
        counts = np.bincount([e for s in steps for e in s], minlength=num_experts).astype(float)
        cvs.append(counts.std() / counts.mean())
    return float(np.mean(cvs))
