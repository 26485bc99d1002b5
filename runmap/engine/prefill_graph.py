"""Short prefill passes captured as CUDA graphs, one per (rows, length bucket, padded or not).

Why: a prefill pass is eager Python over ~16 launches per layer. On the H200 a 512-token OLMoE prefill needs
6.6 ms of device time, but its warm time to first token was 13.7 ms in one run and 28.5 ms in another
(results/campaigns/h200-decode/README.md): the host issuing launches, not the device, set the time. Replaying a
captured pass costs the host a few copies and one launch.

What a captured pass computes: the prompt (B rows of P positions, left-padded as ``Engine.prefill`` takes it) is
padded on the right with the pad id to its length bucket Pb (``prefill_bucket``), and the pass runs over all B x Pb
positions. Causal attention keeps the real positions blind to the tail, the logits are read at position P - 1, and
the tail's keys and values land in KV slots P .. Pb - 1, which a decode step masks until it overwrites them. Every
position is routed (the tail and left pads too: a graph cannot select a data-dependent row count), so the experts
see more rows than in an eager pass; where a row count crosses one of the grouped executor's tile thresholds the
real positions' values can differ from an eager pass in rounding (docs/engine.md). The recorded routes and the
routing workload's draws cover the real positions only, as in an eager pass; under a workload the other rows take
k distinct filler experts. ``Engine.prefill`` returns a copy of the logits: the pass's own output lives in the graph
pool, which later captures may reuse.

When it runs: ``Engine.prefill`` on CUDA under full residency with CUDA graphs (``Engine.use_graphs``) and no GPU
budget (a captured pass keeps its activations in the graph pool, outside the budget's plan), last-position logits,
the engine's own KV cache (rows 0..B-1), no per-layer route log, and B x Pb <= PREFILL_GRAPH_MAX_TOKENS (one row:
Pb <= PREFILL_GRAPH_MAX_ROW_TOKENS) with Pb within one prefill chunk and the KV cache. Longer passes keep the device
busy longer than the host needs to issue them and run eagerly; so do ``Engine.prefill_pieces`` (a server's joins,
interleaved with decode steps).
"""
from __future__ import annotations

import numpy as np
import torch

# Length buckets of a captured pass: powers of two, and from 128 on every half step as well, so the padded tail
# is at most a third of a pass above 128 positions.
PREFILL_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# rows x bucket of the largest captured pass of several rows (a server's joins). On the H200 an eager pass spent
# ~35 ms on the host at 2,048 tokens (19.9 ms of device time: 1.26x transformers eager); past 2,048 positions a
# bucket's padded tail (up to a third of the pass) would cost more device time than the host time it saves
PREFILL_GRAPH_MAX_TOKENS = 2048
# the largest captured pass of one row (a request's own prompt). At 4,096 OLMoE positions an eager pass is about as
# long on the device as on the host, and its time to first token moved with the host's load: 37.5-39.6 ms in three
# campaigns, 42.5 ms in h200-floor-pdl against 34.4 ms of device time (1.27x transformers eager where the others
# were 1.40-1.43x); captured, 35.6 ms (h200-floor-graph4096). Only exactly 4,096 positions was measured: a prompt
# just past 2,048 or 3,072 pays up to a third more device time for its padded tail, which at these lengths is about
# the host time an eager pass would add. Past 4,096 the device time dominates (8,192: 68.5 ms of device time, 70.3 ms
# to the first token) and the pass's decoded-weights workspace and activations (~1.2 GB at 4,096, OLMoE) would stay
# reserved in the graph pool for a few percent
PREFILL_GRAPH_MAX_ROW_TOKENS = 4096


def prefill_bucket(n: int) -> int | None:
    """The positions of a captured pass of n prompt positions (the smallest bucket >= n), or None past the last."""
    for b in PREFILL_BUCKETS:
        if b >= n:
            return b
    return None


