"""Generation loop: batching with left padding, greedy / seeded sampling, stop conditions, streaming.

The loop drives a ``StepModel`` (the engine implements it):

    prefill(tokens int64 (B, P), pad int64 (B,)) -> float32 logits (B, V) of the last position;
        writes KV slots 0..P-1; row b is left-padded by pad[b] (its real tokens are at slots pad[b]..P-1)
    decode(tokens int64 (B,), slot: int, pad int64 (B,)) -> float32 logits (B, V);
        the new token of every row is written at KV slot ``slot`` (all rows share slots: left padding)
    device, max_seq_len

Pipelining: the decode step for token s+1 is launched before token s is read back on the host, so the GPU
never waits for the host's stop checks; when every row has finished, that one speculative step is dropped.

Stop rules per row: an end-of-sequence id (not included in text or token_ids), a stop string (text cut
before it; the tokens up to the one completing it are kept) or ``max_new_tokens`` ("length").
Streaming: ``on_token(row, token_id, text_delta)`` is called for each kept token with the text that became
final with it (text that could still be the start of a stop string, or an incomplete UTF-8 sequence, is
held back); when a row finishes, any held-back text that survives is flushed in a call with token_id None.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Protocol, Sequence

import torch


class StepModel(Protocol):
    device: torch.device
    max_seq_len: int

    def prefill(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, slot: int, pad: torch.Tensor) -> torch.Tensor: ...


class GenerationError(ValueError):
    """Bad generation arguments (too long for the KV cache, bad temperature / top_p, ...)."""


def encode_prompt(tokenizer, prompt, chat: bool, vocab_size: int) -> list[int]:
    """A prompt as token ids: text through ``tokenizer`` (its chat template when ``chat``), or a list of ids
    checked against the vocabulary. Raises GenerationError naming the ids when one is outside [0, vocab_size)."""
    if isinstance(prompt, str):
        return tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
    ids = [int(t) for t in prompt]
    if any(not 0 <= t < vocab_size for t in ids):
        raise GenerationError(f"token ids must be in [0, {vocab_size}); got {ids}")
    return ids


@dataclasses.dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length"
    prompt_tokens: int


@dataclasses.dataclass
class Timing:
    prefill_s: float = 0.0  # prompt forward pass until the first token is on the host
    decode_s: float = 0.0  # from the first token on the host until the last
    ttft_s: float = 0.0  # time to first token (host-visible), from the start of generate
    prompt_tokens: int = 0  # real (unpadded) prompt tokens over all rows
    new_tokens: int = 0  # kept generated tokens over all rows
    decode_tok_s: float = 0.0  # tokens produced by decode steps (new_tokens - rows) / decode_s
    batch: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GenerationRun:
    """One timed ``Engine.run`` call: the per-prompt results and the timing of the whole call (every group of
    max_batch prompts summed; ttft is the first group's). Token counts are over all rows."""

    results: tuple  # GenerationResult per prompt, in prompt order
    prefill_s: float  # prompt forward passes until each group's first token is on the host
    decode_s: float  # from each group's first token on the host until its last
    ttft_s: float
    prompt_tokens: int  # real (unpadded) prompt tokens, all rows
    new_tokens: int  # kept generated tokens, all rows
    decode_tok_s: float  # tokens produced by decode steps (new_tokens - rows) / decode_s
    batch: int  # rows
    groups: int  # groups of max_batch prompts

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def timing_dict(self) -> dict:
        """The timing fields as a dict (``Engine.last_timing``; schemas/telemetry.schema.json ``last_timing``)."""
        return {k: getattr(self, k) for k in ("prefill_s", "decode_s", "prompt_tokens", "new_tokens", "batch",
                                              "ttft_s", "decode_tok_s", "groups")}

    @classmethod
    def combine(cls, results, timings: "Sequence[Timing]") -> "GenerationRun":
        """Sum the timings of the groups of one call."""
        tot = {k: sum(getattr(t, k) for t in timings) for k in ("prefill_s", "decode_s", "prompt_tokens",
                                                                "new_tokens", "batch")}
        dec_tokens = max(tot["new_tokens"] - tot["batch"], 0)
        return cls(results=tuple(results), ttft_s=timings[0].ttft_s if timings else 0.0,
                   decode_tok_s=dec_tokens / tot["decode_s"] if tot["decode_s"] > 0 else 0.0,
                   groups=len(timings), **tot)


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """logits float32 (B, V) -> int64 (B,). temperature 0 = greedy (argmax). Otherwise softmax(logits / T)
    restricted to the smallest set of tokens whose probability reaches top_p (nucleus), then a draw
    from ``gen`` (seeded => reproducible for the same batch)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)  # (B, V)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)  # (B, V)
        before = sp.cumsum(dim=-1) - sp  # probability mass strictly before each token
        sp = sp.masked_fill(before >= top_p, 0.0)  # the top token always survives (before = 0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


class _Row:
    """Host-side state of one sequence: ids, text, stop checks, streaming offsets.

    The text after each token is ``decode(ids)``, computed from a window of the last few ids instead of from the
    start (a served row calls this for every token; decoding everything again costs O(n) per token). Once the
    text of ids[:done] is complete (it does not end in U+FFFD, an unfinished UTF-8 sequence) it is kept, and the
    next tokens' text is the part of decode(ids[start:]) past decode(ids[start:done]), start being the previous
    ``done``: both decodes begin at the same token, so a decoder that treats the first token of a call
    differently (a sentencepiece-style leading space) treats both alike. Should the window's text not begin with
    the context's, the whole of ids is decoded instead."""

    def __init__(self, idx, prompt_len, decode, stop, eos_ids, on_token):
        self.idx, self.prompt_len, self.decode, self.stop, self.eos = idx, prompt_len, decode, stop, eos_ids
        self.on_token = on_token
        self.ids: list[int] = []
        self.text, self.emitted, self.finish = "", 0, None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self._done, self._start = 0, 0  # ids[:_done] have complete text _stable; the window starts at ids[_start]
        self._stable, self._context = "", ""  # decode(ids[:_done]), decode(ids[_start:_done])

    def _decoded(self) -> str:
        """decode(self.ids), from the window (see the class docstring)."""
        window = self.decode(self.ids[self._start:])
        if window.startswith(self._context):
            text = self._stable + window[len(self._context):]
        else:  # this decoder's text of the context changed with the tokens after it: decode it all
            text = self.decode(self.ids)
        if not text.endswith("\ufffd"):  # complete: the next window starts where this one's new tokens began
            self._start, self._done = min(self._done, len(self.ids) - 1), len(self.ids)
            self._stable = text
            self._context = self.decode(self.ids[self._start:self._done])
        return text

    def push(self, tid: int, max_new: int) -> None:
        if tid in self.eos:
            return self._finish("eos")
        self.ids.append(tid)
        text = self._decoded()
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = text[:cut]
            self._emit(tid, len(self.text))
            return self._finish("stop", flushed=True)
        self.text = text
        safe = len(text) - self.hold
        while safe > self.emitted and text[safe - 1] == "\ufffd":  # incomplete UTF-8 at the end
            safe -= 1
        self._emit(tid, safe)
        if len(self.ids) >= max_new:
            self._finish("length")

    def _emit(self, tid, upto):
        if self.on_token is None:
            return
        delta = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        self.on_token(self.idx, tid, delta)

    def _finish(self, reason, flushed=False):
        self.finish = reason
        if not flushed and self.on_token is not None and len(self.text) > self.emitted:
            self.on_token(self.idx, None, self.text[self.emitted:])
            self.emitted = len(self.text)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one batch: int64 (B, P) token ids, each row right-aligned (P = the longest prompt, pad_id to its
    left), and int64 (B,) the padding of each row. Host tensors."""
    P = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
    return tokens, torch.tensor([P - len(p) for p in prompts], dtype=torch.long)


def generate_batch(model: StepModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad_id: int,
                   eos_ids=frozenset(), decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                   temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                   on_token=None, row_offset: int = 0) -> tuple[list[GenerationResult], Timing]:
    """Generate for up to max_batch prompts at once (left padding). See the module docstring."""
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise GenerationError(f"temperature must be >= 0 and top_p in (0, 1]; got {temperature}, {top_p}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if any(not s for s in stop):
        raise GenerationError("an empty stop string would end every answer at once; give non-empty stop strings")
    if any(len(p) == 0 for p in prompts):
        raise GenerationError("an empty prompt cannot be generated from (no token to condition on)")
    B, P = len(prompts), max(len(p) for p in prompts)
    if P + max_new_tokens - 1 > model.max_seq_len:
        raise GenerationError(f"prompt length {P} + max_new_tokens {max_new_tokens} - 1 exceeds the KV cache "
                              f"(max_seq_len {model.max_seq_len}); build the engine with a larger max_seq_len")
    dev = model.device
    t0 = time.perf_counter()
    tokens, pad = left_pad(prompts, pad_id)
    pad_d, tokens_d = pad.to(dev), tokens.to(dev)
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    rows = [_Row(row_offset + b, len(p), decode, tuple(stop), eos_ids, on_token) for b, p in enumerate(prompts)]

    tok = sample(model.prefill(tokens_d, pad_d), temperature, top_p, gen)  # (B,) device
    pinned = dev.type == "cuda"
    host = torch.empty(B, dtype=torch.long, pin_memory=pinned)
    ttft = None
    for s in range(max_new_tokens):
        host.copy_(tok, non_blocking=pinned)
        ev = torch.cuda.Event() if pinned else None
        if ev is not None:
            ev.record()
        if ttft is None:  # first token: read it before queueing decode work, so TTFT holds only the prefill
            if ev is not None:
                ev.synchronize()
            ttft = time.perf_counter() - t0
        nxt = None
        if s < max_new_tokens - 1:  # launch the next step before reading this token (see docstring)
            nxt = sample(model.decode(tok, P + s, pad_d), temperature, top_p, gen)
        if ev is not None:
            ev.synchronize()
        for r, tid in zip(rows, host.tolist()):
            if r.finish is None:
                r.push(int(tid), max_new_tokens)
        if all(r.finish for r in rows):
            break
        tok = nxt
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    total = time.perf_counter() - t0
    results = [GenerationResult(r.text, r.ids, r.finish or "length", r.prompt_len) for r in rows]
    new = sum(len(r.ids) for r in rows)
    dec = total - ttft
    timing = Timing(prefill_s=ttft, decode_s=dec, ttft_s=ttft, prompt_tokens=sum(len(p) for p in prompts),
                    new_tokens=new, decode_tok_s=(max(new - B, 0) / dec) if dec > 0 else 0.0, batch=B)
    return results, timing


def prefill_warmup_shapes(*, max_seq_len: int, prefill_chunk: int, max_batch: int,
                          join_tokens: int = 0, top_k: int | None = None) -> list[list[int]]:
    """Prompt lengths of the prefills a server runs before it reports ready: one list of row lengths per pass.

    A Triton kernel compiles a variant per value of its size-derived constexprs (the grouped executor's pair
    buckets: next power of two of the pair count in the decode form; the tiles ``default_config`` picks by pair
    count, whose bounds are powers of two; its decoded-weights mode's tiles), so a
    prefill of a new size class inside a request stalls every running row for the compilation (seconds: the
    first H200 load run saw time-to-first-token p99 of 2.8 s at 8 clients, results/serve/load/). The counts
    these constexprs round up are tokens per pass times powers of two, so one pass with T = 1 and with
    T = 2**j + 1 tokens for every j up to the largest pass the server can run reaches every bucket (the pass
    sizes themselves are not specialized: do_not_specialize in the kernels). The largest pass is a joint prefill
    of ``join_tokens`` tokens (rows x positions per chunk) or one prompt's chunk of min(prefill_chunk,
    max_seq_len) positions; a pass larger than one row is spread over rows whose lengths differ by at most one
    and sum to T (the tokens the MoE routes: pad positions are masked out before it)."""
    if min(max_seq_len, prefill_chunk, max_batch) < 1:
        raise ValueError(f"max_seq_len {max_seq_len}, prefill_chunk {prefill_chunk} and max_batch {max_batch} "
                         "must be >= 1")
    per_row = min(prefill_chunk, max_seq_len)  # positions of one row in one pass
    largest = max(per_row, min(join_tokens, max_batch * per_row))
    sizes = [1]
    j = 0
    while (1 << j) + 1 <= largest:
        sizes.append((1 << j) + 1)
        j += 1
    if sizes[-1] != largest:
        sizes.append(largest)
    if top_k is not None:  # the first pass the grouped executor runs with its weights decoded once: its own variants
        from runmap.kernels.grouped import DEQUANT_MIN_PAIRS

        first = -(-DEQUANT_MIN_PAIRS // top_k)
        if first <= largest and first not in sizes:
            sizes = sorted([*sizes, first])
    shapes = []
    for t in sizes:
        rows = -(-t // per_row)  # ceil: the fewest rows that hold t tokens
        q, r = divmod(t, rows)
        # lengths that differ by at most one and sum to exactly t: the MoE sees only real tokens (a pad position is
        # masked out before routing), so the pass routes t tokens, as a joint prefill of prompts of these lengths
        # does (several rows of different lengths are padded like one)
        shapes.append([q + 1] * r + [q] * (rows - r))
    return shapes
