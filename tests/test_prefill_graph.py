"""Short prefill passes as CUDA graphs (runmap/engine/prefill_graph.py): the prompt padded on the right to its length
bucket, logits read at the last real position, the routing workload's draws and the recorded routes over the real
positions only, and captured decoders rebuilt when built without the engine's routing buffers.

On the CPU the same fixed-shape pass runs without a graph (GraphPrefiller(capture=False)) and must give what the
eager pass gives; with RUNMAP_TEST_DEVICE=cuda the engine captures and replays it."""
import numpy as np
import pytest
import torch

from runmap.engine.engine import Engine
from runmap.engine.prefill_graph import (PREFILL_BUCKETS, PREFILL_GRAPH_MAX_ROW_TOKENS, PREFILL_GRAPH_MAX_TOKENS,
                                         GraphPrefiller, prefill_bucket)
from runmap.engine.model import run_pieces
from test_model_support import build_packs


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return build_packs(tmp_path_factory)


def test_bucket_is_the_smallest_that_holds_the_prompt():
    for n in range(1, PREFILL_BUCKETS[-1] + 40):
        b = prefill_bucket(n)
        if n > PREFILL_BUCKETS[-1]:
            assert b is None
            continue
        assert b in PREFILL_BUCKETS and b >= n
        assert all(c < n for c in PREFILL_BUCKETS if c < b)  # no smaller bucket holds n
        if n > 128:
            assert b <= 1.5 * n  # the padded tail stays under a third of the pass past 128 positions


def _engine(packs, test_device, **kw):
    executor = "grouped" if test_device == "cuda" else "reference"  # the interpreter is slow; the pass is the same
    kw = {"executor": executor, "device": test_device, "max_batch": 2, "max_seq_len": 96, **kw}
    eng = Engine.from_pack(packs["tiny-olmoe"], **kw)
    if test_device != "cuda":  # the fixed-shape pass without a graph
        assert eng._prefiller is None  # no graphs on the CPU: the engine itself never takes this path there
        eng._prefiller = GraphPrefiller(eng, None, capture=False)
    assert eng._prefiller is not None
    return eng


def _eager(eng, tokens, pad):
    return run_pieces(eng.prefill_pieces(tokens, pad, pad_host=pad.cpu().numpy()))


def test_bucket_for_keeps_passes_within_the_cache_the_chunk_and_the_token_cap(packs, test_device):
    eng = _engine(packs, test_device)
    g = eng._prefiller
    assert g.bucket_for(1, 60) == 64 and g.bucket_for(2, 60) == 64
    assert g.bucket_for(1, 90) is None  # bucket 128 > max_seq_len 96: the tail would run past the KV cache
    eng.prefill_chunk = 32
    assert g.bucket_for(1, 20) == 32 and g.bucket_for(1, 33) is None  # one pass never exceeds a chunk
    eng.prefill_chunk, eng.max_seq_len = 8192, 8192
    assert g.bucket_for(1, 1000) == 1024 and g.bucket_for(1, 2048) == 2048 and g.bucket_for(1, 2049) == 3072
    # one row up to PREFILL_GRAPH_MAX_ROW_TOKENS, several rows up to PREFILL_GRAPH_MAX_TOKENS in all
    assert g.bucket_for(1, 4096) == 4096 == PREFILL_GRAPH_MAX_ROW_TOKENS and g.bucket_for(1, 4097) is None
    assert g.bucket_for(2, 1100) is None  # 2 x 1,536 > PREFILL_GRAPH_MAX_TOKENS
    assert g.bucket_for(2, 2048) is None and g.bucket_for(3, 700) is None
    assert 2 * 1024 <= PREFILL_GRAPH_MAX_TOKENS and g.bucket_for(2, 1000) == 1024


