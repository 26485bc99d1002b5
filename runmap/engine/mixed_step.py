"""Mixed steps: a decode step of the running rows and a joining request's prefill as one pass (a server's
``--join-mode mixed``).

Why: on the H200 a served OLMoE batch of 32 closed-loop clients spent about a fifth of its time in join passes of
4-5 ms each, most of which is the fixed cost of reading every expert and every dense weight once per pass; a
32-row decode step reads the same weights in ~2.7 ms (results/serve/load/README.md). Computing the joining prompt
inside the decode step (``Transformer.forward_mixed``) reads them once for both.

What a mixed step computes: the running rows 0..B-1 decode one token at the shared slot s, as a decode step does; the
joining prompt of P tokens is left-padded to its length bucket Pb (``mixed_bucket``) and written into
the cache's last row at slots s - Pb + 1 .. s, its pad s + 1 - P, so that it ends at the shared slot as a whole join
leaves it (``runmap.serve.batching``); the runner then moves its keys and values to row B. The step returns logits for
the B rows and the prompt's last position. To keep the number of captured graphs small the decode part runs over
``mixed_rows(B)`` rows (multiples of MIXED_ROWS_STEP, at most max_batch - 1): the rows past B are dummies (the pad
token, a pad equal to the slot so that each sees only its own key) in free rows whose slot-s keys nothing reads.
Every position is routed, the prompt's padding and the dummy rows too (a graph cannot select a data-dependent row
count): the experts see more rows than in an eager pass, so where a row count crosses one of the grouped executor's
tile thresholds the real rows' values can differ from a plain decode step in rounding (docs/engine.md).

When it runs: full residency, no routing workload and no route recorder; on CUDA only with CUDA graphs and no GPU
budget (each shape is one captured graph, all captured by ``prepare`` at a server's warm-up: rows bucket x length
bucket x the decode step's KV-length bucket); on the CPU the same fixed-shape pass runs eagerly (the tests).
"""
from __future__ import annotations

import torch

from runmap.engine.prefill_graph import PREFILL_BUCKETS

# decode rows of a mixed step are rounded up to a multiple of this (capped at max_batch - 1): with a graph per exact
# row count a server of 32 rows would capture 31 x length buckets x KV buckets graphs
MIXED_ROWS_STEP = 8
# the longest joining prompt a mixed step takes (its bucket); a longer one joins whole. At 512 positions a mixed step
# is a 512-token prefill with the decode rows riding along; past it the pass's own length dominates the step
MIXED_MAX_PROMPT = 512
# the joining prompt's length buckets (a captured graph each, per rows bucket and KV-length bucket): the prefill
# passes' own up to MIXED_MAX_PROMPT. A prompt is padded to the next one, and its padding is computed like its tokens
# (above 128 positions up to a third of the pass); finer buckets waste less and capture more graphs
MIXED_BUCKETS = tuple(b for b in PREFILL_BUCKETS if b <= MIXED_MAX_PROMPT)


def mixed_bucket(n: int) -> int | None:
    """The positions a joining prompt of n tokens takes in a mixed step (the smallest of MIXED_BUCKETS >= n), or None
    past MIXED_MAX_PROMPT."""
    return next((b for b in MIXED_BUCKETS if b >= n and b <= MIXED_MAX_PROMPT), None)


