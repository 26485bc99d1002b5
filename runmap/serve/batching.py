"""Continuous batching on top of the engine's step methods (``Engine.prefill`` / ``Engine.decode``).

The engine's KV cache is one tensor pair (L, max_batch, Hkv, S, D) whose rows share KV slots: row b of a
batch is left-padded by ``pad[b]`` and every decode step writes the new token of every row at the same
slot ``slot`` (runmap.engine.generation). ``generate_batch`` fills the rows once per call; here rows join
and leave a running batch between decode steps:

* **Join.** The requests waiting at a step boundary join together (up to the free rows and ``join_tokens``
  prompt tokens): they are prefilled in one pass, left-padded to the longest prompt P, into the engine's own
  free KV rows (B .. B+k-1) at slots 0..P-1 -- exactly the batched prefill ``generate_batch`` runs, and for a
  single request exactly the prefill it gets alone -- then moved right within their rows so that every prompt
  ends just before the shared slot: slots [slot - P_i, slot), ``pad = slot - P_i``. RoPE positions are
  ``slot - pad`` for every row, so a joined row sees positions 0..P_i-1 as it would alone, and the attention
  mask (keys pad..slot) hides whatever the row held before. When the longest prompt is longer than the
  shared slot, the running rows are moved right first (their keys and values shifted to later slots, their
  pads grown by the same amount: positions and masks unchanged). A prefill pass's host cost hardly depends on
  how many prompts it holds (on the H200, 13 ms for one 126-token prompt, 67 ms for 8:
  results/serve/probe/), so the waiting requests join together, not one per pass.
* **Interleaved join.** While rows run, a join need not stall them: ``begin_join`` opens the pass as a
  generator (``Engine.prefill_pieces``, one piece per layer) into the free rows past the running ones, on a
  CUDA stream of its own; ``advance_join`` queues pieces between decode steps (a host-time budget per call);
  ``finish_join``, at a step boundary once the pass is done, moves the rows down to the first free rows (rows
  may have left meanwhile) and to the shared slot, and they are part of the next step. Only when a decode step
  touches neither the routed experts' host path nor a routing workload (``can_interleave``); one join at a time.
* **Concurrent join.** A whole join whose pass is a captured graph (full residency with CUDA graphs) may instead
  replay it at once on a CUDA stream of its own while rows run (``concurrent``): the decode steps keep being
  launched on the compute stream and the device runs both, so the running rows need not wait for the prefill, and
  the host pays one replay, not a layer's launches per step. ``finish_join`` takes the rows in at the first step
  boundary after the pass is done (an event query, no host wait). The pass writes the cache's last k rows, which
  no running row reads (k <= max_batch - rows, and rows only leave while it runs); its graph has a memory pool and
  a cuBLAS workspace of its own (runmap.engine.prefill_graph).
* **Mixed join.** While rows run, a waiting request may instead join inside the next decode step
  (``mixed``; ``Engine.mixed_step``, runmap.engine.mixed_step): the step computes the running rows' tokens and the
  prompt's together, the prompt left-padded to its length bucket and written into the cache's last row so that it
  ends at the step's slot (pad = slot + 1 - P); after the step its keys and values move to row B and the row is
  part of the batch, its first token sampled from that step. One request per step; ``mixed_fits`` says when (rows
  running, a free row, the prompt's bucket no longer than the shared slot, KV room after it); otherwise it joins
  whole. On the CPU order of operations the step runs after the leaving rows left: when none is left, the join runs
  whole at the next boundary.
* **Room.** A row that has generated k of its m tokens still needs m - 1 - k decode steps, i.e. slots
  slot .. slot + m - 2 - k. A request joins only when every row (it included) has that room before
  ``max_seq_len``; when it does not, the slots left of the earliest prompt (min pad) are reclaimed by
  moving every row left, and if that is still not enough the request waits for rows to finish.
* **Leave.** A finished or cancelled row's place is taken by the last row (its keys and values copied
  over), so the batch stays rows 0..B-1 and a cancelled request stops costing compute at the next step.

Each row samples with its own settings (greedy rows take the argmax; a sampling row draws from its own
``torch.Generator`` seeded as ``generate_batch`` seeds a batch of one), and stop rules, held-back text and
streaming callbacks are the engine's own (``runmap.engine.generation._Row``), so a greedy request yields the
tokens it yields alone whenever the engine's step arithmetic does not depend on the other rows of the
batch (the tests compare with ``Engine.generate``). A padded joint prefill is the arithmetic of
``generate_batch``, not of a batch of one: a request that joined beside others can differ from its run alone
where the two round differently and the top two logits tie to within that rounding (``join_tokens=0`` keeps
every join alone).

On CUDA the step is pipelined as in ``generate_batch``: the decode step for the next token is launched
before the current token is read back on the host, so the device does not wait for stop checks and
admission; a row that finishes has that one speculative token dropped. On the CPU the decode call is
synchronous, so the tokens are read first and the step is run after admission (no wasted step).

Everything here runs on one thread (the scheduler's); nothing is thread-safe by itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import torch

import numpy as np

from runmap.engine.engine import PASS_QUEUED, host_to_device
from runmap.engine.generation import GenerationError, _Row, left_pad, prefill_warmup_shapes, sample  # noqa: F401

# prompt tokens of one joint prefill (rows x longest prompt): bounds the stall a join imposes on the running rows.
# Its activation memory is bounded anyway: the prefill runs in chunks of prefill_chunk positions over at most
# max_batch rows, the pass the budget planner counts
JOIN_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple = ()
    ignore_eos: bool = False


@dataclasses.dataclass(eq=False)
class _Join:
    """A joint prefill in progress: the group it admits, the free KV rows row0.. it writes (slots 0..P-1), its
    pass (Engine.prefill_pieces), the stream it runs on (None: the current one) and, once done, its logits."""

    group: list
    row0: int
    P: int
    pieces: object
    stream: object
    interleaved: bool
    running_at_begin: bool
    queued: object = None  # CUDA event recorded once all the pass's work is queued (its flag read comes next)
    logits: torch.Tensor | None = None
    done: object = None  # a concurrent join's CUDA event, recorded after its pass (query(): the pass is complete)
    mixed: bool = False  # a mixed join: its prompt is computed inside the next decode step (``step``)
    consumed: bool = False  # ... and that step has run: its row is running (finish_join ends the join)


class Sequence:
    """One request's row: prompt ids, sampling settings, its stop / streaming state.

    on_token(token_id | None, text_delta) is called for each kept token (as the engine's streaming callback
    without the row index); on_finish(sequence) once, when the row has left the batch. ``cancel()`` may be
    called from any thread: the row leaves at the next step with finish_reason "cancelled"."""

    def __init__(self, prompt_ids, params: SamplingParams, *, on_token=None, on_finish=None):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.on_token, self.on_finish = on_token, on_finish
        self.row: _Row | None = None  # made on admission (needs the tokenizer's decode and EOS ids)
        self.gen: torch.Generator | None = None
        self.cancelled = False
        self.finish_reason: str | None = None
        self.t_first: float | None = None  # perf_counter of the first kept token
        self.t_last: float | None = None

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def token_ids(self) -> list[int]:
        return list(self.row.ids) if self.row is not None else []

    @property
    def text(self) -> str:
        return self.row.text if self.row is not None else ""


class BatchRunner:
    """The running batch over one engine (see the module docstring). ``admit`` adds a row, ``step`` runs one
    decode step for every row; rows that finish leave the batch inside ``step``."""

    def __init__(self, engine, *, decode: Callable[[list[int]], str] | None = None, pipelined: bool | None = None,
                 join_tokens: int = JOIN_TOKENS, interleave: bool = False, concurrent: bool = False,
                 mixed: bool = False):
        """join_tokens: the most prompt tokens (rows x longest prompt, padding included) one joint prefill takes;
        a longer single prompt still joins, alone. 0: every request is prefilled alone. interleave: joins begun
        with ``begin_join`` while rows run may spread their prefill over several decode steps (``can_interleave``);
        concurrent: a whole join begun while rows run replays its captured pass on a stream of its own beside the
        decode steps (``can_join_concurrently``); mixed: a join begun while rows run computes its prompt inside the next
        decode step, one request per step (``mixed_fits``); none: every join stalls the running rows for its whole
        prefill."""
        if join_tokens < 0:
            raise ValueError(f"join_tokens must be >= 0, got {join_tokens}")
        self.eng = engine
        self.dev = engine.device
        self.max_batch, self.max_seq_len = engine.max_batch, engine.max_seq_len
        self.join_tokens = int(join_tokens)
        self.decode_text = decode or engine.tokenizer.decode
        self.eos_ids = frozenset(engine.tokenizer.eos_ids)
        self.seqs: list[Sequence] = []
        self.pad: list[int] = []
        self.slot = 0  # the next KV slot a decode step writes (shared by every row)
        self.cur: torch.Tensor | None = None  # int64 (B,) device: each row's sampled token not yet read
        self._pad_dev: torch.Tensor | None = None  # int64 (B,) device copy of self.pad (None: pads changed since)
        # pipelined=True on the CPU runs the CUDA order of operations synchronously (the tests use it)
        self.pipelined = self.dev.type == "cuda" if pipelined is None else bool(pipelined)
        self.counters = {"admitted": 0, "joined_running": 0, "joins": 0, "interleaved_joins": 0,
                         "concurrent_joins": 0, "padded_joins": 0, "shifts": 0, "row_moves": 0, "steps": 0,
                         "speculative_dropped": 0, "join_not_done": 0, "mixed_joins": 0}
        self.interleave = bool(interleave)
        self.concurrent = bool(concurrent)
        self.mixed = bool(mixed)
        self._pending: _Join | None = None  # the joint prefill in progress (begin_join .. finish_join)
        self._side = None  # CUDA: the stream interleaved and concurrent prefills run on (_side_stream)
        self._lead: bool = False  # the cache's full-residency request is held (Engine.experts.begin)

    # ---- capacity --------------------------------------------------------------------------------------
    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """GenerationError unless a request of this size could ever run (alone, from slot 0)."""
        if prompt_len < 1:
            raise GenerationError("an empty prompt cannot be generated from (no token to condition on)")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prompt_len + max_new_tokens - 1 > self.max_seq_len:
            raise GenerationError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} - 1 exceeds the "
                                  f"context (max_seq_len {self.max_seq_len})")

    def _steps_left(self, s: Sequence) -> int:
        """Decode steps (KV slots) the row may still need: m - 1 minus the tokens sampled after its first."""
        return s.params.max_new_tokens - 1 - len(s.row.ids)

    @property
    def rows(self) -> int:
        return len(self.seqs)

    # ---- KV moves -----------------------------------------------------------------------------------------
    def _shift(self, delta: int) -> None:
        """Move every row's keys and values by ``delta`` slots (negative: left); pads follow, so positions
        (slot - pad) and masks are unchanged."""
        if delta == 0 or not self.seqs:
            self.slot += delta
            return
        lo = min(self.pad)
        self._move_kv(0, 0, len(self.seqs), lo, self.slot, lo + delta)
        self.pad = [p + delta for p in self.pad]
        self._pad_dev = None
        self.slot += delta
        self.counters["shifts"] += 1

    def _move_kv(self, src: int, dst: int, k: int, lo: int, hi: int, to: int) -> None:
        """Keys and values of rows src..src+k-1 at slots lo..hi-1 move to rows dst..dst+k-1 at slots
        to..to+hi-lo-1 (the ranges may overlap: each layer's block is cloned first, one layer at a time to bound
        the temporary copy)."""
        for t in (self.eng.kv.k, self.eng.kv.v):
            for layer in range(t.shape[0]):
                block = t[layer, src:src + k, :, lo:hi].clone()
                t[layer, dst:dst + k, :, to:to + hi - lo].copy_(block)

    def _move_row(self, src: int, dst: int) -> None:
        self._copy_row_kv(src, dst, self.pad[src], self.slot)
        self.counters["row_moves"] += 1

    def _copy_row_kv(self, src: int, dst: int, lo: int, hi: int) -> None:
        """Keys and values of row src at slots lo..hi-1 into row dst (src != dst), every layer."""
        for t in (self.eng.kv.k, self.eng.kv.v):
            t[:, dst, :, lo:hi].copy_(t[:, src, :, lo:hi])

    # ---- admission ------------------------------------------------------------------------------------------
    def admit(self, seq: Sequence) -> bool:
        """Add ``seq`` as a new row if there is a free row and KV room for it and every running row; False
        (nothing changed) otherwise. Runs its prefill; its first token is sampled but read at the next step."""
        return self.admit_many([seq]) == 1

    def admit_many(self, seqs: list[Sequence]) -> int:
        """Add the longest prefix of ``seqs`` (FIFO: a request never overtakes an earlier one) that has free
        rows, KV room and fits ``join_tokens``, with one joint prefill run now; returns how many joined (0: nothing
        changed). Their first tokens are sampled but read at the next step."""
        if self.joining:
            raise RuntimeError("a join is in progress (begin_join); finish it before admitting more")
        n = self.begin_join(seqs, interleave=False, concurrent=False, mixed=False)
        if n:
            self.advance_join(None)
            joined = self.finish_join()
            assert joined, "a join begun and finished between two steps always has its room"
        return n

    @property
    def joining(self) -> bool:
        """A joint prefill is in progress (begin_join called, finish_join not yet done)."""
        return self._pending is not None

    @property
    def join_running(self) -> bool:
        """The pending join's rows already run (a mixed join whose step ran; ``finish_join`` has not yet ended it)."""
        return self._pending is not None and self._pending.consumed

    def can_interleave(self) -> bool:
        """Whether a join begun now may run its prefill between decode steps: rows are running, and a decode step
        neither calls the routed experts' host path (full residency; on CUDA a captured graph) nor draws from a
        routing workload or records routes (both would interleave the two passes' streams)."""
        e = self.eng
        return (self.interleave and bool(self.seqs) and e.steps_stay_on_device
                and (self.dev.type != "cuda" or e.use_graphs))

    def can_join_concurrently(self, k: int, P: int) -> bool:
        """Whether a whole join of k rows x P positions begun beside running rows may replay its captured pass on the
        side stream; False: it runs in line (the CPU, a pass not captured in a pool of its own, see
        ``Engine.join_pass_concurrent``, or a decode step that draws from a routing workload, records routes or
        calls the routed experts' host path: their order against the pass would change)."""
        e = self.eng
        return self.dev.type == "cuda" and e.steps_stay_on_device and e.join_pass_concurrent(k, P)

    def mixed_fits(self, seq: Sequence):
        """The engine's mixed-step shape (``Engine.mixed_step_key``) for ``seq`` joining at the next decode step, or None
        when it must join whole: no row runs (or, in the pipelined order, none needs another step), no free row, a
        prompt that does not fit a mixed step's buckets or whose bucket is longer than the shared slot, no KV room for
        its tokens after the slot, or an engine that runs no mixed step (see ``Engine.mixed_step_key``)."""
        if not (self.mixed and self.seqs and len(self.seqs) < self.max_batch):
            return None
        if self.pipelined and not any(self._steps_left(s) > 0 for s in self.seqs):
            return None  # the next step would not be launched: every row is at its last token
        # the prompt ends at the step's slot; its m - 1 later tokens take slots slot + 1 .. slot + m - 1
        if self.slot + seq.params.max_new_tokens > self.max_seq_len:
            return None
        return self.eng.mixed_step_key(len(self.seqs), len(seq.prompt_ids), self.slot)

    def _open(self, seq: Sequence) -> None:
        """A joining request's row state: stop rules and streaming (``_Row``), and its generator when it samples."""
        seq.row = _Row(0, len(seq.prompt_ids), self.decode_text, tuple(seq.params.stop),
                       frozenset() if seq.params.ignore_eos else self.eos_ids, self._emitter(seq))
        if seq.params.temperature > 0:
            seq.gen = torch.Generator(device=self.dev)
            seed = seq.params.seed if seq.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            seq.gen.manual_seed(seed)

    def _side_stream(self):
        """The CUDA stream a join's prefill runs on beside the decode steps (interleaved or concurrent), made at its
        first use, once it waits for what the compute stream has queued so far: the free rows the join writes may
        still be read by that work (a leaving row's move, the previous join's move)."""
        if self._side is None:
            # From the high-priority pool: torch hands out pool streams round-robin, and the decode graphs were
            # captured on low-priority pool streams whose cuBLAS workspaces (one per handle and stream) their
            # GEMMs kept; an eager GEMM on one of those streams would share a workspace with a graph replaying
            # at the same time on the compute stream. High priority also lets a pass's thread blocks go first where
            # both want the device, so a joining request's first token is not held back by the decode steps.
            self._side = torch.cuda.Stream(self.dev, priority=-1)
        self._side.wait_stream(torch.cuda.current_stream(self.dev))  # read here, outside the side stream's context
        return self._side

    def _pass_done_event(self, stream):
        """A CUDA event recorded on ``stream`` after the work queued there so far (None without a stream)."""
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def begin_join(self, seqs: list[Sequence], *, interleave: bool = True, concurrent: bool = True,
                   mixed: bool = True) -> int:
        """Start the joint prefill of the longest prefix of ``seqs`` that fits (as ``admit_many`` chooses it);
        returns how many it takes (0: nothing started). With ``mixed`` (and ``mixed_fits`` for the first request) that
        request alone joins inside the next decode step (``step``); with ``interleave`` (and ``can_interleave()``)
        the pass runs on a side stream, piece by piece in ``advance_join`` between decode steps, into free KV rows past
        the running ones; otherwise ``advance_join(None)`` runs it whole -- beside the decode steps where ``concurrent``
        and ``can_join_concurrently`` allow it. ``finish_join`` makes its rows part of the batch."""
        if self.joining:
            raise RuntimeError("a join is already in progress")
        for seq in seqs:
            self.check(len(seq.prompt_ids), seq.params.max_new_tokens)
        if mixed and seqs and self.mixed_fits(seqs[0]) is not None:
            self._open(seqs[0])
            self._pending = _Join(group=[seqs[0]], row0=self.max_batch - 1, P=len(seqs[0].prompt_ids), pieces=None,
                                  stream=None, interleaved=False, running_at_begin=True, mixed=True)
            return 1
        free = self.max_batch - len(self.seqs)
        side = interleave and self.can_interleave()
        # a whole join replays a captured pass when one fits (Engine.join_pass_bucket): the group then stops before
        # the request that would take it past the largest captured pass, unless it is the first (which joins alone,
        # eagerly when even it does not fit)
        captured = not side and self.eng.join_pass_bucket(1, 1) is not None
        group = []
        for seq in seqs[:free]:
            P = max(len(s.prompt_ids) for s in (*group, seq))
            if group and (len(group) + 1) * P > self.join_tokens:
                break
            if group and captured and self.eng.join_pass_bucket(len(group) + 1, P) is None:
                break
            if self._target([*group, seq]) is None:
                break
            group.append(seq)
        if not group:
            return 0
        for seq in group:
            self._open(seq)
        if not self._lead:
            self.eng.experts.begin()  # what Engine.run does around its groups (full residency: lease every row)
            self._lead = True
        stream = self._side_stream() if side and self.dev.type == "cuda" else None
        k = len(group)
        # (k, P) left-padded as generate_batch pads a batch (P the longest prompt), (k,) each row's padding
        tokens, pad = left_pad([s.prompt_ids for s in group], self.eng.pad_id)
        if not side:
            # whole: the pass runs now, into the cache's last k rows (free: k <= max_batch - running rows), where the
            # server's warm-up captured a pass per shape (Scheduler._warmup: Engine.prepare_join_passes); eager when
            # none fits. finish_join moves the rows to the running ones' side. Concurrent: the captured pass is
            # queued on a stream of its own, after what the compute stream has queued so far (the step in flight)
            row0 = self.max_batch - k
            beside = concurrent and self.concurrent and bool(self.seqs)  # rows run that the pass may run beside
            stream = self._side_stream() if beside and self.can_join_concurrently(k, tokens.shape[1]) else None
            try:
                with self._on(stream):
                    logits = self.eng.prefill(self._upload(tokens), self._upload(pad), pad_host=pad.tolist(),
                                              kv_row0=row0, padded_pass=k > 1)
                    done = self._pass_done_event(stream) if beside else None
            except BaseException:
                if stream is not None:  # a pass queued before the failure must not outlive it: the next join's rows
                    torch.cuda.current_stream(self.dev).wait_stream(stream)
                if not self.seqs:
                    self._release()
                raise
            self._pending = _Join(group=group, row0=row0, P=tokens.shape[1], pieces=None, stream=stream,
                                  interleaved=False, running_at_begin=bool(self.seqs), logits=logits, done=done)
            return k
        row0 = len(self.seqs)
        with self._on(stream):
            # the free rows row0..row0+k-1 of the engine's cache, slots 0..P-1
            pieces = self.eng.prefill_pieces(self._upload(tokens), self._upload(pad), kv=self.eng.kv.rows(row0, row0 + k),
                                             pad_host=pad.tolist())
        self._pending = _Join(group=group, row0=row0, P=tokens.shape[1], pieces=pieces, stream=stream,
                              interleaved=side, running_at_begin=bool(self.seqs))
        return k

    def advance_join(self, budget_s: float | None) -> bool:
        """Queue more of the pending prefill: pieces (a layer each) until ``budget_s`` seconds of host time have
        passed (at least one piece), or all of it (None). True once all its work is queued and its result read."""
        j = self._pending
        if j is None:
            raise RuntimeError("no join in progress")
        if j.mixed:
            if j.consumed or self.seqs:
                return j.consumed  # the next decode step computes it
            # every running row left before a step could take it (the CPU order runs the step after the leaves):
            # it joins whole, into the empty batch (which has room for any request ``check`` lets in)
            self._pending = None
            n = self.begin_join(j.group, interleave=False, concurrent=False, mixed=False)
            assert n == len(j.group), "a single request always joins an empty batch"
            j = self._pending
        t_end = None if budget_s is None else time.perf_counter() + budget_s
        try:
            while j.logits is None:
                if j.queued is not None:  # everything is queued: the pass's last piece reads its check's flag
                    if t_end is not None and self.seqs and not j.queued.query():
                        break  # the device is not there yet: reading now would hold the host, decode steps first
                with self._on(j.stream):
                    try:
                        marker = next(j.pieces)
                    except StopIteration as done:
                        j.logits = done.value
                        break
                if marker == PASS_QUEUED and j.stream is not None:
                    j.queued = torch.cuda.Event()
                    j.queued.record(j.stream)
                if t_end is not None and time.perf_counter() >= t_end:
                    break
        except BaseException:
            self.drop_join()
            raise
        return j.logits is not None

    def finish_join(self) -> bool:
        """Make a completed join's rows part of the batch (False: its prefill is not complete, or the rows have no
        KV room yet; try again at a later step boundary). Their first tokens are sampled, read at the next step."""
        j = self._pending
        if j is not None and j.mixed:
            if j.consumed:  # its step ran (``_launch``): its row is running already
                self._pending = None
                if not self.seqs:  # every row left meanwhile (steps ran before this call): _remove kept the lease
                    self._release()
            return j.consumed
        if j is None or j.logits is None:
            return False
        if j.done is not None and self.seqs and not j.done.query():
            # a concurrent pass still running beside the decode steps: taking its rows now would make the next step
            # wait for it (with no row running, the compute stream just waits for it on the device)
            self.counters["join_not_done"] += 1
            return False
        group = j.group
        target = self._target(group)
        if target is None:  # the running rows advanced during the pass: wait for some to finish
            return False
        if j.stream is not None:  # the compute stream waits (on the device) for the pass; its logits are used there
            torch.cuda.current_stream(self.dev).wait_stream(j.stream)
            j.logits.record_stream(torch.cuda.current_stream(self.dev))
        self._pending = None
        running = bool(self.seqs)
        self._shift(target - self.slot)
        b, k, P = len(self.seqs), len(group), j.P
        lens = [len(s.prompt_ids) for s in group]
        if (j.row0, 0) != (b, target - P):  # into rows b.. with the prompts ending at the shared slot
            self._move_kv(j.row0, b, k, 0, P, target - P)
        tok = self._sample(j.logits, group)
        cur = tok if self.cur is None else torch.cat([self.cur, tok])  # the last call that can fail: state after it
        if running or j.running_at_begin:
            self.counters["joined_running"] += k
        self.counters["joins"] += 1
        self.counters["interleaved_joins"] += j.interleaved
        self.counters["concurrent_joins"] += j.done is not None
        self.counters["padded_joins"] += len(set(lens)) > 1
        self.seqs.extend(group)
        self.pad.extend(target - n for n in lens)
        self._pad_dev = None
        self.cur = cur
        self.counters["admitted"] += k
        return True

    def drop_join(self) -> list[Sequence]:
        """Forget the join in progress, if any, without finishing its rows (their requests are the caller's); returns
        its group. Its pass is closed; its KV rows hold nothing anyone reads."""
        j, self._pending = self._pending, None
        if j is None or j.consumed:  # a consumed mixed join's row is a running row: not the caller's
            if j is not None and not self.seqs:
                self._release()
            return []
        if j.pieces is not None:
            j.pieces.close()
        if j.stream is not None:  # nothing of the abandoned pass may still write rows a later join fills
            torch.cuda.current_stream(self.dev).wait_stream(j.stream)
        if not self.seqs:
            self._release()
        return list(j.group)

    def _target(self, group: list[Sequence]) -> int | None:
        """The shared slot at which ``group``'s prompts would end (every row keeps room for its remaining
        decode steps before max_seq_len), or None when there is no room even after reclaiming the slots left
        of the earliest running prompt."""
        P = max(len(s.prompt_ids) for s in group)
        need = max([s.params.max_new_tokens - 1 for s in group] + [self._steps_left(s) for s in self.seqs])
        target = max(self.slot, P)
        if target + need <= self.max_seq_len:
            return target
        reclaim = min(self.pad) if self.pad else self.slot
        target = max(self.slot - reclaim, P)
        return target if target + need <= self.max_seq_len else None

    @staticmethod
    def _on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _emitter(self, seq: Sequence):
        def emit(_row, tid, delta):
            # the callback sees t_first / t_last of the tokens before this one (None: this is the first)
            if seq.on_token is not None:
                seq.on_token(tid, delta)
            if tid is not None:
                now = time.perf_counter()
                if seq.t_first is None:
                    seq.t_first = now
                seq.t_last = now
        return emit

    # ---- the step ----------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """float32 (B, V) -> int64 (B,): argmax for greedy rows, each sampling row from its own generator."""
        tok = logits.argmax(dim=-1)
        for b, s in enumerate(seqs):
            if s.params.temperature > 0:
                tok[b] = sample(logits[b:b + 1], s.params.temperature, s.params.top_p, s.gen)[0]
        return tok

    def _upload(self, t: torch.Tensor | list) -> torch.Tensor:
        """A host tensor (or list of ints: int64) on the engine's device without waiting for the device: on CUDA
        through pinned memory with a non-blocking copy, queued behind the step already launched. (A plain
        ``torch.tensor(..., device="cuda")`` copies from pageable memory and synchronizes the stream: the host
        would wait for the step in flight, and the device would idle through the host's work until the next
        launch, every step.)"""
        return host_to_device(np.asarray(t, dtype=np.int64) if isinstance(t, list) else t.numpy(), self.dev)

    def _decode(self, tok: torch.Tensor) -> torch.Tensor:
        if self._pad_dev is None:  # uploaded again only after a join, a leave or a shift changed the pads
            self._pad_dev = self._upload(list(self.pad))
        logits = self.eng.decode(tok, self.slot, self._pad_dev)
        self.slot += 1
        self.counters["steps"] += 1
        return self._sample(logits, self.seqs)

    def step(self) -> list[Sequence]:
        """Read every row's pending token, run one decode step; returns the rows that left the batch."""
        if not self.seqs:
            return []
        B = len(self.seqs)
        cuda = self.dev.type == "cuda"
        host = torch.empty(B, dtype=torch.long, pin_memory=cuda)
        host.copy_(self.cur, non_blocking=cuda)
        ev = torch.cuda.Event() if cuda else None
        if ev is not None:
            ev.record()
        nxt = None
        if self.pipelined:
            # queued behind the copy: the device runs it while the host reads. Not when every row is at its
            # last token by length: that step could write past the last KV slot and would be dropped anyway.
            if any(self._steps_left(s) > 0 for s in self.seqs):
                nxt = self._launch(self.cur)
        if ev is not None:
            ev.synchronize()
        for s, tid in zip(self.seqs, host.tolist()):
            if s.row.finish is None and not s.cancelled:
                s.row.push(int(tid), s.params.max_new_tokens)
        # a row that joined in the step just launched (mixed) has no token read yet: it may leave from the next step
        gone = [b for b, s in enumerate(self.seqs[:B]) if s.cancelled or s.row.finish is not None]
        B = len(self.seqs)
        keep = [b for b in range(B) if b not in set(gone)]
        if nxt is not None and not keep:
            self.counters["speculative_dropped"] += 1
        if nxt is None:  # CPU (nothing launched yet), or no row needed another step
            nxt = self.cur
        left = self._remove(gone)
        if keep and gone:  # the surviving rows' pending tokens in their new order
            nxt = nxt[self._upload(self._order(B, gone))]
        self.cur = nxt if keep else None
        if not self.pipelined and self.seqs:
            self.cur = self._launch(self.cur)
        return left

    def _launch(self, tok: torch.Tensor) -> torch.Tensor:
        """The next decode step: a mixed one when a mixed join is pending and still fits (the CPU order runs it after
        the rows that finished left, so it may not), a plain one otherwise. Returns the sampled tokens of every row,
        a joined one last."""
        j = self._pending
        if j is None or not j.mixed or j.consumed:
            return self._decode(tok)
        seq = j.group[0]
        key = self.mixed_fits(seq)
        if key is None:
            return self._decode(tok)  # advance_join makes it a whole join once no row runs
        B, P, s = len(self.seqs), len(seq.prompt_ids), self.slot
        if self._pad_dev is None:
            self._pad_dev = self._upload(list(self.pad))
        logits = self.eng.mixed_step(tok, s, self._pad_dev, self._upload(seq.prompt_ids), key)  # (B + 1, V)
        if j.row0 != B:  # the prompt's keys and values, slots s + 1 - P .. s, from the cache's last row to row B
            self._copy_row_kv(j.row0, B, s + 1 - P, s + 1)
        self.seqs.append(seq)
        self.pad.append(s + 1 - P)
        self._pad_dev = None
        self.slot += 1
        j.consumed = True
        for counter in ("steps", "joins", "mixed_joins", "admitted", "joined_running"):
            self.counters[counter] += 1
        return self._sample(logits, self.seqs)

    def _order(self, B: int, gone: list[int]) -> list[int]:
        """Old row index of each new row 0..B'-1 after ``_remove(gone)`` (the same moves, replayed)."""
        idx = list(range(B))
        for b in sorted(gone, reverse=True):
            last = idx.pop()
            if b < len(idx):
                idx[b] = last
        return idx

    def _remove(self, gone: list[int]) -> list[Sequence]:
        """Drop rows ``gone``; each hole (highest first) is filled by the current last row."""
        left = []
        for b in sorted(gone, reverse=True):
            s = self.seqs[b]
            last = len(self.seqs) - 1
            if b < last:
                self._move_row(last, b)
                self.seqs[b], self.pad[b] = self.seqs[last], self.pad[last]
            self.seqs.pop()
            self.pad.pop()
            self._pad_dev = None
            if s.cancelled and s.row.finish is None:
                s.finish_reason = "cancelled"
            else:
                s.finish_reason = s.row.finish or "length"
            left.append(s)
        if not self.seqs:
            self.slot = 0
            if self._pending is None:  # a join in progress still holds the experts for its pass
                self._release()
        for s in left:
            if s.on_finish is not None:
                s.on_finish(s)
        return left

    def _release(self) -> None:
        try:
            # a host-read step still in flight (placement host-read keeps one) is noted now: its counters belong to
            # this batch, not to whatever runs next (an offline run's record)
            self.eng.finish_decode_steps()
        finally:
            if self._lead:
                self.eng.experts.end()
                self._lead = False

    def abort_all(self, reason: str = "cancelled") -> list[Sequence]:
        """Every row leaves now (shutdown, or after an engine failure): finish_reason ``reason``."""
        j = self._pending
        left = list(self.seqs) + (list(j.group) if j is not None and not j.consumed else [])
        self.seqs, self.pad, self.cur, self.slot = [], [], None, 0
        self._pad_dev = None
        try:
            # every row is told before anything that touches the device (after a device fault, a stream wait or
            # the lease's release may raise again)
            for s in left:
                s.finish_reason = reason
                if s.on_finish is not None:
                    s.on_finish(s)
        finally:
            try:
                self.drop_join()
            finally:
                self._release()
        return left