class _CapturedPass:
    """One captured pass and its fixed-address inputs: tok int64 (B, Pb), pad int64 (B,), last int64 (1,) (the
    position whose logits are returned), and when the engine has them the imposed and the recorded routes,
    int64 (L, B*Pb, k) each."""

    def __init__(self, engine, B: int, Pb: int, padded: bool, imposed: bool, recorded: bool, row0: int = 0):
        dev, L, k = engine.device, engine.cfg.num_layers, engine.cfg.top_k
        self.B, self.Pb, self.padded, self.row0 = B, Pb, padded, row0
        # the KV rows the pass writes: the engine's cache from row 0, or (a server's join) rows row0..row0+B-1
        self.kv = engine.kv if row0 == 0 else engine.kv.rows(row0, row0 + B)
        self.tok = torch.full((B, Pb), int(engine.pad_id), dtype=torch.long, device=dev)
        self.pad = torch.zeros(B, dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        # rows that are not the prompt's (left pads, the tail) are routed to k distinct experts, so the imposed gate
        # weights of a filler row never divide by a single tiny probability
        self.filler = np.arange(k, dtype=np.int64) % engine.cfg.num_experts  # (k,)
        self.imposed = torch.as_tensor(np.broadcast_to(self.filler, (L, B * Pb, k)).copy()).to(dev) if imposed else None
        self.recorded = torch.zeros(L, B * Pb, k, dtype=torch.long, device=dev) if recorded else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # float32 (B, V): the captured pass's logits (a static buffer)
        self.in_join_pool = False  # captured into the prefiller's join pool, on its join stream


class GraphPrefiller:
    """Prefill passes of one engine as CUDA graphs (module docstring). ``capture=False`` runs the same fixed-shape
    pass eagerly (the CPU tests of the padding, the last position and the routes)."""

    def __init__(self, engine, pool, capture: bool = True):
        self.e, self.pool, self.capture = engine, pool, capture
        # With ``separate_joins`` (Engine.prepare_join_passes(concurrent=True)), passes into KV rows past the first
        # (a server's joins: row0 > 0) are captured into a memory pool and on a capture stream of their own, made at
        # the first such capture: a server then replays them beside its decode steps (runmap serve --join-mode
        # concurrent), and two graphs replaying at the same time must share neither intermediate buffers (a pool's
        # memory is reused across its graphs) nor a cuBLAS workspace (engine.capture_graph). Off by default: the
        # second pool holds the largest join pass's working set once more
        self.separate_joins = False
        self.join_pool = None
        self.join_stream = None
        # (rows, bucket, padded, routing workload on, route recorder on, first KV row) -> pass: a pass captured without
        # the workload's or the recorder's buffers (warm_up sets both aside) never serves a run that has them
        self.passes: dict[tuple, _CapturedPass] = {}

    def bucket_for(self, B: int, P: int) -> int | None:
        """The bucket a pass of B rows x P positions runs at, or None when it runs eagerly."""
        e = self.e
        Pb = prefill_bucket(P)
        cap = PREFILL_GRAPH_MAX_ROW_TOKENS if B == 1 else PREFILL_GRAPH_MAX_TOKENS
        if Pb is None or B * Pb > cap or Pb > min(e.prefill_chunk, e.max_seq_len):
            return None
        return Pb

    def captured(self, B: int, Pb: int, padded: bool, imposed: bool, recorded: bool, row0: int = 0):
        """The pass of that key if it has been captured, else None (nothing is made)."""
        st = self.passes.get((B, Pb, padded, imposed, recorded, row0))
        return st if st is not None and st.graph is not None else None

    def _pass(self, B: int, Pb: int, padded: bool, imposed: bool, recorded: bool, row0: int = 0) -> _CapturedPass:
        key = (B, Pb, padded, imposed, recorded, row0)
        if key not in self.passes:
            self.passes[key] = _CapturedPass(self.e, B, Pb, padded, imposed, recorded, row0)
        return self.passes[key]

    def prepare(self, B: int, Pb: int, *, imposed: bool, recorded: bool, padded: bool = False, row0: int = 0) -> None:
        """Capture the pass of B rows at bucket Pb into KV rows row0.. now (``Engine.warm_up``, a server's warm-up),
        with the buffers of a routing workload / route recorder as asked (warm-up runs with both set aside, so it
        cannot tell from the engine); its inputs are the pad id, filler routes and nothing recorded: only the shapes
        matter."""
        st = self._pass(B, Pb, padded, imposed, recorded, row0)
        if self.capture and st.graph is None:
            self._capture(st)

    def prepare_buckets(self, B: int, *, imposed: bool, recorded: bool, padded: bool = False, row0: int = 0) -> int:
        """``prepare`` at every length bucket a captured pass of B rows takes (``bucket_for``); returns how many."""
        buckets = [Pb for Pb in PREFILL_BUCKETS if self.bucket_for(B, Pb) == Pb]
        for Pb in buckets:
            self.prepare(B, Pb, imposed=imposed, recorded=recorded, padded=padded, row0=row0)
        return len(buckets)

    def _forward(self, st: _CapturedPass):
        """The pass over st's static inputs; the same launches whether captured or not."""
        e = self.e
        slots = torch.arange(st.Pb, device=e.device)  # (Pb,)
        pos = (slots[None, :] - st.pad[:, None]).clamp_(min=0)  # (B, Pb)
        e.experts.validate = False  # no host sync inside a graph: static tables of full residency
        e.model.imposed = st.imposed
        if st.recorded is not None:
            e.model.route_sink = lambda layer, ids: st.recorded[layer].copy_(ids)
        try:
            return e.model.forward(st.tok, pos, st.kv, slots, st.pad, st.Pb, e.experts, causal_fresh=not st.padded,
                                   last_position=st.last)
        finally:
            e.experts.validate = True
            e.model.imposed = e.model.route_sink = None

    def _capture(self, st: _CapturedPass) -> None:
        from runmap.engine.engine import capture_graph

        pool, stream = self.pool, None
        st.in_join_pool = self.separate_joins and st.row0 > 0
        if st.in_join_pool:
            if self.join_pool is None:
                # From the high-priority stream pool: torch hands out each pool's streams in rotation, and the
                # low-priority one also holds torch's default capture stream (the decode graphs' and their cuBLAS
                # workspace's), which a low-priority draw can return after enough draws
                self.join_stream = torch.cuda.Stream(self.e.device, priority=-1)
                if self.join_stream == torch.cuda.graphs.graph.default_capture_stream:
                    raise RuntimeError("the join passes' capture stream is torch's default capture stream")
                self.join_pool = torch.cuda.graph_pool_handle()
            pool, stream = self.join_pool, self.join_stream
        st.graph, st.out = capture_graph(lambda: self._forward(st), self.e.device, pool, stream)

    def run(self, tokens: torch.Tensor, pad: torch.Tensor, pad_h: np.ndarray, Pb: int, *, row0: int = 0,
            padded: bool = False) -> torch.Tensor:
        """tokens int64 (B, P), pad int64 (B,) (device) and pad_h (host), Pb = ``bucket_for(B, P)`` -> float32 (B, V)
        logits at position P - 1 (a static buffer, valid until the next pass of the same key). The pass writes KV
        rows row0..row0+B-1; ``padded`` runs the padded pass even when no row is padded (one pass per shape for a
        server's joins: the padded pass computes the same values for unpadded rows, through the masked attention)."""
        from runmap.engine.engine import host_to_device

        e = self.e
        B, P = tokens.shape
        st = self._pass(B, Pb, padded or bool(pad_h.any()), e.imposed is not None, e.routes is not None, row0)
        st.tok[:, :P].copy_(tokens)
        st.tok[:, P:].fill_(int(e.pad_id))
        st.pad.copy_(pad)
        st.last.fill_(P - 1)
        real = np.zeros((B, Pb), dtype=bool)  # the prompt's own positions (not the left pads, not the tail)
        real[:, :P] = np.arange(P)[None, :] >= pad_h[:, None]
        rows = np.flatnonzero(real.reshape(-1))  # (n,) routed rows of an eager pass, row-major
        if st.imposed is not None:
            drawn = e.imposed.draw(real[:, :P])  # (L, n, k): the workload's ids of the real positions
            full = np.broadcast_to(st.filler, tuple(st.imposed.shape)).copy()  # (L, B*Pb, k): filler rows elsewhere
            full[:, rows] = drawn
            st.imposed.copy_(host_to_device(full, e.device), non_blocking=True)
        if self.capture:
            if st.graph is None:
                self._capture(st)
            st.graph.replay()
            out = st.out
        else:
            out = self._forward(st)
        if st.recorded is not None:
            e.routes.end_pass(real[:, :P], st.recorded.index_select(1, host_to_device(rows, e.device)))
        return out
