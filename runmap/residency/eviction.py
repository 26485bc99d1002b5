"""Eviction policies of the expert cache (docs/cache-contract.md, rule 7 `eviction`).

A policy only ranks candidates; the cache decides which experts are candidates (published in the
current generation, outside the group being published, not readable by a live lease) and only drops
their mappings. Both policies are deterministic (ties broken by expert id) so that the contract
model can predict their choices.
"""
from __future__ import annotations

import math

import numpy as np


class EvictionPolicy:
    """Per (layer, expert) use history in two dense arrays that grow with the ids seen: ``_t`` int64 the tick of the
    last use (-1: never) and ``_s`` float64 a score (frequency policies). The scalar methods serve the cache's
    transactions; ``touch_layers`` / ``values_all`` do a whole decode step at once (the host-read site)."""

    name = "base"

    def __init__(self):
        self._t = np.full((0, 0), -1, dtype=np.int64)
        self._s = np.zeros((0, 0), dtype=np.float64)

    def _grow(self, layers: int, experts: int) -> None:
        L, E = self._t.shape
        if layers > L or experts > E:
            L2, E2 = max(L, layers), max(E, experts)
            t = np.full((L2, E2), -1, dtype=np.int64)
            s = np.zeros((L2, E2), dtype=np.float64)
            t[:L, :E], s[:L, :E] = self._t, self._s
            self._t, self._s = t, s

    def _fit(self, layer: int, experts) -> np.ndarray:
        ids = np.asarray(list(experts), dtype=np.int64).reshape(-1)
        self._grow(layer + 1, int(ids.max()) + 1 if ids.size else 0)
        return ids

    def touch(self, layer: int, experts, tick: int) -> None:
        """Record a use of ``experts`` (hit or newly published) at logical time ``tick``."""
        ids = self._fit(layer, experts)
        if ids.size:
            self._touch(np.s_[layer, ids], tick)

    def touch_layers(self, used: np.ndarray, ticks: np.ndarray) -> None:
        """``touch`` of every layer at once: used bool (L, E), layer l's experts at tick ticks[l] (int (L,))."""
        self._grow(*used.shape)
        L, E = used.shape
        t_full = np.broadcast_to(np.asarray(ticks, dtype=np.int64)[:, None], (L, E))
        view = np.s_[:L, :E]
        self._touch_mask(view, used, t_full)

    def _touch(self, where, tick: int) -> None:
        self._t[where] = tick

    def _touch_mask(self, view, used, ticks) -> None:
        t = self._t[view]
        t[used] = ticks[used]

    def value(self, layer: int, expert: int, tick: int) -> float:
        """How much the policy wants ``expert`` kept at ``tick`` (higher: kept longer); ``choose`` evicts the lowest.
        The host-read site's promotion compares an absent expert's value with the coldest resident's."""
        raise NotImplementedError

    def values_all(self, layers: int, experts: int, tick: int) -> np.ndarray:
        """float64 (layers, experts): ``value`` of every (layer, expert) at ``tick``."""
        raise NotImplementedError

    def choose(self, layer: int, candidates, n: int, tick: int) -> list[int]:
        """Pick ``n`` victims among ``candidates`` (len(candidates) >= n)."""
        raise NotImplementedError

    def last(self, layer: int, expert: int) -> int:
        L, E = self._t.shape
        return int(self._t[layer, expert]) if layer < L and expert < E else -1

    def forget(self, layer: int, experts) -> None:
        """Drop history of evicted experts (LRU) or keep it (frequency policies decide)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def choose(self, layer, candidates, n, tick):
        order = sorted(candidates, key=lambda e: (self.last(layer, e), e))
        return order[:n]

    def value(self, layer, expert, tick):
        return float(self.last(layer, expert))  # the tick of its last use

    def values_all(self, layers, experts, tick):
        self._grow(layers, experts)
        return self._t[:layers, :experts].astype(np.float64)


class LFUDecayPolicy(EvictionPolicy):
    """Frequency-aware: each use adds 1 to a score that halves every ``half_life`` ticks.

    Lowest decayed score is evicted first; ties by least recent use. The history of an evicted
    expert is kept (decaying), so an expert that keeps coming back is protected sooner.
    """

    name = "lfu-decay"

    def __init__(self, half_life: float = 64.0):
        if half_life <= 0:
            raise ValueError(f"lfu-decay half_life must be positive, got {half_life}")
        super().__init__()
        self.rate = math.log(2.0) / half_life

    def _value(self, layer, expert, tick) -> float:
        L, E = self._t.shape
        if layer >= L or expert >= E or self._t[layer, expert] < 0:
            return 0.0
        return float(self._s[layer, expert]) * math.exp(-self.rate * (tick - int(self._t[layer, expert])))

    def _touch(self, where, tick):
        t = self._t[where]
        decayed = np.where(t >= 0, self._s[where] * np.exp(-self.rate * (tick - t)), 0.0)
        self._s[where] = decayed + 1.0
        self._t[where] = tick

    def _touch_mask(self, view, used, ticks):
        t, s = self._t[view], self._s[view]
        decayed = np.where(t >= 0, s * np.exp(-self.rate * (ticks - t)), 0.0)
        s[used] = decayed[used] + 1.0
        t[used] = ticks[used]

    def value(self, layer, expert, tick):
        return self._value(layer, expert, tick)  # decayed uses

    def values_all(self, layers, experts, tick):
        self._grow(layers, experts)
        t, s = self._t[:layers, :experts], self._s[:layers, :experts]
        return np.where(t >= 0, s * np.exp(-self.rate * (tick - t)), 0.0)

    def choose(self, layer, candidates, n, tick):
        def rank(e):
            return (self._value(layer, e, tick), self.last(layer, e), e)
        return sorted(candidates, key=rank)[:n]


POLICIES = {"lru": LRUPolicy, "lfu-decay": LFUDecayPolicy}


def make_policy(name) -> EvictionPolicy:
    if isinstance(name, EvictionPolicy):
        return name
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