@pytest.mark.parametrize("lengths", [[7], [20, 17], [30, 25]])
def test_padded_pass_gives_the_eager_logits_and_cache(packs, test_device, lengths):
    """Same logits at the last real position and the same keys / values at every real slot as the eager pass; a
    second, shorter prompt in the same bucket reuses the pass and reads its own last position (the tail refilled)."""
    torch.manual_seed(0)
    eng = _engine(packs, test_device)
    V = eng.cfg.vocab_size
    B = 2 if len(lengths) == 2 else 1
    # a few fp16 steps: the CPU's FP32 matmuls and attention block differently for another row count
    tol = 2e-2 if test_device == "cuda" else 3e-3
    n_passes = len(eng._prefiller.passes)  # on CUDA warm_up captured batch 1 at every bucket
    for P in lengths:  # in one bucket (32) when two: the second reuses the first's pass
        pad_h = np.array([0, 3][:B])
        tokens = torch.randint(1, V, (B, P)).to(eng.device)
        pad = torch.as_tensor(pad_h).to(eng.device)
        want = _eager(eng, tokens, pad).float().cpu()
        k_want = eng.kv.k[:, :B, :, :P].clone()
        v_want = eng.kv.v[:, :B, :, :P].clone()
        eng.kv.k.normal_()  # poison: the graph pass must write every real slot itself
        eng.kv.v.normal_()
        before = eng.prefill_paths["graphs"]
        got = eng.prefill(tokens, pad).float().cpu()
        assert eng.prefill_paths["graphs"] == before + 1
        st = eng._prefiller._pass(B, eng._prefiller.bucket_for(B, P), bool(pad_h.any()), False, False)
        assert torch.equal(st.tok[:, :P], tokens) and (st.tok[:, P:] == eng.pad_id).all()  # the tail refilled
        assert got.shape == want.shape == (B, V)
        assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for b in range(B):  # left pads' slots hold nothing anyone reads
            s = slice(int(pad_h[b]), P)
            for mine, ref in ((eng.kv.k, k_want), (eng.kv.v, v_want)):
                ref_bs = ref[:, b, :, s].float()  # fp16 values: a rounding step grows with them (1 ulp at 4-8 is 3.9e-3)
                assert (mine[:, b, :, s].float() - ref_bs).abs().max().item() <= tol * max(1.0, ref_bs.abs().max().item())
    assert len(eng._prefiller.passes) <= n_passes + 1


@pytest.mark.parametrize("lengths", [[20], [20, 17, 9]])
def test_a_join_pass_into_the_last_rows_gives_the_eager_logits_and_cache(packs, test_device, lengths):
    """A server's join (Engine.prefill with kv_row0): the pass of the k prompts writes KV rows max_batch - k.. (the
    rows of the running requests below stay untouched) and gives what the eager pass into rows 0..k-1 gives; with
    several rows it is the padded pass even when no row is padded."""
    torch.manual_seed(1)
    eng = _engine(packs, test_device, max_batch=4)
    V, k = eng.cfg.vocab_size, len(lengths)
    tol = 2e-2 if test_device == "cuda" else 3e-3
    P = max(lengths)
    pad_h = np.array([P - n for n in lengths])
    tokens = torch.randint(1, V, (k, P)).to(eng.device)
    pad = torch.as_tensor(pad_h).to(eng.device)
    want = _eager(eng, tokens, pad).float().cpu()
    k_want, v_want = eng.kv.k[:, :k, :, :P].clone(), eng.kv.v[:, :k, :, :P].clone()
    eng.kv.k.normal_()
    eng.kv.v.normal_()
    below_k, below_v = eng.kv.k[:, :4 - k].clone(), eng.kv.v[:, :4 - k].clone()
    before = eng.prefill_paths["graphs"]
    row0 = 4 - k
    got = eng.prefill(tokens, pad, pad_host=pad_h.tolist(), kv_row0=row0, padded_pass=k > 1).float().cpu()
    assert eng.prefill_paths["graphs"] == before + 1
    assert (k, 32, k > 1, False, False, row0) in eng._prefiller.passes  # its own pass: row offset and padded in its key
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(eng.kv.k[:, :row0], below_k) and torch.equal(eng.kv.v[:, :row0], below_v)
    for b in range(k):
        s = slice(int(pad_h[b]), P)
        for mine, ref in ((eng.kv.k, k_want), (eng.kv.v, v_want)):
            assert (mine[:, row0 + b, :, s].float() - ref[:, b, :, s].float()).abs().max().item() <= tol
    with pytest.raises(ValueError, match="outside the KV cache"):
        eng.prefill(tokens, pad, kv_row0=5 - k)
    with pytest.raises(ValueError, match="not both"):
        eng.prefill(tokens, pad, kv=eng.kv.rows(0, k), kv_row0=0)


