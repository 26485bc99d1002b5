"""Eviction policies of the expert cache (docs/cache-contract.md, rule 7 `eviction`).

A policy only ranks candidates; the cache decides which experts are candidates (published in the
current generation, outside the group being published, not readable by a live lease) and only drops
their mappings. Both policies are deterministic (ties broken by expert id) so that the contract
model can predict their choices.
"""
from __future__ import annotations

import math


class EvictionPolicy:
    name = "base"

    def touch(self, layer: int, experts, tick: int) -> None:
        """Record a use of ``experts`` (hit or newly published) at logical time ``tick``."""
        raise NotImplementedError

    def choose(self, layer: int, candidates, n: int, tick: int) -> list[int]:
        """Pick ``n`` victims among ``candidates`` (len(candidates) >= n)."""
        raise NotImplementedError

    def value(self, layer: int, expert: int, tick: int) -> float:
        """How much the policy wants ``expert`` kept at ``tick`` (higher: kept longer); ``choose`` evicts the lowest.
        The host-read site's promotion compares an absent expert's value with the coldest resident's."""
        raise NotImplementedError

    def forget(self, layer: int, experts) -> None:
        """Drop history of evicted experts (LRU) or keep it (frequency policies decide)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self):
        self.last: dict[tuple[int, int], int] = {}

    def touch(self, layer, experts, tick):
        for e in experts:
            self.last[(layer, e)] = tick

    def choose(self, layer, candidates, n, tick):
        order = sorted(candidates, key=lambda e: (self.last.get((layer, e), -1), e))
        return order[:n]

    def value(self, layer, expert, tick):
        return float(self.last.get((layer, expert), -1))  # the tick of its last use


class LFUDecayPolicy(EvictionPolicy):
    """Frequency-aware: each use adds 1 to a score that halves every ``half_life`` ticks.

    Lowest decayed score is evicted first; ties by least recent use. The history of an evicted
    expert is kept (decaying), so an expert that keeps coming back is protected sooner.
    """

    name = "lfu-decay"

    def __init__(self, half_life: float = 64.0):
        if half_life <= 0:
            raise ValueError(f"lfu-decay half_life must be positive, got {half_life}")
        self.rate = math.log(2.0) / half_life
        self.score: dict[tuple[int, int], tuple[float, int]] = {}  # (score at tick, tick)

    def _value(self, key, tick) -> float:
        s, t = self.score.get(key, (0.0, tick))
        return s * math.exp(-self.rate * (tick - t))

    def touch(self, layer, experts, tick):
        for e in experts:
            key = (layer, e)
            self.score[key] = (self._value(key, tick) + 1.0, tick)

    def value(self, layer, expert, tick):
        return self._value((layer, expert), tick)  # decayed uses

    def choose(self, layer, candidates, n, tick):
        def rank(e):
            key = (layer, e)
            return (self._value(key, tick), self.score.get(key, (0.0, -1))[1], e)
        return sorted(candidates, key=rank)[:n]


POLICIES = {"lru": LRUPolicy, "lfu-decay": LFUDecayPolicy}


def make_policy(name) -> EvictionPolicy:
    if isinstance(name, EvictionPolicy):
        return name
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
