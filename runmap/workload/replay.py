"""Cache hit rates of a route sequence: LRU, LFU with decay, and Belady's optimum (the clairvoyant bound).

A route sequence of one layer is a list of steps; a step is the set of distinct experts that layer needed at
once (one token's top-k at batch 1, the batch union otherwise). A cache of ``capacity`` experts starts empty;
each requested expert is a hit if cached, a miss otherwise (cold misses count, as in a real run). After a step
the cache holds every expert of the step (a step larger than the cache keeps the ``capacity`` of them it will
need soonest, for Belady, or the most recently listed, for the others), evicting by the policy.

Hit rate = hits / requested experts, summed over every layer and step given; ``warmup`` steps at the start
fill the cache without being counted (a prefill before the decode steps being measured).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

REPLAY_POLICIES = ("lru", "lfu-decay", "belady")


def _check(capacity):
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")


def lru_hits(steps: Sequence[Sequence[int]], capacity: int, warmup: int = 0) -> tuple[int, int]:
    """(hits, requests) of an LRU cache of ``capacity`` experts over ``steps`` of one layer."""
    _check(capacity)
    last_use: dict[int, int] = {}  # expert -> step it was last requested (the cache, in recency order)
    hits = requests = 0
    for t, step in enumerate(steps):
        step = list(dict.fromkeys(int(e) for e in step))
        if t >= warmup:
            requests += len(step)
            hits += sum(1 for e in step if e in last_use)
        for e in step:
            last_use[e] = t
        if len(last_use) > capacity:
            keep = set(step[-capacity:])  # the whole step when it fits
            victims = sorted((u, e) for e, u in last_use.items() if e not in keep)
            for _, e in victims[:len(last_use) - capacity]:
                del last_use[e]
    return hits, requests


def lfu_decay_hits(steps: Sequence[Sequence[int]], capacity: int, warmup: int = 0, half_life: float = 64.0) -> tuple[int, int]:
    """(hits, requests) of an LFU cache whose use counts halve every ``half_life`` steps (the engine's
    ``lfu-decay`` eviction policy); ties go to the least recently used."""
    _check(capacity)
    decay = 0.5 ** (1.0 / half_life)
    score: dict[int, float] = {}  # expert -> decayed use count
    last: dict[int, int] = {}
    cached: set[int] = set()
    hits = requests = 0
    for t, step in enumerate(steps):
        step = list(dict.fromkeys(int(e) for e in step))
        if t >= warmup:
            requests += len(step)
            hits += sum(1 for e in step if e in cached)
        for e in score:
            score[e] *= decay
        for e in step:
            score[e] = score.get(e, 0.0) + 1.0
            last[e] = t
            cached.add(e)
        if len(cached) > capacity:
            keep = set(step[-capacity:])  # the whole step when it fits
            victims = sorted((score[e], last[e], e) for e in cached if e not in keep)
            for _, _, e in victims[:len(cached) - capacity]:
                cached.discard(e)
    return hits, requests


def belady_hits(steps: Sequence[Sequence[int]], capacity: int, warmup: int = 0) -> tuple[int, int]:
    """(hits, requests) of Belady's clairvoyant cache: evict the expert needed furthest in the future."""
    _check(capacity)
    steps = [list(dict.fromkeys(int(e) for e in s)) for s in steps]
    never = len(steps) + 1
    next_use: list[dict[int, int]] = [dict() for _ in steps]  # step t: expert -> next step > t that needs it
    upcoming: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        next_use[t] = {e: upcoming.get(e, never) for e in steps[t]}
        for e in steps[t]:
            upcoming[e] = t
    nxt: dict[int, int] = {}  # cached expert -> its next use
    hits = requests = 0
    for t, step in enumerate(steps):
        if t >= warmup:
            requests += len(step)
            hits += sum(1 for e in step if e in nxt)
        for e in step:
            nxt[e] = next_use[t][e]
        if len(nxt) > capacity:
            # keep the step's experts first (they are in use), then those needed soonest
            in_step = set(step)
            order = heapq.nsmallest(capacity, nxt.items(), key=lambda kv: (kv[0] not in in_step, kv[1]))
            nxt = dict(order)
    return hits, requests


def hit_rate(routes: Sequence[Sequence[Sequence[int]]], capacity: int, policy: str = "lru",
             warmup: Sequence[int] | None = None) -> float:
    """Hit rate over several layers: ``routes[layer][step]`` = the experts that layer needed at that step."""
    fn = {"lru": lru_hits, "lfu-decay": lfu_decay_hits, "belady": belady_hits}.get(policy)
    if fn is None:
        raise ValueError(f"unknown replay policy {policy!r}; choose one of {list(REPLAY_POLICIES)}")
    hits = requests = 0
    for i, steps in enumerate(routes):
        h, r = fn(steps, capacity, 0 if warmup is None else warmup[i])
        hits, requests = hits + h, requests + r
    return hits / requests if requests else float("nan")
