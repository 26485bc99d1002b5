"""Continuous batching (runmap.serve.batching) against the engine's own generation, and --gpu-budget.

Rows join a running batch between decode steps (alone or several together in one left-padded prefill, into
free rows of the engine's KV cache, moved to end at the shared slot, the running rows shifted when the new prompt is longer than the shared slot or
when slots must be reclaimed), leave it when they finish or are cancelled (the last row moved into the
hole), and wait when the KV cache has no room. Whatever the schedule, each request's tokens must be those
of ``Engine.generate`` on that request alone: greedy and seeded sampling, both model families, the CPU
order of operations and the pipelined (CUDA) one.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_model_support import build_packs

from runmap.serve.batching import BatchRunner, SamplingParams, Sequence, prefill_warmup_shapes
from runmap.engine.budget import BudgetError, parse_size, plan, plan_for_pack

MAX_SEQ_LEN = 72
WORDS = "the sea sky river mountain poem write tell name three quick brown fox".split()


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return build_packs(tmp_path_factory)


@pytest.fixture(scope="module")
def engines(packs):
    from runmap.engine.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield {name: Engine.from_pack(pk, executor="reference", device="cpu", max_batch=3, max_seq_len=MAX_SEQ_LEN)
               for name, pk in packs.items()}
    finally:
        torch.set_num_threads(threads)


def _requests(eng, seed: int, n: int = 9):
    rng = random.Random(seed)
    out = []
    for k in range(n):
        ids = eng.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 7))))
        m = rng.randint(1, min(24, MAX_SEQ_LEN - len(ids) + 1))
        out.append((ids, SamplingParams(max_new_tokens=m, temperature=0.8 if k % 3 == 0 else 0.0, top_p=0.9,
                                        seed=100 + k)))
    return out


def _alone(eng, reqs):
    return [eng.generate([ids], max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                         seed=p.seed)[0] for ids, p in reqs]



def _assert_tokens_alone(eng, reqs, alone, seqs, label: str = "") -> None:
    """Each request's tokens equal its run alone, up to an exact tie: a greedy request may take the other of two
    tokens whose logits tie at the first position where they differ (the joined row's padded or fixed-shape pass
    rounds otherwise than the prompt alone; measured on an AVX-512 CPU: tied to the last bit in the logits of the
    prompt alone). The tie is checked on the logits of the prompt alone and the common prefix, so any other
    difference, or one in a sampled request, fails."""
    for k, (a, s) in enumerate(zip(alone, seqs)):
        if s.token_ids == a.token_ids:
            assert s.text == a.text and s.finish_reason == a.finish_reason, f"{label} request {k}"
            continue
        prompt, params = reqs[k]
        j = next((i for i, (x, y) in enumerate(zip(a.token_ids, s.token_ids)) if x != y), None)
        assert j is not None and params.temperature == 0.0, \
            f"{label} request {k}: {s.token_ids} against {a.token_ids} alone"
        lg = eng.logits(list(prompt) + a.token_ids[:j])[-1]  # (V,) fp32 at the first differing position
        tol = 8 * torch.finfo(torch.float32).eps * max(1.0, float(lg.abs().max()))  # a few fp32 rounding steps
        top = float(lg.max())
        assert top - float(lg[s.token_ids[j]]) <= tol and top - float(lg[a.token_ids[j]]) <= tol, \
            f"{label} request {k}: token {j} is {s.token_ids[j]}, alone {a.token_ids[j]}, logits " \
            f"{float(lg[s.token_ids[j]]):.9g} / {float(lg[a.token_ids[j]]):.9g}, max {top:.9g}"


class _RunningPass:
    """Stands in, on the CPU, for a concurrent join's CUDA event: its pass reads as still running for the first
    ``n`` queries (the CPU ran it already; what is tested is the runner's order of joins, steps and leaves). On the
    CPU no join has a side stream, so the tests that install it create a state a CUDA run reaches with one (a
    pending pass beside running rows), not one it reaches without (there the join runs in line)."""

    def __init__(self, n: int):
        self.n = n

    def query(self) -> bool:
        self.n -= 1
        return self.n < 0


def _run_schedule(eng, reqs, *, pipelined: bool, seed: int, cancel: int | None = None, joint: bool | str = False):
    """Admit requests at random step boundaries (FIFO, as the scheduler does); returns (seqs, runner, refusals).
    joint: the requests that arrived by then join together (admit_many), as the server admits them;
    "interleaved": and while rows run, the join's prefill is spread over the next steps (begin_join, then 0 to 3
    of its pieces per step boundary), as the server runs it; "concurrent": and while rows run, the join's pass
    reads as running beside 0 to 4 more steps before its rows may join; "mixed": and while rows run, the first arrived
    request's prompt is computed inside the next decode step where it fits (else it joins whole)."""
    rng = random.Random(seed)
    seqs = [Sequence(ids, p) for ids, p in reqs]
    waiting, refused, steps = list(seqs), 0, 0
    with torch.inference_mode():
        r = BatchRunner(eng, pipelined=pipelined, interleave=joint == "interleaved",
                        concurrent=joint == "concurrent", mixed=joint == "mixed")
        if joint == "concurrent":  # the CPU has no side stream: the pass's completion event is simulated
            r._pass_done_event = lambda stream: _RunningPass(rng.randint(0, 4))
        while waiting or r.rows or r.joining:
            if r.joining:
                for _ in range(rng.randint(0, 3)):
                    if r.advance_join(0.0):
                        break
                r.finish_join()
            elif joint in ("interleaved", "concurrent", "mixed") and r.rows and rng.random() < 0.5 and \
                    (joint != "interleaved" or r.can_interleave()):
                arrived = waiting[: rng.randint(1, 3)]
                n = r.begin_join(arrived, interleave=joint == "interleaved")
                refused += n < len(arrived)
                del waiting[:n]
            elif joint and (not r.rows or rng.random() < 0.5):
                arrived = waiting[: rng.randint(1, 3)]
                n = r.admit_many(arrived)
                refused += n < len(arrived)
                del waiting[:n]
            while not joint and waiting and (not r.rows or rng.random() < 0.5):
                if not r.admit(waiting[0]):
                    refused += 1
                    break
                waiting.pop(0)
            if cancel is not None and steps == 3:
                seqs[cancel].cancel()
            r.step()
            steps += 1
            assert steps < 2000
    return seqs, r, refused


