"""Host cost of a served decode step's token handling, per row-token, on the CPU (issue 17, item 6).

At 32 clients on the H200 the engine thread spent 4.8 ms per served decode step against 3.5 ms offline: the step
became host-bound. This times ``BatchRunner.step`` over a stub engine (no model work: logits are not computed,
tokens are drawn from English text through the real synthetic OLMoE tokenizer) with the scheduler's per-token
work of /metrics (time-to-first-token / inter-token histograms, the token counter), for 32 rows x 128 tokens:

  before   each token re-decodes the row's whole answer through transformers' decode (its per-id Python walk)
  after    the row's text from a window of its last tokens (runmap.engine.generation._Row) through the Rust
           tokenizer directly (runmap.engine.tokenization._direct_decode)

    PYTHONPATH=. python3 tools/explore/probe_step_host_cost.py [--rows 32] [--tokens 128] [--repeats 5]
"""
import argparse
import statistics
import tempfile
import time

import torch

from runmap.arch.config import load_preset
from runmap.engine import generation
from runmap.engine.tokenization import Tokenizer
from runmap.serve.batching import BatchRunner, SamplingParams, Sequence
from runmap.serve.metrics import ServeMetrics
from runmap.synth.corpus import CORPUS
from runmap.synth.tokenizer import write_tokenizer

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--rows", type=int, default=32)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--repeats", type=int, default=5)
args = ap.parse_args()

d = tempfile.mkdtemp(prefix="probe-tok-")
write_tokenizer(load_preset("olmoe-1b-7b-0924")[0], d)
tok = Tokenizer(d)
pool = tok.encode(CORPUS * 4)
B, M = args.rows, args.tokens


class _KV:
    def __init__(self):
        self.k = torch.zeros(1, B + 1, 1, M + 8, 1)
        self.v = torch.zeros_like(self.k)

    def rows(self, lo, hi):
        return self


class _Experts:
    full = True

    def begin(self):
        pass

    def end(self):
        pass


class StubEngine:
    """What BatchRunner needs of an engine; prefill and decode do no model work."""

    device = torch.device("cpu")
    max_batch, max_seq_len, pad_id = B + 1, M + 8, 0
    imposed = routes = None
    use_graphs = False
    experts = _Experts()

    def __init__(self):
        self.kv, self.tokenizer = _KV(), tok

    def prefill_pieces(self, tokens, pad, all_logits=False, **kw):
        yield "pass-queued"
        return torch.zeros(tokens.shape[0], 4)

    def decode(self, tokens, slot, pad):
        return torch.zeros(tokens.shape[0], 4)


def run() -> float:
    r = BatchRunner(StubEngine(), pipelined=True)
    step = {"n": 0}

    def sampled(logits, seqs):  # each row reads on through the text from its own place
        out = torch.tensor([pool[(step["n"] + 389 * b) % len(pool)] for b in range(logits.shape[0])])
        step["n"] += 1
        return out
    r._sample = sampled
    m = ServeMetrics()

    def on_token_for(holder):
        def on_token(tid, delta):  # what Scheduler._on_token does for /metrics
            s = holder[0]
            if tid is not None:
                if s.t_first is None:
                    m.ttft.observe(0.01)
                elif s.t_last is not None:
                    m.itl.observe(time.perf_counter() - s.t_last)
                m.generation_tokens.inc()
        return on_token
    seqs = []
    for _ in range(B):
        holder = [None]
        holder[0] = Sequence([5, 6, 7], SamplingParams(max_new_tokens=M, ignore_eos=True), on_token=on_token_for(holder))
        seqs.append(holder[0])
    r.admit_many(seqs)
    t0 = time.perf_counter()
    steps = 0
    while r.rows:
        r.step()
        steps += 1
    return (time.perf_counter() - t0) / steps


def whole_answer_again(self):  # the token handling before the window: decode everything, transformers' path
    return tok.hf.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


after_decoded = generation._Row._decoded
for name, decoded in (("before", whole_answer_again), ("after", after_decoded)):
    generation._Row._decoded = decoded
    per_step = statistics.median(run() for _ in range(args.repeats))
    print(f"{name:7s} {per_step * 1e3:6.3f} ms per step of {B} rows, {per_step / B * 1e6:5.1f} us per row-token "
          f"(median of {args.repeats}, {M} tokens per row)", flush=True)
generation._Row._decoded = after_decoded
