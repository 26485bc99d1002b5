"""The engine's side of routing workloads: imposing a workload's routes and recording the routes that ran.

``RouteRecorder`` keeps, for each forward pass, the routed ids of every MoE layer as device tensors (no host
sync inside a step; converted when the trace is asked for) together with which (row, position) each routed
row was, and turns them into a runmap.workload.trace.RouteTrace: one stream per generated row.
"""
from __future__ import annotations

import numpy as np
import torch

from runmap.workload import replay
from runmap.workload.trace import RouteTrace


class RouteRecorder:
    def __init__(self, *, arch: str, num_layers: int, num_experts: int, top_k: int, routing: str,
                 pack_identity: str | None):
        self.meta = dict(arch=arch, num_layers=num_layers, num_experts=num_experts, top_k=top_k, routing=routing,
                         pack_identity=pack_identity)
        self.L, self.k = num_layers, top_k
        self._groups: list[dict] = []  # per generate group: rows, prompt lengths, passes
        self._layers: list[torch.Tensor | None] = [None] * num_layers

    # ---- collection ------------------------------------------------------------------------------------------
    def begin_group(self, prompt_lengths) -> None:
        self._groups.append({"prompt": [int(p) for p in prompt_lengths], "passes": []})

    def sink(self, layer: int, ids: torch.Tensor) -> None:
        """Transformer.route_sink of an eager forward pass."""
        self._layers[layer] = ids

    def end_pass(self, real: np.ndarray, ids: torch.Tensor | None = None, decode: bool = False) -> None:
        """After one forward pass: real bool (B, T) marks the routed positions (row-major order of the routed
        rows); ids int64 (L, n, k) device (a graph's static buffer, cloned here) or None for what ``sink`` saw."""
        if ids is None:
            if any(t is None for t in self._layers):
                return  # nothing was routed (e.g. an all-padding chunk)
            ids = torch.stack(self._layers)  # (L, n, k)
            self._layers = [None] * self.L
        else:
            ids = ids.clone()
        self._groups[-1]["passes"].append((real.copy(), ids, decode))

    # ---- results -------------------------------------------------------------------------------------------------
    def trace(self) -> RouteTrace:
        streams, prompts = [], []
        for g in self._groups:
            B = len(g["prompt"])
            rows: list[list[np.ndarray]] = [[] for _ in range(B)]
            for real, ids, _ in g["passes"]:
                a = ids.cpu().numpy().transpose(1, 0, 2)  # (n, L, k)
                bs, _ = np.nonzero(real)  # row of each routed position, row-major like the routed rows
                for j, b in enumerate(bs):
                    rows[b].append(a[j])
            for b in range(B):
                streams.append(np.stack(rows[b]) if rows[b] else np.zeros((0, self.L, self.k), np.int64))
                prompts.append(min(g["prompt"][b], len(rows[b])))
        return RouteTrace(streams=streams, prompt_tokens=prompts, **self.meta)

    def mark(self) -> int:
        """A point in the recording: ``cache_steps(since=mark)`` and ``replay_decode(since=mark)`` start there."""
        return len(self._groups)

    def cache_steps(self, since: int = 0) -> tuple[list[list[list[int]]], list[int]]:
        """What the cache was asked for, per (group, layer): one step per forward pass (the union of the pass's
        rows; a prefill chunk is one step), and per sequence the number of leading prefill steps."""
        routes, warmup = [], []
        for g in self._groups[since:]:
            per_layer: list[list[list[int]]] = [[] for _ in range(self.L)]
            n_prefill = 0
            for real, ids, decode in g["passes"]:
                n_prefill += not decode
                a = ids.cpu().numpy()  # (L, n, k)
                for layer in range(self.L):
                    per_layer[layer].append(sorted(set(a[layer].reshape(-1).tolist())))
            routes += per_layer
            warmup += [n_prefill] * self.L
        return routes, warmup

    def replay_decode(self, capacity: int, since: int = 0) -> dict:
        """LRU and Belady hit rates of the recorded decode steps at ``capacity`` experts per layer, the prefill of
        each group filling the cache first as it did in the run."""
        routes, warmup = self.cache_steps(since)
        steps = sum(len(s) - w for s, w in zip(routes, warmup)) // max(self.L, 1)
        return {"lru": replay.hit_rate(routes, capacity, "lru", warmup),
                "belady": replay.hit_rate(routes, capacity, "belady", warmup), "decode_steps": steps}