# the CPU run: tiny-olmoe every schedule in CPU order and the pipelined loop's joint and mixed joins, tiny-qwen2-moe one
# schedule of each loop; a GPU every point (conftest.py, sweep)
@pytest.mark.sweep(lambda p: (p["preset"], p["pipelined"], p["joint"]) not in {
    ("tiny-olmoe", False, j) for j in (False, True, "interleaved", "concurrent", "mixed")}
    | {("tiny-olmoe", True, True), ("tiny-olmoe", True, "mixed"), ("tiny-qwen2-moe", False, "mixed"),
       ("tiny-qwen2-moe", True, "concurrent")})
@pytest.mark.parametrize("joint", [False, True, "interleaved", "concurrent", "mixed"],
                         ids=["one-by-one", "joint", "interleaved", "concurrent", "mixed"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["cpu-order", "pipelined"])
@pytest.mark.parametrize("preset", ["tiny-olmoe", "tiny-qwen2-moe"])
def test_every_request_gets_its_tokens_alone_whatever_the_schedule(engines, preset, pipelined, joint, monkeypatch):
    eng = engines[preset]
    totals = {"joined_running": 0, "shifts": 0, "row_moves": 0, "refused": 0}
    joints = padded = interleaved = concurrent = waits = moved = mixed = 0
    move = BatchRunner._move_kv

    def counting_move(self, src, dst, *a):  # a join whose rows moved down: rows left during its prefill
        nonlocal moved
        moved += src != dst
        return move(self, src, dst, *a)
    monkeypatch.setattr(BatchRunner, "_move_kv", counting_move)
    for seed in (1, 2):
        reqs = _requests(eng, seed)
        alone = _alone(eng, reqs)
        seqs, r, refused = _run_schedule(eng, reqs, pipelined=pipelined, seed=seed, joint=joint)
        interleaved += r.counters["interleaved_joins"]
        concurrent += r.counters["concurrent_joins"]
        mixed += r.counters["mixed_joins"]  # requests whose prompt ran inside a decode step
        waits += r.counters["join_not_done"]  # step boundaries at which a concurrent pass was still running
        joints += r.counters["admitted"] - r.counters["joins"]  # requests that joined beside another one
        padded += r.counters["padded_joins"]  # ... in a group of different prompt lengths (a padded prefill)
        _assert_tokens_alone(eng, reqs, alone, seqs, f"seed {seed}")
        for key in ("joined_running", "shifts", "row_moves"):
            totals[key] += r.counters[key]
        totals["refused"] += refused
        assert r.rows == 0 and r.slot == 0 and not r._lead  # the full-residency lease is given back when idle
    # the schedules did exercise every path: joins, KV shifts, row moves and requests waiting for room
    assert all(v > 0 for v in totals.values()), totals
    assert (joints > 0) == bool(joint)  # joint schedules prefilled several prompts together, the others never
    assert (padded > 0) == bool(joint)
    # interleaved schedules ran prefills between decode steps; joined rows moved to the running ones' side: whole
    # joins are prefilled into the cache's last rows (where a server's captured passes write), interleaved ones when
    # rows left during their prefill
    assert (interleaved > 0) == (joint == "interleaved"), interleaved
    # concurrent schedules had rows decode while a join's pass ran, and took its rows in only once it was done
    assert (concurrent > 0) == (waits > 0) == (joint == "concurrent"), (concurrent, waits)
    assert (mixed > 0) == (joint == "mixed"), mixed
    assert moved > 0, moved


@pytest.mark.parametrize("pipelined", [False, True], ids=["cpu-order", "pipelined"])
def test_joins_through_the_captured_join_passes_get_the_tokens_alone(packs, pipelined, monkeypatch):
    """Whole joins replay the pass captured for their rows x bucket into the cache's last rows (on the CPU the same
    fixed-shape pass without a graph); a group stops before the request that would take it past the largest captured
    pass (cut to 64 tokens here), and each request still gets its tokens alone."""
    from runmap.engine import prefill_graph
    from runmap.engine.engine import Engine
    from runmap.engine.prefill_graph import GraphPrefiller

    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPH_MAX_TOKENS", 64)
    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPH_MAX_ROW_TOKENS", 64)  # one row too, whatever MAX_SEQ_LEN is
    eng = Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", max_batch=3,
                           max_seq_len=MAX_SEQ_LEN)
    eng._prefiller = GraphPrefiller(eng, None, capture=False)
    assert eng.join_pass_bucket(2, 20) == 32 and eng.join_pass_bucket(3, 20) is None  # 3 x 32 > 64
    for seed in (3, 4):
        reqs = _requests(eng, seed)
        alone = _alone(eng, reqs)
        before = dict(eng.prefill_paths)
        seqs, r, _ = _run_schedule(eng, reqs, pipelined=pipelined, seed=seed, joint=True)
        _assert_tokens_alone(eng, reqs, alone, seqs, f"seed {seed}")
        assert eng.prefill_paths["graphs"] > before["graphs"]  # the joins replayed the join passes
        keys = [key for key in eng._prefiller.passes if key[-1] != 0 or key[0] == 3]
        assert keys and all(row0 == 3 - B for B, _, _, _, _, row0 in keys)  # into the cache's last B rows
        assert all(B * Pb <= 64 for B, Pb, *_ in eng._prefiller.passes)
    # a group that would outgrow the largest captured pass stops short of it
    with torch.inference_mode():
        r = BatchRunner(eng)
        ids = eng.tokenizer.encode("the sea sky river mountain poem")  # a few tokens: bucket 16 or 32
        n = r.admit_many([Sequence(ids, SamplingParams(max_new_tokens=4)) for _ in range(3)])
        assert n == (3 if eng.join_pass_bucket(3, len(ids)) is not None else 2)
        r.abort_all()