def test_prepare_join_passes_takes_every_rows_and_bucket_a_pass_fits(packs, test_device):
    eng = _engine(packs, test_device, max_batch=3)
    n = eng.prepare_join_passes()
    keys = {(B, Pb, padded, row0) for B, Pb, padded, _, _, row0 in eng._prefiller.passes}
    want = {(B, Pb, B > 1, 3 - B) for B in (1, 2, 3) for Pb in PREFILL_BUCKETS
            if eng._prefiller.bucket_for(B, Pb) == Pb}
    assert n == len(want) and want <= keys and (1, 64, False, 2) in want and (3, 16, True, 0) in want
    eng._prefiller = None  # no graph prefill (the CPU engine, partial residency, a budget): nothing to capture
    assert eng.prepare_join_passes() == 0 and eng.join_pass_bucket(1, 1) is None


def test_generate_through_the_padded_pass_equals_eager_generation(packs, test_device):
    """Whole requests: the same tokens, and under a routing workload with a route recorder the same imposed draws and
    the same recorded routes (the real positions only) as an engine whose prefill runs eagerly."""
    prompts = [[5, 9, 1, 4, 7, 3, 3, 8, 2], [8, 3, 2, 6]]
    runs = []
    for graph in (False, True):
        eng = _engine(packs, test_device, routing="calibrated", record_routes=True)
        if not graph:
            eng._prefiller = None
        out = [r.token_ids for r in eng.generate(prompts, max_new_tokens=5)]
        if graph:  # the batch's pass: row 0's tail position 15 (P = 9, bucket 16) took the filler routes
            st = eng._prefiller.passes[(2, 16, True, True, True, 0)]  # rows, bucket, padded, workload, recorder, row0
            assert torch.equal(st.imposed[:, 15].cpu(), torch.arange(eng.cfg.top_k).expand(eng.cfg.num_layers, -1))
        out += [r.token_ids for r in eng.generate(prompts[:1], max_new_tokens=5)]
        st = eng.stats()
        assert st.prefill_passes_graphs == (2 if graph else 0)
        runs.append((out, eng.routes.trace()))
    (a, ta), (b, tb) = runs
    assert a == b
    assert len(ta.streams) == len(tb.streams) == 3
    for x, y, n in zip(ta.streams, tb.streams, (9, 4, 9)):
        assert np.array_equal(x, y) and len(x) == n + 4  # prompt positions + the 4 decode steps after the first token


@pytest.mark.parametrize("graph", [False, True])
def test_warm_up_never_leaves_a_decoder_without_the_routing_buffers(packs, test_device, graph):
    """warm_up sets the routing workload and the recorder aside while it captures; the decoders it built must not
    serve the run that follows (they would route by the router and record nothing)."""
    prompts = [[5, 9, 1, 4, 7]]
    kw = dict(routing="calibrated", record_routes=True)
    if not graph:  # partial residency: the segment chain (without graphs on the CPU)
        kw.update(resident=6, segments=True if test_device == "cuda" else "eager",
                  executor="grouped" if test_device == "cuda" else "reference", device=test_device, max_batch=1,
                  max_seq_len=48)
        cold = Engine.from_pack(packs["tiny-olmoe"], **kw)
        warm = Engine.from_pack(packs["tiny-olmoe"], **kw)
    else:
        if test_device != "cuda":
            pytest.skip("full-residency decode graphs need CUDA")
        cold = _engine(packs, test_device, warm_up=False, **kw)
        warm = _engine(packs, test_device, warm_up=True, **kw)
    warm.warm_up()
    assert warm.decode_paths == cold.decode_paths  # warm_up's own steps are not counted
    a = [r.token_ids for r in cold.generate(prompts, max_new_tokens=6)]
    b = [r.token_ids for r in warm.generate(prompts, max_new_tokens=6)]
    assert a == b
    ta, tb = cold.routes.trace(), warm.routes.trace()
    assert len(tb.streams[0]) == len(prompts[0]) + 5  # every decode step recorded
    assert np.array_equal(ta.streams[0], tb.streams[0])


def test_a_gpu_budget_keeps_prefill_eager(packs, test_device):
    """Under a GPU budget a captured pass's activations would sit in the graph pool outside the plan: eager there."""
    eng = _engine(packs, test_device)
    tokens = torch.tensor([[5, 9, 1, 4]], device=eng.device)
    pad = torch.zeros(1, dtype=torch.long, device=eng.device)
    eng.prefill(tokens, pad)
    assert eng.prefill_paths == {"graphs": 1, "eager": 0}
    eng.budget_plan = object()  # what from_pack sets with gpu_budget= (a BudgetPlan)
    eng.prefill(tokens, pad)
    assert eng.prefill_paths == {"graphs": 1, "eager": 1}