def mixed_rows(B: int, max_batch: int) -> int:
    """The decode rows a mixed step of B running rows computes (B <= result <= max_batch - 1)."""
    return min(-(-B // MIXED_ROWS_STEP) * MIXED_ROWS_STEP, max_batch - 1)


class _MixedInputs:
    """The fixed-address inputs of one mixed-step shape: tok int64 (Bc, 1), pad int64 (Bc,), slot int64 (1,), the
    joining prompt jtok int64 (1, Pb) and its pad jpad int64 (1,)."""

    def __init__(self, engine, Bc: int, Pb: int, out: torch.Tensor):
        dev = engine.device
        self.Bc, self.Pb = Bc, Pb
        self.tok = torch.full((Bc, 1), int(engine.pad_id), dtype=torch.long, device=dev)
        self.pad = torch.zeros(Bc, dtype=torch.long, device=dev)
        self.slot = torch.full((1,), Pb - 1, dtype=torch.long, device=dev)
        self.jtok = torch.full((1, Pb), int(engine.pad_id), dtype=torch.long, device=dev)
        self.jpad = torch.zeros(1, dtype=torch.long, device=dev)
        # float32 (Bc + 1, V): the logits every graph of this rows bucket writes (one buffer per bucket, not one per
        # graph: a graph's own output would stay allocated in the pool, 6.4 MB per OLMoE graph of 32 rows)
        self.out = out
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # n_keys -> graph


class MixedStepper:
    """The mixed steps of one engine (module docstring). ``capture=False`` runs the same fixed-shape pass eagerly."""

    def __init__(self, engine, pool, capture: bool):
        self.e, self.pool, self.capture = engine, pool, capture
        self.shapes: dict[tuple[int, int], _MixedInputs] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # rows bucket -> the logits buffer its graphs share

    def key(self, B: int, P: int, slot: int) -> tuple[int, int, int] | None:
        """(decode rows, prompt bucket, KV-length bucket) of a mixed step of B running rows at KV slot ``slot`` and a
        P-token prompt, or None when there is none: no free row for the prompt, a prompt past MIXED_MAX_PROMPT, or one
        whose bucket does not end at the slot (Pb > slot + 1: the rows would first have to move right, a whole join)."""
        e = self.e
        Pb = mixed_bucket(P)
        if not 1 <= B <= e.max_batch - 1 or Pb is None or Pb > slot + 1 or Pb > e.prefill_chunk \
                or slot >= e.max_seq_len:
            return None
        n_keys = e.bucket(slot + 1) if e.device.type == "cuda" else slot + 1
        return mixed_rows(B, e.max_batch), Pb, n_keys

    def _inputs(self, Bc: int, Pb: int) -> _MixedInputs:
        if (Bc, Pb) not in self.shapes:
            if Bc not in self.outputs:
                self.outputs[Bc] = torch.empty(Bc + 1, self.e.cfg.vocab_size, dtype=torch.float32, device=self.e.device)
            self.shapes[(Bc, Pb)] = _MixedInputs(self.e, Bc, Pb, self.outputs[Bc])
        return self.shapes[(Bc, Pb)]

    def _forward(self, st: _MixedInputs, n_keys: int) -> torch.Tensor:
        """The pass over st's static inputs into st.out; the same launches whether captured or not."""
        e = self.e
        dec_pos = (st.slot - st.pad).unsqueeze(1)  # (Bc, 1)
        join_slots = st.slot - st.Pb + 1 + torch.arange(st.Pb, device=e.device)  # (Pb,)
        join_pos = (join_slots[None, :] - st.jpad[:, None]).clamp_(min=0)  # (1, Pb)
        e.experts.validate = False  # no host sync inside a graph: static tables of full residency
        try:
            return st.out.copy_(e.model.forward_mixed(st.tok, dec_pos, st.slot, st.pad, st.jtok, join_pos, join_slots,
                                                      st.jpad, e.kv, e.max_batch - 1, n_keys, e.experts))
        finally:
            e.experts.validate = True

    def _capture(self, st: _MixedInputs, n_keys: int) -> None:
        from runmap.engine.engine import capture_graph

        st.graphs[n_keys], _ = capture_graph(lambda: self._forward(st, n_keys), self.e.device, self.pool)

    def prepare(self) -> int:
        """Capture every mixed-step shape now (a server's warm-up): each rows bucket x prompt bucket x KV-length bucket
        a step can take; returns how many. The inputs are the pad token and a slot at the KV bucket's end: only the
        shapes matter, and the writes land in rows no request holds (the batch must be empty). Each capture runs the
        pass three times (two warm-up runs, then the capture: runmap.engine.engine.capture_graph); for max batch 32 and
        a 1,024-token context that is 88 graphs (4 rows buckets x 22 prompt / KV-length pairs). Nothing without
        capture."""
        if not self.capture:
            return 0
        e = self.e
        # the shapes ``key`` gives: each running-row count with each bucket's longest prompt at each KV bucket's last slot
        keys = {self.key(B, Pb, n_keys - 1) for B in range(1, e.max_batch) for Pb in MIXED_BUCKETS
                for n_keys in e.kv_buckets()} - {None}
        n = 0
        for Bc, Pb, n_keys in sorted(keys):
            st = self._inputs(Bc, Pb)
            if n_keys not in st.graphs:
                st.slot.fill_(n_keys - 1)
                st.pad.fill_(n_keys - 1)
                self._capture(st, n_keys)
                n += 1
        return n

    def run(self, tok: torch.Tensor, slot: int, pad: torch.Tensor, prompt: torch.Tensor, key) -> torch.Tensor:
        """tok int64 (B,) the running rows' tokens, slot the step's KV slot, pad int64 (B,), prompt int64 (P,) (device),
        key = ``key(B, P, slot)`` -> float32 logits (B + 1, V): the running rows', then the prompt's last position's.
        Writes the prompt's keys and values into the cache's last row (slots slot - Pb + 1 .. slot)."""
        Bc, Pb, n_keys = key
        B, P = tok.shape[0], prompt.shape[0]
        st = self._inputs(Bc, Pb)
        st.tok[:B, 0].copy_(tok)
        st.tok[B:].fill_(int(self.e.pad_id))
        st.pad[:B].copy_(pad)
        st.pad[B:].fill_(slot)  # a dummy row sees only its own key
        st.slot.fill_(slot)
        st.jtok[0, :Pb - P].fill_(int(self.e.pad_id))
        st.jtok[0, Pb - P:].copy_(prompt)
        st.jpad.fill_(slot + 1 - P)
        if self.capture:
            if n_keys not in st.graphs:
                self._capture(st, n_keys)
            st.graphs[n_keys].replay()
            out = st.out
        else:
            out = self._forward(st, n_keys)
        return torch.cat([out[:B], out[Bc:]])  # (B + 1, V): a copy, the buffer is rewritten by the next step