def test_a_cancelled_row_leaves_at_the_next_step_and_the_others_are_unaffected(engines):
    eng = engines["tiny-olmoe"]
    reqs = [(ids, SamplingParams(max_new_tokens=20)) for ids, _ in _requests(eng, 5, n=3)]
    alone = _alone(eng, reqs)
    seqs, r, _ = _run_schedule(eng, reqs, pipelined=False, seed=0, cancel=0)
    assert seqs[0].finish_reason == "cancelled" and len(seqs[0].token_ids) < 20
    assert seqs[0].token_ids == alone[0].token_ids[:len(seqs[0].token_ids)]
    for a, s in zip(alone[1:], seqs[1:]):
        assert s.token_ids == a.token_ids


def test_a_joint_admission_takes_the_longest_fifo_prefix_that_fits(engines):
    eng = engines["tiny-olmoe"]  # max_batch 3, MAX_SEQ_LEN 72
    ids = eng.tokenizer.encode("the sea sky river")
    P = len(ids)
    with torch.inference_mode():
        r = BatchRunner(eng, pipelined=False)
        # a row that needs every slot left: a request needing more steps than it has left cannot join, and
        # neither can a later one that would fit (a request never overtakes an earlier one)
        a = Sequence(ids, SamplingParams(max_new_tokens=MAX_SEQ_LEN - P + 1, ignore_eos=True))
        assert r.admit_many([a]) == 1 and r.rows == 1
        r.step()
        r.step()
        left = MAX_SEQ_LEN - r.slot  # a's remaining decode steps, to the end of the context
        big = Sequence(ids, SamplingParams(max_new_tokens=left + 2))
        small = Sequence(ids, SamplingParams(max_new_tokens=2))
        assert r.admit_many([big, small]) == 0 and r.rows == 1
        assert r.admit_many([small, big]) == 1 and r.rows == 2 and r.pad[1] == r.slot - P
        assert r.counters["joins"] == 2
        r.abort_all()  # the runners below use the same engine's KV rows
        # at most the free rows join; join_tokens bounds the rows x longest prompt of one joint prefill
        r2 = BatchRunner(eng, pipelined=False, join_tokens=2 * P)
        seqs = [Sequence(ids, SamplingParams(max_new_tokens=2)) for _ in range(4)]
        assert r2.admit_many(seqs) == 2 and r2.admit_many(seqs[2:]) == 1 and r2.rows == 3
        r2.abort_all()
        r3 = BatchRunner(eng, pipelined=False, join_tokens=0)  # every request alone
        assert r3.admit_many(seqs) == 1 and r3.counters["joins"] == 1
        r3.abort_all()
    with pytest.raises(ValueError, match="join_tokens"):
        BatchRunner(eng, join_tokens=-1)


def test_a_request_that_can_never_fit_is_refused(engines):
    from runmap.engine.generation import GenerationError

    r = BatchRunner(engines["tiny-olmoe"])
    with pytest.raises(GenerationError, match="exceeds the context"):
        r.check(MAX_SEQ_LEN, 2)
    with pytest.raises(GenerationError):
        r.check(0, 4)
    r.check(MAX_SEQ_LEN, 1)  # the last token needs no KV slot


@pytest.mark.parametrize("text,want", [("123456", 123456), ("6GiB", 6 * 2**30), ("6G", 6 * 2**30), ("6.5GB", 6_500_000_000),
                                       ("800MiB", 800 * 2**20), ("2 mb", 2_000_000)])