def test_warm_up_prepares_the_passes_of_one_row_and_of_max_batch_rows(packs):
    """warm_up takes every bucket a captured pass of 1 row and of max_batch rows (padded and not) runs at, so that no
    request of those shapes pays for a capture; nothing past the token caps. On the CPU the prefiller without graphs
    records which passes it would capture."""
    eng = Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", max_batch=3, max_seq_len=1000,
                           warm_up=False)
    eng._prefiller = GraphPrefiller(eng, None, capture=False)
    eng.warm_up()
    got = {(B, Pb, padded) for (B, Pb, padded, _i, _r, row0) in eng._prefiller.passes if row0 == 0}
    want = {(1, Pb, False) for Pb in PREFILL_BUCKETS if Pb <= 1000}
    want |= {(3, Pb, padded) for Pb in PREFILL_BUCKETS if 3 * Pb <= PREFILL_GRAPH_MAX_TOKENS
             for padded in (False, True)}
    assert got == want
    assert {(1, 768, False), (3, 512, False), (3, 512, True)} <= got and (3, 768, False) not in got


def test_a_concurrent_join_computes_what_a_whole_join_computes(packs, test_device):
    """--join-mode concurrent: a join's captured pass replays on a stream of its own while the running rows' decode
    steps replay theirs. Its graph has a memory pool and a capture stream (cuBLAS workspace) of its own, and it
    writes KV rows no running row reads, so the tokens of every request equal those of the same schedule with whole
    joins (the test waits for each pass before its rows join, so both runs join at the same steps)."""
    if test_device != "cuda":
        pytest.skip("a side stream beside captured decode steps needs CUDA")
    from runmap.serve.batching import BatchRunner, SamplingParams, Sequence

    eng = _engine(packs, test_device, max_batch=4)
    eng.prepare_join_passes(concurrent=True)
    joins = [st for key, st in eng._prefiller.passes.items() if key[-1] > 0]
    assert joins and all(st.in_join_pool for st in joins) and eng.join_pass_concurrent(2, 20)
    assert eng._prefiller.join_pool is not None and eng._prefiller.join_stream is not None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (9, 30, 4, 17, 23, 12)]

    def run(concurrent: bool):
        seqs = [Sequence(p, SamplingParams(max_new_tokens=14 + i, ignore_eos=True)) for i, p in enumerate(prompts)]
        with torch.inference_mode():
            r = BatchRunner(eng, concurrent=concurrent, join_tokens=0)  # every request joins alone
            waiting, steps = list(seqs), 0
            while waiting or r.rows or r.joining:
                if r.joining:
                    torch.cuda.synchronize(eng.device)  # the pass is done: its rows join at this boundary
                    r.advance_join(None)
                    assert r.finish_join()
                elif waiting and (not r.rows or steps % 3 == 0):
                    # 0: no KV room for it yet (it waits for rows to finish)
                    n = r.begin_join(waiting[:1]) if r.rows else r.admit_many(waiting[:1])
                    del waiting[:n]
                r.step()  # with a join begun: a decode step queued beside its pass
                steps += 1
                assert steps < 500
        return [s.token_ids for s in seqs], r.counters

    whole, cw = run(False)
    conc, cc = run(True)
    assert cw["concurrent_joins"] == 0 and cc["concurrent_joins"] >= 3, cc
    assert conc == whole
    # passes captured into the shared pool (prepare_join_passes without concurrent) never replay beside decode steps
    eng = _engine(packs, test_device, max_batch=4)
    eng.prepare_join_passes()
    assert not eng.join_pass_concurrent(2, 20)
    again, ca = run(True)
    assert ca["concurrent_joins"] == 0 and ca["joins"] == cw["joins"] and again == whole


