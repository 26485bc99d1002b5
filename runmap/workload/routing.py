"""Routing workloads: where each MoE layer's top-k expert ids come from during a run.

``model``              the checkpoint's own router (the default): what a real checkpoint computes
``calibrated:<family>`` a seeded stochastic routing model per layer (runmap.workload.calibration) whose cache
                        hit-rate curve matches published measurements of the trained family; ``calibrated`` alone
                        takes the pack's family
``trace:FILE``          the routes of a recorded run (runmap.workload.trace), replayed stream by stream

Under ``calibrated`` and ``trace`` only the ids are imposed: the engine still runs the router (its gate
weights are the router's own probabilities of the imposed ids, rescaled to the total weight of the router's
own top-k), looks the ids up in the cache, transfers misses and runs the kernels. Imposed ids reach the
layer as a device tensor like the router's, so the host learns them the same way (no shortcut a real router
would not have).

Streams: row b of a batch is one stream; a new batch starts new streams (``begin``). Each stream draws one
step per real token, prompt tokens included, as a real router would route them.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from runmap.workload import calibration

ROUTING_KINDS = ("model", "calibrated", "trace")


class RoutingError(ValueError):
    """A routing name that is not one of ROUTING_KINDS, an unknown family, or a trace that does not fit."""


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
    kind: str  # one of ROUTING_KINDS
    family: str | None = None  # calibrated
    path: str | None = None  # trace

    @property
    def name(self) -> str:
        if self.kind == "calibrated":
            return f"calibrated:{self.family}"
        if self.kind == "trace":
            return f"trace:{self.path}"
        return "model"


def parse_routing(text: str, default_family: str | None = None) -> RoutingSpec:
    """``model`` | ``calibrated[:FAMILY]`` | ``trace:FILE`` -> RoutingSpec; RoutingError naming what is allowed."""
    kind, sep, arg = str(text).partition(":")
    if kind == "model" and not sep:
        return RoutingSpec("model")
    if kind == "calibrated":
        family = arg or default_family
        if family not in calibration.FAMILIES:
            raise RoutingError(f"routing {text!r}: unknown family {family!r}; calibrated families: "
                               f"{sorted(calibration.FAMILIES)}")
        return RoutingSpec("calibrated", family=family)
    if kind == "trace" and arg:
        return RoutingSpec("trace", path=arg)
    raise RoutingError(f"routing {text!r}: expected 'model', 'calibrated[:FAMILY]' (families "
                       f"{sorted(calibration.FAMILIES)}) or 'trace:FILE'")


def routing_argument(text: str) -> str:
    """argparse ``type=`` of ``--routing``: the name checked at parse time (``calibrated`` alone is resolved to
    the pack's family once the pack is open)."""
    import argparse

    try:
        parse_routing(text, default_family=next(iter(calibration.FAMILIES)))
    except RoutingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


ROUTING_HELP = ("routing workload: 'model' (default: the checkpoint's own router), 'calibrated[:FAMILY]' (a seeded "
                "routing model fitted to published cache hit rates of the trained family; FAMILY defaults to the "
                f"pack's; families: {', '.join(calibration.FAMILIES)}) or 'trace:FILE' (replay a route trace). "
                "Only the expert ids are imposed: the router still weighs them and the cache, transfers and "
                "kernels do all their work.")


class ImposedRouting:
    """Draws imposed top-k ids for the engine's forward passes (``calibrated`` and ``trace`` workloads)."""

    def __init__(self, spec: RoutingSpec, *, num_layers: int, num_experts: int, top_k: int, seed: int = 0):
        self.spec, self.L, self.E, self.k, self.seed = spec, num_layers, num_experts, top_k, seed
        self.batches = 0
        self.trace = None
        if spec.kind == "calibrated":
            self.params = calibration.family_params(spec.family).params
        elif spec.kind == "trace":
            from runmap.workload.trace import read_trace

            self.trace = read_trace(spec.path)
            t = self.trace
            if (t.num_layers, t.num_experts, t.top_k) != (num_layers, num_experts, top_k):
                raise RoutingError(f"{spec.path}: trace of {t.num_layers} layers x {t.num_experts} experts, top-"
                                   f"{t.top_k}; this model has {num_layers} x {num_experts}, top-{top_k}")
            if not t.streams:
                raise RoutingError(f"{spec.path}: the trace has no streams")
        else:
            raise RoutingError(f"routing {spec.name!r} is the model's own; nothing to impose")
        self._streams: list = []
        self._ahead: list = []  # per row, steps drawn ahead of the passes (draw_ahead), consumed first by _step
        # next-layer prefetch (Engine.from_pack's prefetch): each draw also predicts the experts of its rows, from each
        # stream's past before the pass (``_predict``; one prediction for every position of a row in the pass);
        # int64 (L, n, k) as the draw, -1 = none
        self.predicting = False
        self.prediction: np.ndarray | None = None

    def begin(self, batch: int) -> None:
        """New streams for the ``batch`` rows of the next generate group (or one prefill)."""
        n = self.batches
        self.batches += 1
        self._ahead = [collections.deque() for _ in range(batch)]
        if self.trace is not None:  # row b replays trace stream (n * batch + b) mod streams, from its start
            S = len(self.trace.streams)
            self._streams = [[self.trace.streams[(n * batch + b) % S], 0] for b in range(batch)]
            return
        pops = np.stack([calibration.popularity(self.params, self.E, np.random.default_rng([self.seed, 10_000 + layer]))
                         for layer in range(self.L)])  # (L, E): a layer's popularity is the same in every batch
        # a generator per row: a row's routes do not depend on how the passes interleave the rows' draws, so they can be
        # drawn ahead (draw_ahead) row by row
        self._streams = [calibration.StreamSampler(self.params, pops, self.k, np.random.default_rng([self.seed, n, b]))
                         for b in range(batch)]

    def draw_ahead(self, steps) -> None:
        """Draw each row's next ``steps[b]`` tokens now, before the passes that consume them (a generate group's prompt
        and decode steps: Engine.run, before its timed region). The routes are exactly those the passes would draw
        (each stream's draws in the same order); what changes is when the host pays for them: a trained model's
        router costs the host nothing in a step, so neither should its stand-in inside the measured decode (on a
        2-core CPU a calibrated OLMoE draw costs ~0.2 ms per token and row, as much as ~4 % of a batch-1 two-site
        step, which the device waits for). Calibrated streams only (a trace's step is a lookup), and not while
        predicting: a prediction reads the stream's state, which must stand at the pass being predicted."""
        if self.trace is not None or self.predicting:
            return
        if len(steps) != len(self._streams):
            raise RoutingError(f"draw ahead for {len(steps)} rows, but begin() opened {len(self._streams)} streams")
        for b, n in enumerate(steps):
            stream, ahead = self._streams[b], self._ahead[b]
            for _ in range(int(n)):
                ahead.append(stream.next())

    def draw(self, real: np.ndarray) -> np.ndarray:
        """real bool (B, T): the real tokens of a forward pass. Returns int64 (L, n, k): the imposed ids of the
        real tokens in row-major order (the rows a MoE layer routes), each stream advanced by its real tokens."""
        B, T = real.shape
        if B > len(self._streams):
            raise RoutingError(f"a forward pass of {B} rows, but begin() opened {len(self._streams)} streams")
        out, pred = [], []
        for b in range(B):
            # one prediction per row and pass, made before any of its positions is drawn: in a prefill every layer
            # runs over all positions at once, so no position's next-layer routing is known to a predictor yet
            row_pred = self._predict(b) if self.predicting and real[b].any() else None
            for t in range(T):
                if real[b, t]:
                    if row_pred is not None:
                        pred.append(row_pred)
                    out.append(self._step(b))
        if self.predicting:
            self.prediction = (np.ascontiguousarray(np.stack(pred).transpose(1, 0, 2)) if pred else
                               np.zeros((self.L, 0, self.k), dtype=np.int64))  # (L, n, k)
        if not out:
            return np.zeros((self.L, 0, self.k), dtype=np.int64)
        ids = np.stack(out).astype(np.int64, copy=False)  # (n, L, k)
        return np.ascontiguousarray(ids.transpose(1, 0, 2))  # (L, n, k)

    def _predict(self, b: int) -> np.ndarray:
        """int64 (L, k): row b's next step as predicted from its stream's past. Calibrated: the most likely experts
        under the routing model (StreamSampler.predict). Trace: the stream's previous step (-1, no prediction, at
        its first); the trace's own next step is the future and is never read."""
        s = self._streams[b]
        if self.trace is not None:
            stream, pos = s
            if pos == 0:
                return np.full((self.L, self.k), -1, dtype=np.int64)
            return np.asarray(stream[(pos - 1) % len(stream)], dtype=np.int64)
        return s.predict()

    def _step(self, b: int) -> np.ndarray:
        """int64 (L, k): the next step of row b's stream (drawn ahead, else now)."""
        if self._ahead and self._ahead[b]:
            return self._ahead[b].popleft()
        s = self._streams[b]
        if self.trace is not None:
            stream, pos = s
            s[1] = pos + 1
            return stream[pos % len(stream)]  # a stream shorter than the run wraps around
        return s.next()


class ReplayedRoutes:
    """One prompt's routes replayed position by position (the ``draw`` / ``begin`` interface of ImposedRouting):
    the logits check runs the reference executor on the routes the engine's own executor took, so that the two
    are compared at every position on the same experts (runmap.bench.campaign.logits_check)."""

    def __init__(self, routes: np.ndarray):
        routes = np.asarray(routes, dtype=np.int64)
        if routes.ndim != 3:
            raise RoutingError(f"replayed routes: expected (T, L, k) expert ids, got shape {routes.shape}")
        self.routes = routes  # (T, L, k)
        self._next = 0

    def begin(self, batch: int) -> None:
        if batch != 1:
            raise RoutingError(f"replayed routes hold one prompt; a group of {batch} rows cannot replay them")
        self._next = 0

    def draw_ahead(self, steps) -> None:
        """Nothing to draw: the routes are given."""

    def draw(self, real: np.ndarray) -> np.ndarray:
        """real bool (1, T): the next T positions of the prompt. Returns int64 (L, n, k)."""
        n = int(real.sum())
        if real.shape[0] != 1 or self._next + n > len(self.routes):
            raise RoutingError(f"replayed routes: a pass of {real.shape} positions after {self._next} of "
                               f"{len(self.routes)}")
        ids = self.routes[self._next:self._next + n]  # (n, L, k)
        self._next += n
        return np.ascontiguousarray(ids.transpose(1, 0, 2))