def test_sizes_parse(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "six", "6 parsecs", "-1G", "0", "1e9"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(BudgetError):
        parse_size(text)


def test_the_budget_picks_the_most_experts_that_fit(packs):
    import json

    from runmap.arch.config import ModelConfig

    pk = packs["tiny-olmoe"]
    man = json.loads((pk / "manifest.json").read_text())
    cfg = ModelConfig(**man["model"])
    row, nonrouted = man["row_layout"]["row_bytes"], (pk / man["nonrouted"]["file"]).stat().st_size
    big = plan(cfg, row, nonrouted, 1 << 40, max_batch=2, max_seq_len=64, kv_rows=3)
    assert big.resident == cfg.num_experts and big.regime == "full"
    # the counted bytes of every residency, from budgets that fit exactly
    need = {}
    for r in range(cfg.top_k, cfg.num_experts + 1):
        lo, hi = 1, 1 << 40
        while lo < hi:  # the smallest budget that plans r or more experts
            mid = (lo + hi) // 2
            try:
                ok = plan(cfg, row, nonrouted, mid, max_batch=2, max_seq_len=64, kv_rows=3).resident >= r
            except BudgetError:
                ok = False
            lo, hi = (lo, mid) if ok else (mid + 1, hi)
        need[r] = lo
    for r, b in need.items():
        p = plan_for_pack(pk, b, max_batch=2, max_seq_len=64, kv_rows=3)
        assert p.resident >= r and p.total + p.slack <= b
    with pytest.raises(BudgetError, match="below the least this pack needs"):
        plan_for_pack(pk, need[cfg.top_k] - 1, max_batch=2, max_seq_len=64, kv_rows=3)

def test_serve_states_the_join_default_and_refuses_a_negative_join_size(capsys):
    from runmap.cli.main import main as cli
    from runmap.serve.batching import JOIN_TOKENS

    with pytest.raises(SystemExit) as e:
        cli(["serve", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "--max-join-tokens N" in text and f"(default {JOIN_TOKENS})" in text
    with pytest.raises(SystemExit) as e:
        cli(["serve", "--packed", "x", "--max-join-tokens", "-1"])
    assert e.value.code == 2
    assert "argument --max-join-tokens: must be at least 0, got -1" in capsys.readouterr().err


def test_a_join_that_fails_answers_its_request_and_the_queue_moves_on(engines, monkeypatch):
    """A prefill that raises (here: for one poisoned prompt, alone or in a group) gives the request at the head
    of the queue an error and takes it out; the requests behind it are then served as alone, and so is a later
    one: before, the same group was retried at every pass and nothing behind it ever ran."""
    import threading
    import time

    from runmap.serve.scheduler import Scheduler, Ticket

    eng = engines["tiny-olmoe"]
    bad = eng.tokenizer.encode("three quick brown fox")
    good = [eng.tokenizer.encode("the sea sky"), eng.tokenizer.encode("write a poem")]
    alone = _alone(eng, [(g, SamplingParams(max_new_tokens=5)) for g in good])
    pieces = eng.prefill_pieces

    def poisoned(tokens, pad, all_logits=False, **kw):
        if any(row[-len(bad):] == bad for row in tokens.tolist()):
            raise RuntimeError("injected prefill failure")
        return (yield from pieces(tokens, pad, all_logits, **kw))

    sched = Scheduler(eng, pipelined=False)
    sched.start()
    try:
        deadline = time.time() + 120
        while not sched.ready:
            assert sched.failed is None and time.time() < deadline, sched.failed
            time.sleep(0.05)
        monkeypatch.setattr(eng, "prefill_pieces", poisoned)
        events, done = {}, threading.Event()

        def submit(name, ids):
            def sink(ev):
                events.setdefault(name, []).append(ev)
                if ev[0] in ("done", "error") and len([n for n in events if events[n][-1][0] in ("done", "error")]) == 3:
                    done.set()
            sched.submit(Ticket(ids, SamplingParams(max_new_tokens=5), sink))

        submit("bad", bad)
        submit("good0", good[0])
        submit("good1", good[1])
        assert done.wait(120), events
        assert events["bad"][-1][0] == "error" and "injected prefill failure" in events["bad"][-1][1].message
        for k in (0, 1):
            kind, seq = events[f"good{k}"][-1]
            assert kind == "done" and seq.token_ids == alone[k].token_ids
        assert sched.alive and sched.waiting == 0 and sched.runner.rows == 0
        # counted once each, when they joined: not the failed group's head, not the first (failed) attempt
        assert sched.totals["prompt_tokens"] == len(good[0]) + len(good[1])
        assert len(sched.queue_waits) == 2
    finally:
        sched.stop()


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel_variant(tokens: int, top_k: int, num_experts: int) -> tuple:
    """The size-derived constexprs of the grouped executor for a pass routing ``tokens`` tokens on a GPU
    (runmap.kernels.grouped: P_PAD in the decode form; the tiles ``default_config`` picks by pair count, read from it
    so that a new pair class is covered here as soon as it exists)."""
    from unittest import mock

    from runmap.kernels import common, grouped

    pairs = tokens * top_k
    with mock.patch.object(common, "interpreting", lambda dev: False):  # the GPU's tiles, not the interpreter's
        cfg = grouped.default_config(pairs, torch.device("cuda"))
    tiles = tuple(sorted(cfg.items()))
    if pairs <= grouped.DECODE_MAX_PAIRS and not cfg.get("SORTED", False):
        return ("decode", _bucket(max(pairs, 2)), tiles)
    return ("sorted", tiles)


@settings(max_examples=60, deadline=None)
@given(max_seq_len=st.integers(1, 8192), prefill_chunk=st.integers(1, 8192), max_batch=st.integers(1, 64),
       join_tokens=st.one_of(st.integers(0, 8200), st.sampled_from([2049, 4096, 4097, 4100, 8193, 8199])),
       top_k=st.sampled_from([1, 2, 4, 6, 8]), num_experts=st.sampled_from([8, 60, 64, 128]))
def test_the_warm_up_prefills_reach_every_kernel_variant_a_server_can_run(max_seq_len, prefill_chunk, max_batch,
                                                                          join_tokens, top_k, num_experts):
    """Every pass a server can run routes between 1 and the largest pass's tokens (a joint prefill of at most
    join_tokens, or one prompt's chunk); for every such token count the warm-up has a pass with the same size-derived
    kernel constexprs, counting the tokens the MoE routes (pad positions are masked out before it). Every warm-up
    pass is one the server could run: rows <= max_batch, lengths within a chunk, rows differing by at most one."""
    shapes = prefill_warmup_shapes(max_seq_len=max_seq_len, prefill_chunk=prefill_chunk, max_batch=max_batch,
                                   join_tokens=join_tokens, top_k=top_k)
    per_row = min(prefill_chunk, max_seq_len)
    largest = max(per_row, min(join_tokens, max_batch * per_row))
    assert shapes[0] == [1]
    for lens in shapes:
        assert 1 <= len(lens) <= max_batch and all(1 <= n <= per_row for n in lens) and max(lens) - min(lens) <= 1
    warmed = {_kernel_variant(sum(lens), top_k, num_experts) for lens in shapes}
    needed = {_kernel_variant(n, top_k, num_experts) for n in range(1, largest + 1)}
    assert needed <= warmed, sorted(needed - warmed)


def test_the_warm_up_prefills_run_on_an_engine(engines):
    """The scheduler's warm-up passes are valid prefills of the engine (into its first rows; the batch is empty)."""
    from runmap.serve.scheduler import Scheduler

    eng = engines["tiny-olmoe"]
    sched = Scheduler(eng, join_tokens=2 * MAX_SEQ_LEN)
    shapes = prefill_warmup_shapes(max_seq_len=eng.max_seq_len, prefill_chunk=eng.prefill_chunk,
                                   max_batch=eng.max_batch, join_tokens=2 * MAX_SEQ_LEN)
    assert [len(s) for s in shapes][-1] > 1  # the largest pass is a joint one here
    seen = []
    real = eng.prefill
    try:
        eng.prefill = lambda tokens, pad, **kw: seen.append((tuple(tokens.shape), pad.tolist())) or real(tokens, pad, **kw)
        with torch.inference_mode():
            eng.experts.begin()
            try:
                sched._warm_prefills()
            finally:
                eng.experts.end()
    finally:
        del eng.prefill
    assert [s for s, _ in seen] == [(len(l), max(l)) for l in shapes]
    assert [p for _, p in seen] == [[max(l) - n for n in l] for l in shapes]
    assert any(len(set(l)) > 1 for l in shapes)  # a padded joint pass among them


def test_a_scheduler_gives_the_process_back_what_it_changed_when_it_stops(engines):
    """start() shortens the GIL switch interval and the warm-up freezes the startup objects out of the collector;
    stop() restores the interval and unfreezes, so a process that goes on (tests, benchmarks) is as it was."""
    import gc
    import sys
    import time

    from runmap.serve.scheduler import GIL_SWITCH_INTERVAL_S, Scheduler

    before = sys.getswitchinterval()
    assert before != GIL_SWITCH_INTERVAL_S and gc.get_freeze_count() == 0
    sched = Scheduler(engines["tiny-olmoe"])
    sched.start()
    try:
        t0 = time.monotonic()
        while not sched.ready and sched.failed is None and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        assert sched.ready, sched.failed
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S and gc.get_freeze_count() > 0
        assert sched.compiles_after_ready() is None  # on the CPU nothing is compiled: not observed
    finally:
        sched.stop()
    assert sys.getswitchinterval() == before and gc.get_freeze_count() == 0


def _ready(sched, timeout=120):
    import time

    deadline = time.time() + timeout
    while not sched.ready:
        assert sched.failed is None and time.time() < deadline, sched.failed
        time.sleep(0.05)


def _collect(sched, reqs, *, stagger_s=0.0, stagger_steps=0):
    """Submit ``reqs`` (ids, params) to a running scheduler (``stagger_s`` apart, or ``stagger_steps`` decode steps
    apart: the next one once the runner has stepped that many times since, or after 10 s, so that a schedule that
    needs rows to be running at an arrival does not depend on this CPU's speed) and wait for every last event."""
    import threading
    import time

    from runmap.serve.scheduler import Ticket

    events, lock, done = {}, threading.Lock(), threading.Event()

    def sink_for(k):
        def sink(ev):
            with lock:
                events.setdefault(k, []).append(ev)
                if ev[0] in ("done", "error") and sum(e[-1][0] in ("done", "error") for e in events.values()) == len(reqs):
                    done.set()
        return sink
    for k, (ids, p) in enumerate(reqs):
        target = sched.runner.counters["steps"] + stagger_steps
        sched.submit(Ticket(ids, p, sink_for(k)))
        time.sleep(stagger_s)
        deadline = time.monotonic() + 10.0
        while stagger_steps and sched.runner.counters["steps"] < target and time.monotonic() < deadline:
            time.sleep(0.002)
    assert done.wait(180), events
    return events


def _serve_each_alone(sched, reqs, alone, *, stagger_s: float, stagger_steps: int = 0, around=None):
    """Start ``sched``, submit ``reqs`` ``stagger_s`` and ``stagger_steps`` apart (``_collect``; inside the context ``around()`` makes, if any) and stop it;
    asserts that each request ends with its tokens alone and that the scheduler ends idle and alive. Returns the
    runner's counters before the requests (after warm-up) and after them."""
    import contextlib

    sched.start()
    try:
        _ready(sched)
        before = dict(sched.runner.counters)
        with (around or contextlib.nullcontext)():
            events = _collect(sched, reqs, stagger_s=stagger_s, stagger_steps=stagger_steps)
        for k, a in enumerate(alone):
            kind, seq = events[k][-1]
            assert kind == "done" and seq.token_ids == a.token_ids, k
        assert sched.alive and sched.waiting == 0 and sched.runner.rows == 0 and not sched.runner.joining
        return before, dict(sched.runner.counters)
    finally:
        sched.stop()


@pytest.mark.parametrize("pipelined", [False, True], ids=["cpu-order", "pipelined"])
def test_the_scheduler_interleaves_joins_with_running_rows_and_outputs_stay_those_alone(engines, pipelined, monkeypatch):
    """--join-mode interleaved: requests arriving while rows run join through prefills spread over decode steps;
    every request's tokens are still its tokens alone."""
    from runmap.serve import scheduler
    from runmap.serve.scheduler import Scheduler

    monkeypatch.setattr(scheduler, "JOIN_SLICE_S", 0.0)  # one piece per step boundary, whatever this CPU's speed
    eng = engines["tiny-olmoe"]
    reqs = [(ids, SamplingParams(max_new_tokens=12, temperature=p.temperature, top_p=p.top_p, seed=p.seed))
            for ids, p in _requests(eng, 11, n=7)]
    alone = _alone(eng, reqs)
    sched = Scheduler(eng, pipelined=pipelined, interleave_joins=True)
    pieces, spans = eng.prefill_pieces, []

    def watched(tokens, pad, all_logits=False, **kw):  # the decode steps run while this pass was open
        first = sched.runner.counters["steps"]
        out = yield from pieces(tokens, pad, all_logits, **kw)
        spans.append(sched.runner.counters["steps"] - first)
        return out
    sched.start()
    try:
        _ready(sched)
        before = dict(sched.runner.counters)
        eng.prefill_pieces = watched
        try:
            events = _collect(sched, reqs, stagger_s=0.02)
        finally:
            del eng.prefill_pieces
        for k, a in enumerate(alone):
            kind, seq = events[k][-1]
            assert kind == "done" and seq.token_ids == a.token_ids, k
        assert sched.runner.counters["interleaved_joins"] > before["interleaved_joins"]
        assert max(spans) > 0, spans  # some prefill had decode steps between its layers
        assert sched.alive and sched.waiting == 0 and sched.runner.rows == 0 and not sched.runner.joining
    finally:
        sched.stop()


def test_a_concurrent_join_whose_running_rows_all_leave_joins_an_empty_batch(engines, monkeypatch):
    """Every running row finishes while a concurrent join's pass still reads as running: the join then no longer
    waits for it (nothing runs beside it; the compute stream waits on the device), its rows take the batch from
    slot 0 and the full-residency lease is held throughout."""
    monkeypatch.setattr(BatchRunner, "_pass_done_event", lambda self, stream: _RunningPass(10**9))
    eng = engines["tiny-olmoe"]
    (a_ids, _), (b_ids, _) = _requests(eng, 13, n=2)
    short, joiner = SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=5)
    alone = _alone(eng, [(b_ids, joiner)])[0]
    with torch.inference_mode():
        r = BatchRunner(eng, pipelined=False, concurrent=True)
        assert r.admit(Sequence(a_ids, short))
        r.step()
        seq = Sequence(b_ids, joiner)
        assert r.begin_join([seq]) == 1
        steps = 0
        while r.rows:
            r.advance_join(None)
            assert not r.finish_join()  # rows still run beside the pass, which never reads as done
            assert r._lead
            r.step()
            steps += 1
        assert steps >= 1 and r.slot == 0 and r.joining and r._lead
        assert r.finish_join() and r.rows == 1 and r.counters["concurrent_joins"] == 1
        while r.rows:
            r.step()
    assert seq.token_ids == alone.token_ids and not r._lead


@pytest.mark.parametrize("pipelined", [False, True], ids=["cpu-order", "pipelined"])
def test_the_scheduler_runs_concurrent_joins_beside_running_rows_and_outputs_stay_those_alone(engines, pipelined,
                                                                                             monkeypatch):
    """--join-mode concurrent: a join begun while rows run leaves them decoding until its pass is done (on the CPU the
    pass's completion is simulated: it reads as running for 3 queries), then its rows join; every request's tokens
    are still its tokens alone, and no join waits for a pass that is not done."""
    from runmap.serve.scheduler import Scheduler

    monkeypatch.setattr(BatchRunner, "_pass_done_event", lambda self, stream: _RunningPass(3))
    eng = engines["tiny-olmoe"]
    reqs = [(ids, SamplingParams(max_new_tokens=12, temperature=p.temperature, top_p=p.top_p, seed=p.seed))
            for ids, p in _requests(eng, 12, n=7)]
    alone = _alone(eng, reqs)
    before, c = _serve_each_alone(Scheduler(eng, pipelined=pipelined, concurrent_joins=True), reqs, alone,
                                  stagger_s=0.02)
    joins = c["concurrent_joins"] - before["concurrent_joins"]
    # more checks found a pass not done than joins began: decode steps ran while passes were pending (the check right
    # after each begin_join accounts for one per join)
    assert joins > 0 and c["join_not_done"] - before["join_not_done"] > joins, c
    assert before["concurrent_joins"] >= 1  # the warm-up ran a concurrent join too


@pytest.mark.parametrize("pipelined", [False, True], ids=["cpu-order", "pipelined"])
def test_the_scheduler_runs_mixed_joins_inside_decode_steps_and_outputs_stay_those_alone(engines, pipelined):
    """--join-mode mixed: a request arriving while rows run has its prompt computed inside the next decode step
    (one request per step) once the shared slot is past its prompt's length bucket, and joins whole otherwise;
    every request's tokens are still its tokens alone, and the warm-up ran a mixed join."""
    from runmap.serve.scheduler import Scheduler

    eng = engines["tiny-olmoe"]
    reqs = [(ids, SamplingParams(max_new_tokens=24, temperature=p.temperature, top_p=p.top_p, seed=p.seed))
            for ids, p in _requests(eng, 14, n=8)]
    alone = _alone(eng, reqs)
    # each arrival 14 decode steps after the one before: the running rows' shared slot is then past a short prompt's
    # 16-position bucket while they still run (24 new tokens each); a fixed time apart missed that on a loaded CPU
    before, c = _serve_each_alone(Scheduler(eng, pipelined=pipelined, mixed_joins=True), reqs, alone, stagger_s=0.0,
                                  stagger_steps=14)
    assert before["mixed_joins"] >= 1  # the warm-up's join rode in a decode step
    assert c["mixed_joins"] > before["mixed_joins"], c


@pytest.mark.parametrize("pipelined", [False, True], ids=["cpu-order", "pipelined"])
def test_mixed_joins_with_dummy_rows_and_longer_prompts_get_their_tokens_alone(packs, pipelined):
    """A batch of up to 9 rows: mixed steps round the running rows up to 8 (several dummy rows) and take prompts of
    the 16-, 32- and 64-position buckets, as many joins as the shared slot allows; every request's tokens are still
    its tokens alone (greedy and seeded sampling)."""
    from runmap.engine.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", max_batch=10, max_seq_len=160)
        rng = random.Random(21)
        reqs = []
        for k in range(14):
            n = rng.choice([3, 12, 20, 30, 45, 60])
            ids = [rng.randrange(3, eng.cfg.vocab_size) for _ in range(n)]
            reqs.append((ids, SamplingParams(max_new_tokens=rng.randint(6, 30), temperature=0.8 if k % 4 == 0 else 0.0,
                                             top_p=0.9, seed=200 + k)))
        alone = _alone(eng, reqs)
        seqs = [Sequence(ids, p) for ids, p in reqs]
        buckets = set()
        with torch.inference_mode():
            r = BatchRunner(eng, pipelined=pipelined, mixed=True)
            waiting, steps = list(seqs), 0
            while waiting or r.rows or r.joining:
                if r.joining:
                    r.advance_join(None)
                    r.finish_join()
                elif waiting and (not r.rows or steps % 2 == 0):
                    key = r.mixed_fits(waiting[0])
                    n = r.begin_join(waiting[:2], interleave=False)
                    if n and r.joining and r._pending.mixed:
                        buckets.add((r.rows, key[0], key[1]))  # (rows, decode rows, prompt bucket) of its step
                    elif n and r.joining:
                        r.advance_join(None)
                        assert r.finish_join()
                    del waiting[:n]
                r.step()
                steps += 1
                assert steps < 3000
    finally:
        torch.set_num_threads(threads)
    for k, (a, s) in enumerate(zip(alone, seqs)):
        assert s.token_ids == a.token_ids and s.finish_reason == a.finish_reason, k
    # the steps took prompts of several buckets, and some of them ran rows past the running ones (dummy rows)
    assert {Pb for _, _, Pb in buckets} >= {32, 64}, buckets
    assert r.counters["mixed_joins"] >= 5 and any(B < Bc for B, Bc, _ in buckets), (r.counters, buckets)


def test_a_mixed_join_whose_running_rows_all_leave_joins_whole(engines):
    """CPU order: every running row finishes at the step boundary where a mixed join waits for its step; the join
    then runs whole into the empty batch (from slot 0), its request gets its tokens alone and the full-residency
    lease is held throughout."""
    eng = engines["tiny-olmoe"]
    (a_ids, _), (b_ids, _) = _requests(eng, 15, n=2)
    joiner = SamplingParams(max_new_tokens=5)
    alone = _alone(eng, [(b_ids, joiner)])[0]
    with torch.inference_mode():
        r = BatchRunner(eng, pipelined=False, mixed=True)
        long = SamplingParams(max_new_tokens=20, ignore_eos=True)
        assert r.admit(Sequence(a_ids, long))
        while r.slot < 16 + len(a_ids):  # past the prompt's bucket (16): a mixed step can take it
            r.step()
        seq = Sequence(b_ids, joiner)
        r.seqs[0].cancel()  # the running row leaves at the next step boundary, before the step is launched
        assert r.begin_join([seq]) == 1 and r.joining and r._pending.mixed
        r.step()
        assert r.rows == 0 and r.joining and r._lead and r.counters["mixed_joins"] == 0
        r.advance_join(None)  # no row runs: it joins whole
        assert r.finish_join() and r.rows == 1 and r.counters["mixed_joins"] == 0 and r.counters["joins"] == 2
        while r.rows:
            r.step()
    assert seq.token_ids == alone.token_ids and not r._lead


def test_a_mixed_join_whose_rows_all_leave_before_it_is_finished_gives_the_lease_back(engines):
    """The runner's API allows steps between a mixed join's step and finish_join: when every row (the joined one
    too) leaves meanwhile, finish_join still ends the join and gives the full-residency lease back."""
    eng = engines["tiny-olmoe"]
    (a_ids, _), (b_ids, _) = _requests(eng, 16, n=2)
    with torch.inference_mode():
        r = BatchRunner(eng, pipelined=True, mixed=True)
        assert r.admit(Sequence(a_ids, SamplingParams(max_new_tokens=30, ignore_eos=True)))
        while r.slot < 16 + len(a_ids):
            r.step()
        seq = Sequence(b_ids, SamplingParams(max_new_tokens=4))
        assert r.begin_join([seq]) == 1
        r.step()  # the mixed step: the joined request is a row, the join not yet finished
        assert r.join_running and r.rows == 2 and r.counters["mixed_joins"] == 1
        for s in r.seqs:
            s.cancel()
        r.step()
        assert r.rows == 0 and r._lead  # the pending join keeps the lease until it ends
        assert r.finish_join() and not r.joining and not r._lead
        assert seq.finish_reason == "cancelled"


def test_an_interleaved_join_that_fails_midway_answers_its_head_and_the_rest_are_served(engines, monkeypatch):
    """A prefill that raises after some of its layers ran between decode steps: the head of its group gets the
    error, the group's other requests wait again at the front of the queue and are served as alone (the running
    rows fail with the engine error, as after any failed join), and the server keeps serving."""
    import threading

    from runmap.serve import scheduler
    from runmap.serve.scheduler import Scheduler, Ticket

    monkeypatch.setattr(scheduler, "JOIN_SLICE_S", 0.0)  # one piece per step boundary, whatever this CPU's speed
    eng = engines["tiny-olmoe"]
    long_runner = eng.tokenizer.encode("river mountain")
    bad = eng.tokenizer.encode("three quick brown fox")
    good = eng.tokenizer.encode("the sea sky")
    alone = _alone(eng, [(good, SamplingParams(max_new_tokens=5))])[0]
    pieces = eng.prefill_pieces
    sched = Scheduler(eng, pipelined=False, interleave_joins=True)
    steps_inside = []  # decode steps run between the poisoned pass's first piece and its failure

    def poisoned(tokens, pad, all_logits=False, **kw):
        inner = pieces(tokens, pad, all_logits, **kw)
        poison = any(row[-len(bad):] == bad for row in tokens.tolist())
        first, n = sched.runner.counters["steps"], 0
        while True:
            try:
                marker = next(inner)
            except StopIteration as stop:
                return stop.value
            n += 1
            if poison and n == 2:  # two layers queued, then the failure
                steps_inside.append(sched.runner.counters["steps"] - first)
                inner.close()
                raise RuntimeError("injected failure inside an interleaved prefill")
            yield marker

    sched.start()
    try:
        _ready(sched)
        monkeypatch.setattr(eng, "prefill_pieces", poisoned)
        started, events = threading.Event(), {}

        def sink(name):
            def f(ev):
                events.setdefault(name, []).append(ev)
                if name == "runner" and ev[0] == "token":
                    started.set()
            return f
        sched.submit(Ticket(long_runner, SamplingParams(max_new_tokens=40, ignore_eos=True), sink("runner")))
        assert started.wait(60)  # a row is running: the next join is interleaved
        with sched._cv:  # both arrive together: one group, the poisoned prompt at its head
            sched._waiting.append(Ticket(bad, SamplingParams(max_new_tokens=5), sink("bad")))
            sched._waiting.append(Ticket(good, SamplingParams(max_new_tokens=5), sink("good")))
            sched._cv.notify()
        deadline = __import__("time").time() + 120
        while not ("good" in events and events["good"][-1][0] in ("done", "error")):
            assert __import__("time").time() < deadline, events
            __import__("time").sleep(0.05)
        assert events["bad"][-1][0] == "error" and "injected failure" in events["bad"][-1][1].message
        kind, seq = events["good"][-1]
        assert kind == "done" and seq.token_ids == alone.token_ids
        assert events["runner"][-1][0] == "error"  # it was running while the join failed
        assert steps_inside and steps_inside[0] > 0  # and decode steps ran between the failing pass's layers
        assert sched.alive and not sched.runner.joining
    finally:
        sched.stop()


def test_after_a_device_fault_every_request_of_the_batch_gets_its_error(engines, monkeypatch):
    """A decode step fails, and so does giving the experts' lease back (a device fault that keeps failing): every
    running request is still answered with the engine's error instead of waiting for ever."""
    from runmap.serve.scheduler import Scheduler

    eng = engines["tiny-olmoe"]
    sched = Scheduler(eng, pipelined=False)
    sched.start()
    try:
        _ready(sched)

        def fault(*a, **k):
            raise RuntimeError("injected device fault")
        monkeypatch.setattr(eng, "decode", fault)
        monkeypatch.setattr(sched.runner, "_release", fault)
        reqs = [(eng.tokenizer.encode(w), SamplingParams(max_new_tokens=6)) for w in ("the sea", "a poem")]
        events = _collect(sched, reqs)
        for k in range(len(reqs)):
            kind, err = events[k][-1]
            assert kind == "error" and "injected device fault" in err.message, events[k]
    finally:
        sched.stop()


@pytest.mark.parametrize("pipelined", [False, True], ids=["cpu-order", "pipelined"])
def test_a_decode_step_uploads_nothing_unless_rows_joined_or_left(engines, pipelined, monkeypatch):
    """The pads go to the device only when they changed (a join, a leave, a shift) and the pending tokens are
    reordered only when a row left: on CUDA each such upload from the host used to synchronize the stream at every
    step (the host waited for the step in flight, the device for the host's token handling)."""
    eng = engines["tiny-olmoe"]
    uploads = []
    upload = BatchRunner._upload
    monkeypatch.setattr(BatchRunner, "_upload", lambda self, t: uploads.append(t) or upload(self, t))
    with torch.inference_mode():
        r = BatchRunner(eng, pipelined=pipelined)
        short, long = (Sequence(eng.tokenizer.encode(w), SamplingParams(max_new_tokens=m, ignore_eos=True))
                       for w, m in (("the sea", 4), ("a poem", 12)))
        assert r.admit_many([short, long]) == 2
        per_step = []
        while r.rows:
            rows, n = r.rows, len(uploads)
            r.step()
            per_step.append((rows, r.rows, len(uploads) - n))
    # steps that neither follow a join nor see a row leave upload nothing; the first uploads the pads once, the one
    # where the short request leaves uploads the reorder (and the next step the new pads)
    quiet = [u for k, (before, after, u) in enumerate(per_step)
             if k > 0 and before == after and per_step[k - 1][0] == per_step[k - 1][1]]
    assert quiet and all(u == 0 for u in quiet), per_step
    assert per_step[0][2] >= 1 and sum(u for _, _, u in per_step) <= 5, per_step