def test_a_mixed_step_computes_the_decode_step_and_the_prompt_alone(packs, test_device, monkeypatch):
    """--join-mode mixed: one pass (runmap.engine.mixed_step) decodes the running rows and prefills a joining prompt,
    left-padded to its bucket so that it ends at the shared slot, in the cache's last row. Its logits are those of the
    plain decode step for the rows and of the prompt prefilled alone for the prompt; its keys and values are the
    alone pass's, moved to end at the slot. Rows bucket past the running ones (dummy rows) and a prompt shorter than
    its bucket are both exercised; on CUDA the step is a captured graph."""
    from runmap.engine import mixed_step
    from runmap.engine.mixed_step import mixed_rows

    eng = _engine(packs, test_device, max_batch=4)
    dev = eng.device
    gen = torch.Generator().manual_seed(11)
    V = eng.cfg.vocab_size
    rows = [torch.randint(1, V, (n,), generator=gen).tolist() for n in (21, 26)]  # running rows, left-padded
    prompt = torch.randint(1, V, (13,), generator=gen).tolist()  # bucket 16: three padding positions
    P0, P = 26, len(prompt)
    tokens = torch.tensor([[eng.pad_id] * (P0 - len(r)) + r for r in rows], device=dev)
    pad = torch.tensor([P0 - len(r) for r in rows], device=dev)
    with torch.inference_mode():
        eng.experts.begin()
        try:
            first = eng.prefill(tokens, pad).argmax(-1)  # (2,): the rows' first tokens, KV slots 0..25 of rows 0, 1
            slot = P0
            saved = eng.kv.k.clone(), eng.kv.v.clone()
            want_rows = eng.decode(first, slot, pad).clone()  # (2, V)
            want_kv = eng.kv.k[:, :2, :, slot].clone()
            alone = eng.prefill(torch.tensor([prompt], device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                                kv=eng.kv.rows(2, 3)).clone()  # (1, V), keys at slots 0..P-1 of row 2
            alone_k = eng.kv.k[:, 2, :, :P].clone()
            eng.kv.k.copy_(saved[0])
            eng.kv.v.copy_(saved[1])
            key = eng.mixed_step_key(2, P, slot)
            assert key is not None and key[0] == mixed_rows(2, 4) == 3 and key[1] == 16  # one dummy decode row
            got = eng.mixed_step(first, slot, pad, torch.tensor(prompt, device=dev), key)  # (3, V)
        finally:
            eng.experts.end()
    assert got.shape == (3, V) and torch.isfinite(got).all()
    tol = dict(atol=0.05, rtol=0.0) if test_device == "cuda" else dict(atol=2e-3, rtol=0.0)
    torch.testing.assert_close(got[:2], want_rows, **tol)
    torch.testing.assert_close(got[2:], alone, **tol)
    assert (got[:2].argmax(-1) == want_rows.argmax(-1)).all() and got[2].argmax() == alone[0].argmax()
    # the rows' new keys at the slot, and the prompt's keys in the last row ending at the slot
    torch.testing.assert_close(eng.kv.k[:, :2, :, slot], want_kv, atol=2e-2, rtol=0.0)
    torch.testing.assert_close(eng.kv.k[:, 3, :, slot + 1 - P:slot + 1], alone_k, atol=2e-2, rtol=0.0)
    # shapes a mixed step does not take: a prompt whose bucket ends before slot 0, a batch with no free row, a prompt
    # past the largest mixed prompt (cut to 32 here, so that its bucket still fits the slot)
    assert eng.mixed_step_key(2, 20, 10) is None and eng.mixed_step_key(4, 5, 40) is None
    monkeypatch.setattr(mixed_step, "MIXED_MAX_PROMPT", 32)
    assert eng.mixed_step_key(2, 32, 90) is not None and eng.mixed_step_key(2, 33, 90) is None


def test_mixed_step_shapes_are_the_smallest_that_hold_them():
    """A mixed step pads its prompt to the smallest of MIXED_BUCKETS that holds it (none past MIXED_MAX_PROMPT) and
    rounds its decode rows up to a multiple of MIXED_ROWS_STEP below the row its prompt takes."""
    from runmap.engine.mixed_step import MIXED_BUCKETS, MIXED_MAX_PROMPT, MIXED_ROWS_STEP, mixed_bucket, mixed_rows

    for n in range(1, MIXED_MAX_PROMPT + 40):
        b = mixed_bucket(n)
        if n > MIXED_MAX_PROMPT:
            assert b is None
            continue
        assert b in MIXED_BUCKETS and b >= n and all(c < n for c in MIXED_BUCKETS if c < b)
    for max_batch in (2, 3, 9, 32, 64):
        for B in range(1, max_batch):
            Bc = mixed_rows(B, max_batch)
            assert B <= Bc <= max_batch - 1 and (Bc % MIXED_ROWS_STEP == 0 or Bc == max_batch - 1)
            assert Bc - B < MIXED_ROWS_STEP
