"""Placement two-site (docs/engine.md, "Two sites in one step"): in one decode step each layer's absent experts are
divided between the GPU, which reads them over the link from the host source (as placement host-read), and the CPU
site, which computes them from the same host source at the same time.

* decode logits equal full residency's: exactly with no CPU share (the same grouped kernel over the same bytes,
  wherever they lie), within the CPU kernel's tolerance with one, for tiny-olmoe and tiny-qwen2-moe;
* the cache counts a CPU-site expert once, as a CPU-site expert, never as a hit, miss or host read, and refuses one
  that is resident or not routed, counting nothing;
* the split gives the CPU round(n x share) of a layer's n absent experts, those with the fewest routed pairs.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from runmap.engine.placement import SHARE_ONE, PlacementError, TwoSitePlacement

PROMPTS = ["the cache holds", "experts that were read from the host"]
# cpu-native's FP32 sum of the CPU share added to the device part's: tests/test_placement.py measured up to 9.2e-4
# of max |logit| for a mixed placement on these packs
LOGITS_REL = 2e-3

_FULL: dict = {}  # (pack, device) -> (tokens, decode logits) of full residency


def _contract(device: str) -> str:
    # v2 on CUDA (the host source registered and mapped for the GPU's reads); v1 on the CPU, as tests/test_host_read.py
    return "v2" if device == "cuda" else "v1"


def _run(pack, device, record_decode, **kw):
    from runmap.engine.engine import Engine

    eng = record_decode(Engine.from_pack(pack, executor="grouped", device=device, max_batch=2, max_seq_len=48, **kw))
    eng._prefiller = None  # both sides' prompt passes eager (tests/test_host_read.py says why): this is about the steps
    return eng


def _full(pack, device, record_decode):
    key = (str(pack), device)
    if key not in _FULL:
        eng = _run(pack, device, record_decode)
        try:
            _FULL[key] = ([r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)],
                          eng.decoded)
        finally:
            eng.close()
    return _FULL[key]


# share None (from the rates) is 1/2 on the CPU device, where no link is read (the 0.5 case's run): on a GPU only
# (the one-graph form on the CPU device is its eager steps, one case of them; on a GPU, where it is the default and runs
# captured, every share)
@pytest.mark.parametrize("preset,share,step", [("tiny-olmoe", 0.0, "chain"), ("tiny-olmoe", 0.5, "chain"),
                                               ("tiny-olmoe", 1.0, "chain"), ("tiny-qwen2-moe", 0.5, "chain"),
                                               ("tiny-olmoe", 0.5, "graph"), ("tiny-olmoe", 0.5, "graph-mapped")]
                         + ([("tiny-olmoe", 0.0, "graph"), ("tiny-qwen2-moe", 0.5, "graph"),
                             ("tiny-olmoe", None, "graph"), ("tiny-olmoe", 1.0, "graph"),
                             ("tiny-qwen2-moe", 0.5, "graph-mapped"), ("tiny-olmoe", None, "graph-mapped")]
                            if os.environ.get("RUNMAP_TEST_DEVICE") == "cuda" else []))
# the CPU run: the chain's share 1.0 (every absent expert on the CPU) only with RUNMAP_TEST_SWEEP=1 (conftest.py)
@pytest.mark.sweep(lambda p: p["share"] == 1.0 and p["step"] == "chain")
def test_two_site_decode_equals_full_residency(seed3_tiny_packs, preset, share, step, test_device, record_decode,
                                               monkeypatch):
    """Greedy decode at batch 2 with top_k of E experts resident (most absent): every decode step runs the two-site
    step, the CPU site takes its share of the absent experts and the GPU reads the rest from the host, the decode
    logits equal full residency's (exactly without a CPU share), residency changes only by promotions between steps,
    nothing is left held and every observation is zero. share None: from the rates (1/2 on the CPU device, where no
    link is read). step: the 2L + 1 segment chain, or the one-graph step whose joins wait on the device for the
    host's CPU sum (on the CPU device its eager steps: the host joins each layer before its join kernel is queued);
    graph-mapped: that step with handoff "mapped" (the split kernel stores the host's inputs into its pinned memory
    itself, no copies)."""
    import json

    from runmap.conformance.schemas import load_schemas
    from runmap.engine.engine import TWO_SITE_HANDOFF_ENV, TWO_SITE_STEP_ENV

    step, _, handoff = step.partition("-")
    monkeypatch.setenv(TWO_SITE_STEP_ENV, step)
    if handoff:
        monkeypatch.setenv(TWO_SITE_HANDOFF_ENV, handoff)
    pack, cfg = seed3_tiny_packs[preset]
    toks_f, logits_f = _full(pack, test_device, record_decode)
    eng = _run(pack, test_device, record_decode, resident=cfg.top_k, expert_placement="two-site",
               cache_contract=_contract(test_device), two_site_share=share)
    try:
        cache = eng.experts.cache
        plan = eng.experts.placement
        c0 = dict(cache.counters)
        split0 = (plan.cpu_experts, plan.absent_experts)  # (on CUDA the engine's warm-up split too)
        toks = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]
        steps = len(eng.decoded)
        assert eng.use_two_site and eng.decode_paths["two_site"] == steps > 0
        assert all(v == 0 for k, v in eng.decode_paths.items() if k != "two_site")
        c = {k: cache.counters[k] - c0[k] for k in cache.counters}
        split_cpu, split_absent = plan.cpu_experts - split0[0], plan.absent_experts - split0[1]
        if share == 0.0:
            assert c["cpu_site_experts"] == 0 and c["host_reads"] > 0
        elif share == 1.0:  # the decode steps read nothing over the link (the prompts' passes do)
            st_ = eng.stats()
            assert c["cpu_site_experts"] > 0 and st_.host_reads == st_.prefill_host_reads > 0
        elif share is None:  # the rates decide (on a GPU a tiny expert's host read can be so fast that the CPU's
            # share rounds to none of a layer's few absent experts): the share is theirs
            cpu, read = plan.cpu_gb_s(), plan.read_gb_s
            assert cpu > 0 and read > 0 and plan.share() == pytest.approx(cpu / (cpu + read)) and plan.share() < 1
            assert c["host_reads"] > 0  # (a share below 1 leaves the GPU the rest)
        else:
            assert c["cpu_site_experts"] > 0 and c["host_reads"] > 0 and plan.share() == 0.5
        # every CPU-site expert the host's split chose was counted once (on CUDA a chain's capture runs eager steps too)
        assert c["cpu_site_experts"] == split_cpu and split_absent >= split_cpu
        assert c["promotions"] == c["transactions"]  # no miss transaction: only promotions move experts
        # the last step's slots rows, decided on the device, against the host's split of the same ids: the pairs the
        # device zeroed are exactly the CPU site's experts, the others read their device row or host row R + e
        dec, E, R = eng._two_site[2], cfg.num_experts, cache.rows_per_layer
        assert dec.one_graph == (step == "graph")
        if dec.one_graph:  # the device's count of CPU-site experts per layer, as the host's rule decided them
            assert dec.host_count_np.tolist() == [len(dec.layer_cpu[layer]) for layer in range(cfg.num_layers)]
            assert dec.host_err_np[0, 0] == 0
            assert tel_form(plan) == ("graph", "event", "mask")  # (a cpu-native site: the bound call's join)
            assert plan.describe()["step_handoff"] == (handoff or "copy") and dec.mapped_handoff == bool(handoff)
            joins = plan.describe()["joins"]  # every decode step's layers joined once (warm-ups excluded)
            assert joins["layers"] == steps * cfg.num_layers
            if share is not None:  # (from the rates, a GPU may give the CPU none of a tiny layer's absent experts)
                assert (share == 0.0) == (dec.cpu_parts == 0) == (joins["cpu_layers"] == 0)
            assert joins["cpu_layers"] <= dec.cpu_parts  # (on a GPU the capture's eager steps count parts too)
        else:
            assert tel_form(plan) == ("chain", None, None) and "joins" not in plan.describe()
        slots = dec.slots.cpu().numpy()
        for layer in range(cfg.num_layers):
            flat, keep, table = dec.host_ids_np[layer].reshape(-1), slots[layer, E:], slots[layer, :E]
            assert set(flat[keep == 0].tolist()) == set(dec.layer_cpu[layer]), layer
            for e in set(flat[keep == 1].tolist()):
                assert table[e] < R or table[e] == R + e, (layer, e, table[e])
        assert cache.outstanding_leases() == 0 and cache.live_requests() == 0
        tel = eng.telemetry()
        assert load_schemas().validate_document(json.loads(json.dumps(tel)), "telemetry") == []
        assert tel["placement"]["mode"] == "two-site" and tel["placement"]["split_cpu"] == plan.cpu_experts
        assert set(tel["placement"]) >= {"cpu_share", "cpu_gb_s", "host_read_gb_s", "probe"}
        assert all(o["status"] == "OBSERVED" and o["value"] == 0 for o in tel["observations"].values()
                   if "value" in o and o.get("unit") != "bytes/s")
    finally:
        eng.close()
    assert toks == toks_f and len(eng.decoded) == len(logits_f)
    for t, (a, b) in enumerate(zip(eng.decoded, logits_f)):
        if share == 0.0:
            assert torch.equal(a, b), f"step {t}: the GPU's host reads alone differ from full residency"
        else:
            err, bound = float((a - b).abs().max()), LOGITS_REL * float(b.abs().max())
            assert err <= bound, f"step {t}: max |diff| {err:.3g} > {bound:.3g}"


def tel_form(plan) -> tuple:
    d = plan.describe()
    return d.get("step_form"), d.get("step_wait"), d.get("step_join")


@pytest.mark.parametrize("join", ["mask", "rule"])
def test_a_one_graph_step_refuses_a_split_the_device_did_not_make(seed3_tiny_packs, test_device, record_decode,
                                                                  monkeypatch, join):
    """The host's rule giving the CPU site other experts than the device's split did would compute a sum the join adds
    to the wrong pairs (or one the join never waits for): the step raises, naming the layer and both counts, and the
    engine holds nothing afterwards. join: the bound call computing the device's pairs, checked after it publishes,
    or the rule checked before anything is computed."""
    from runmap.engine.engine import TWO_SITE_JOIN_ENV, TWO_SITE_STEP_ENV, EngineError

    monkeypatch.setenv(TWO_SITE_STEP_ENV, "graph")
    monkeypatch.setenv(TWO_SITE_JOIN_ENV, join)
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    eng = _run(pack, test_device, record_decode, resident=cfg.top_k, expert_placement="two-site",
               cache_contract=_contract(test_device), two_site_share=0.5)
    try:
        # first a run that captures the step (on a GPU; eager steps on the CPU device), so that the failures below
        # happen in a replayed step, after the whole step was queued
        before = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=3, ignore_eos=True)]
        dec = eng._two_site[2]
        assert dec.mask_join == (join == "mask") and eng.experts.placement.describe()["step_join"] == join
        # the host's rule as each join form applies it: "rule" per layer at its join (split), "mask" every layer at
        # once after the last join (split_mask)
        name = "split_mask" if join == "mask" else "split"
        real = getattr(TwoSitePlacement, name)

        def fewer_one(self, absent, q):  # one expert fewer than the rule's
            return real(self, absent, q)[:-1]

        def others_one(self, absent, q):  # as many as the rule's, the most routed instead of the least
            c = len(real(self, absent, q))
            return tuple(sorted(e for e, _ in sorted(absent, key=lambda ep: (-ep[1], -ep[0]))[:c]))

        def fewer_all(cls, pairs, absent, q):  # per layer one expert fewer than the rule's (its highest id)
            rule = real(pairs, absent, q).copy()
            for row in rule:
                row[np.flatnonzero(row)[-1:]] = False
            return rule

        def others_all(cls, pairs, absent, q):  # as many per layer as the rule's, the most routed instead
            c, E = real(pairs, absent, q).sum(axis=1), pairs.shape[1]
            key = np.where(absent, -(pairs.astype(np.int64) * E + np.arange(E)), np.iinfo(np.int64).max)
            rank = np.argsort(np.argsort(key, axis=1), axis=1)
            return absent & (rank < c[:, None])

        fewer, others = (classmethod(fewer_all), classmethod(others_all)) if join == "mask" else (fewer_one, others_one)
        for wrong, match in [(fewer, r"two-site step, layer \d+: the device's split gave the CPU site \d+ experts, "
                                     r"the host's rule \d+"),
                             (others, r"two-site step, layer \d+: the device's split gave the CPU site experts \[")]:
            monkeypatch.setattr(TwoSitePlacement, name, wrong)
            with pytest.raises(EngineError, match=match):
                eng.generate(PROMPTS, max_new_tokens=3, ignore_eos=True)
            # every layer was published before the failure synchronized: nothing waits, nothing is held, no join gave
            # up, and the engine decodes what it decoded before
            assert dec.host_err_np[0, 0] == 0
            assert eng.experts.cache.outstanding_leases() == 0 and eng.experts.cache.live_requests() == 0
            monkeypatch.setattr(TwoSitePlacement, name, classmethod(real.__func__) if join == "mask" else real)
            assert [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=3, ignore_eos=True)] == before
    finally:
        eng.close()


@pytest.mark.parametrize("tamper", ["one pair of a cpu expert kept", "an id outside the layer"])
def test_the_whole_step_check_refuses_what_the_per_layer_rule_would_miss(seed3_tiny_packs, test_device, record_decode,
                                                                           monkeypatch, tamper):
    """Join "mask" checks every layer after the step's last join, pair by pair: a CPU-site expert with one of its pairs
    kept on the device (the same experts and count as the rule's, so only the per-pair comparison sees it: the join
    would add the CPU's sum to a pair the device computed too), and a routed id outside [0, E), are each one
    EngineError naming the layer, and the engine holds nothing afterwards. (The host's buffers are edited after the
    joins, where the check reads them.)"""
    from runmap.engine.engine import TWO_SITE_STEP_ENV, EngineError, SegmentDecoder

    monkeypatch.setenv(TWO_SITE_STEP_ENV, "graph")
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    eng = _run(pack, test_device, record_decode, resident=cfg.top_k, expert_placement="two-site",
               cache_contract=_contract(test_device), two_site_share=1.0)  # (every absent expert on the CPU site)
    try:
        eng.generate(PROMPTS, max_new_tokens=3, ignore_eos=True)
        real, edited = SegmentDecoder._note_joined_layers, []

        def edit(self):
            ids, zeroed = self.host_ids_np.reshape(self.L, -1), self.host_keep_np == 0
            for layer in range(self.L if not edited else 0):
                if tamper == "an id outside the layer":
                    ids[layer, 0] = cfg.num_experts
                    edited.append(layer)
                    break
                for e in sorted(set(ids[layer][zeroed[layer]].tolist())):
                    js = np.flatnonzero((ids[layer] == e) & zeroed[layer])
                    if len(js) >= 2:  # an expert both rows route, on the CPU site: keep one of its pairs
                        self.host_keep_np[layer, js[0]] = 1
                        edited.append(layer)
                        break
                if edited:
                    break
            return real(self)
        monkeypatch.setattr(SegmentDecoder, "_note_joined_layers", edit)
        match = (r"two-site step, layer \d+: routed expert ids .* outside \[0, " if tamper == "an id outside the layer"
                 else r"two-site step, layer \d+: the device's split gave the CPU site experts \[")
        with pytest.raises(EngineError, match=match):
            eng.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
        assert edited  # (a step of these runs had an expert on the CPU site that both rows routed)
        assert eng.experts.cache.outstanding_leases() == 0 and eng.experts.cache.live_requests() == 0
    finally:
        eng.close()


@pytest.mark.parametrize("env,value,match", [
    ("RUNMAP_TWO_SITE_STEP", "graphs", r"RUNMAP_TWO_SITE_STEP='graphs': allowed values are 'graph' and 'chain'"),
    ("RUNMAP_TWO_SITE_WAIT", "spin", r"RUNMAP_TWO_SITE_WAIT='spin': allowed values are 'event' and 'poll'"),
    ("RUNMAP_TWO_SITE_JOIN", "fast", r"RUNMAP_TWO_SITE_JOIN='fast': allowed values are 'mask' and 'rule'"),
    ("RUNMAP_TWO_SITE_PROMOTIONS", "0", r"RUNMAP_TWO_SITE_PROMOTIONS='0': allowed values are integers >= 1"),
    ("RUNMAP_TWO_SITE_PROMOTIONS", "all", r"RUNMAP_TWO_SITE_PROMOTIONS='all': allowed values are integers >= 1"),
    ("RUNMAP_TWO_SITE_BALANCE", "yes", r"RUNMAP_TWO_SITE_BALANCE='yes': allowed values are 'off' and 'wait'"),
    ("RUNMAP_TWO_SITE_HANDOFF", "zero-copy",
     r"RUNMAP_TWO_SITE_HANDOFF='zero-copy': allowed values are 'copy' and 'mapped'"),
    ("RUNMAP_TWO_SITE_HANDOFF", "mapped", r"RUNMAP_TWO_SITE_HANDOFF=mapped needs the one-graph step with the event "
                                          r"wait; RUNMAP_TWO_SITE_WAIT is 'poll'"),
    ("RUNMAP_TWO_SITE_JOIN", "mask", r"RUNMAP_TWO_SITE_JOIN=mask needs a cpu-native CPU executor; this engine's is "
                                     r"cpu-int4")])
def test_the_two_site_step_options_are_checked_when_the_engine_is_built(seed3_tiny_packs, monkeypatch, env, value,
                                                                         match):
    """A bad value of an option of the two-site step is one line naming it and what is allowed, at build; the bound
    call's join needs the C kernel's site (another CPU executor joins by the rule)."""
    from runmap.engine.engine import Engine, EngineError

    monkeypatch.setenv("RUNMAP_TWO_SITE_STEP", "graph")
    monkeypatch.setenv(env, value)
    if env == "RUNMAP_TWO_SITE_HANDOFF" and value == "mapped":  # refused with the poll wait only
        monkeypatch.setenv("RUNMAP_TWO_SITE_WAIT", "poll")
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    with pytest.raises(EngineError, match=match):
        Engine.from_pack(pack, executor="grouped", device="cpu", max_batch=2, max_seq_len=48, resident=cfg.top_k,
                         expert_placement="two-site", cpu_executor="cpu-int4", two_site_share=0.5)
    if env == "RUNMAP_TWO_SITE_JOIN" and value == "mask":  # unset, such an engine joins by the rule
        monkeypatch.delenv(env)
        eng = Engine.from_pack(pack, executor="grouped", device="cpu", max_batch=2, max_seq_len=48,
                               resident=cfg.top_k, expert_placement="two-site", cpu_executor="cpu-int4",
                               two_site_share=0.5)
        try:
            assert eng.experts.placement.describe()["step_join"] == "rule"
        finally:
            eng.close()


@pytest.mark.parametrize("bad", ["0", "-2", "four", "1.5", ""])
def test_the_chooser_minimum_is_checked_before_anything_is_built_and_only_for_auto(seed3_tiny_packs, monkeypatch,
                                                                                   tmp_path, bad):
    """RUNMAP_TWO_SITE_MIN_BATCH not an integer >= 1: refused in one line naming it before anything is opened (a pack
    directory that does not exist is never reached), by placement auto, which reads it, and by any other placement
    too (a typo is not left to surface on the day the placement changes)."""
    from runmap.engine.engine import TWO_SITE_MIN_BATCH_ENV, Engine, EngineError

    monkeypatch.setenv(TWO_SITE_MIN_BATCH_ENV, bad)
    for placement in ("auto", "gpu", "two-site"):
        with pytest.raises(EngineError, match=rf"^RUNMAP_TWO_SITE_MIN_BATCH='{bad}': allowed values are integers >= 1"):
            Engine.from_pack(tmp_path / "no-such-pack", executor="grouped", device="cpu", expert_placement=placement)
    monkeypatch.setenv(TWO_SITE_MIN_BATCH_ENV, "3")  # a good value: read by auto only, another placement builds
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    eng = Engine.from_pack(pack, executor="grouped", device="cpu", max_batch=2, max_seq_len=48, resident=cfg.top_k,
                           warm_up=False)
    eng.close()


def test_the_mapped_handoff_needs_the_one_graph_step(seed3_tiny_packs, monkeypatch):
    from runmap.engine.engine import Engine, EngineError

    monkeypatch.setenv("RUNMAP_TWO_SITE_STEP", "chain")
    monkeypatch.setenv("RUNMAP_TWO_SITE_HANDOFF", "mapped")
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    with pytest.raises(EngineError, match=r"^RUNMAP_TWO_SITE_HANDOFF=mapped needs the one-graph step; this engine's "
                                          r"two-site step is the chain \(RUNMAP_TWO_SITE_STEP\)"):
        Engine.from_pack(pack, executor="grouped", device="cpu", max_batch=2, max_seq_len=48, resident=cfg.top_k,
                         expert_placement="two-site", two_site_share=0.5)


def test_the_chooser_minimum_given_to_from_pack_wins_over_a_bad_env_value(seed3_tiny_packs, monkeypatch):
    from runmap.engine.engine import TWO_SITE_MIN_BATCH_ENV, Engine

    monkeypatch.setenv(TWO_SITE_MIN_BATCH_ENV, "0")
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    eng = Engine.from_pack(pack, executor="grouped", device="cpu", max_batch=2, max_seq_len=48, resident=cfg.top_k,
                           expert_placement="auto", two_site_min_batch=2, warm_up=False)
    eng.close()


@pytest.mark.parametrize("env,value", [("RUNMAP_TWO_SITE_STEP", "bogus"), ("RUNMAP_TWO_SITE_HANDOFF", "zero"),
                                       ("RUNMAP_TWO_SITE_WAIT", ""), ("RUNMAP_TWO_SITE_PROMOTIONS", "none")])
def test_a_two_site_variable_is_checked_whatever_the_placement(tmp_path, monkeypatch, env, value):
    """A bad value of any RUNMAP_TWO_SITE_* variable is one line naming it, before the pack is opened, also where the
    placement would never read it (full residency's gpu, auto before it has chosen its sites)."""
    from runmap.engine.engine import Engine, EngineError

    monkeypatch.setenv(env, value)
    for placement in ("gpu", "auto"):
        with pytest.raises(EngineError, match=rf"^{env}='{value}': allowed values are "):
            Engine.from_pack(tmp_path / "no-such-pack", executor="grouped", device="cpu", expert_placement=placement)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True])
def test_the_chooser_minimum_given_to_from_pack_is_checked_before_anything_is_built(tmp_path, monkeypatch, bad):
    """from_pack's two_site_min_batch not an integer >= 1: refused in one line naming it and the value, before the
    pack is opened, whatever the env says (a bad env value too: the argument wins over it)."""
    from runmap.engine.engine import TWO_SITE_MIN_BATCH_ENV, Engine, EngineError

    monkeypatch.setenv(TWO_SITE_MIN_BATCH_ENV, "0")
    with pytest.raises(EngineError, match=rf"^two_site_min_batch={bad!r}: allowed values are integers >= 1"):
        Engine.from_pack(tmp_path / "no-such-pack", executor="grouped", device="cpu", expert_placement="auto",
                         two_site_min_batch=bad)
    with pytest.raises(EngineError, match=rf"^two_site_min_batch={bad!r}: allowed values are integers >= 1"):
        Engine.from_pack(tmp_path / "no-such-pack", executor="grouped", device="cpu", expert_placement="host-read",
                         two_site_min_batch=bad)


@pytest.mark.parametrize("placement", ["gpu", "host-read", "two-site", "cpu"])
def test_the_chooser_minimum_is_refused_with_a_placement_that_has_no_chooser(tmp_path, placement):
    """two_site_min_batch with a placement other than auto: one line naming it and the placement, before the pack is
    opened (never silently ignored)."""
    from runmap.engine.engine import Engine, EngineError

    with pytest.raises(EngineError, match=rf"^two_site_min_batch=2 is placement auto's .* is '{placement}'"):
        Engine.from_pack(tmp_path / "no-such-pack", executor="grouped", device="cpu", expert_placement=placement,
                         two_site_min_batch=2)


@pytest.mark.parametrize("B,H", [(1, 64), (3, 100), (8, 2048), (5, 2050)])
def test_the_join_adds_the_host_sum_only_where_the_cpu_site_has_experts(B, H, test_device):
    """kernels/site_split.add_site_sum on fresh random inputs and odd shapes, output poisoned: published (flag ==
    seq) -> part + sum in FP32 rounded once to fp16; no CPU-site expert (count 0) -> part, whatever the flag; a flag
    never published -> part, and the error flag set after the bounded wait."""
    from runmap.kernels.site_split import add_site_sum

    gen = torch.Generator().manual_seed(B * 7 + H)
    part = torch.randn(B, H, generator=gen).to(torch.float16).to(test_device)
    site_sum = (torch.randn(B, H, generator=gen) * 3).to(test_device)
    one = lambda v: torch.tensor([v], dtype=torch.int32, device=test_device)  # noqa: E731
    for count, flag, seq, spins, adds, fails in [(3, 9, 9, 1 << 20, True, False), (0, 4, 9, 1 << 20, False, False),
                                                 (2, 8, 9, 16, False, True)]:
        err = one(0)
        out = torch.full((B, H), float("nan"), dtype=torch.float16, device=test_device)
        add_site_sum(part, site_sum, one(count), one(flag), one(seq), err, out=out, max_spins=spins)
        if fails:  # gave up: NaN, never the part without the sum passed off as the layer's output
            assert torch.isnan(out.cpu()).all(), (count, flag, seq)
        else:  # the kernel's formula: the FP32 sum rounded once to fp16
            want = (part.float() + site_sum).to(torch.float16) if adds else part
            assert torch.equal(out.cpu(), want.cpu()), (count, flag, seq)
        assert int(err.item()) == int(fails)


def test_the_join_refuses_bad_arguments(test_device):
    from runmap.kernels.common import KernelInputError
    from runmap.kernels.site_split import add_site_sum

    part = torch.zeros(2, 8, dtype=torch.float16, device=test_device)
    site_sum = torch.zeros(2, 8, dtype=torch.float32, device=test_device)
    one = torch.zeros(1, dtype=torch.int32, device=test_device)
    with pytest.raises(KernelInputError, match="site_sum: shape"):
        add_site_sum(part, site_sum[:1], one, one, one, one)
    with pytest.raises(KernelInputError, match="part: dtype"):
        add_site_sum(part.float(), site_sum, one, one, one, one)
    with pytest.raises(KernelInputError, match="flag: shape"):
        add_site_sum(part, site_sum, one, torch.zeros(2, dtype=torch.int32, device=test_device), one, one)
    with pytest.raises(KernelInputError, match="max_spins"):
        add_site_sum(part, site_sum, one, one, one, one, max_spins=0)


def _cache(experts=8, resident=3, layers=2):
    from runmap.format.qpack import RowLayout
    from runmap.residency.cache import ExpertCache
    from runmap.residency.host_source import HostSource

    layout = RowLayout.build(64, 64, 64)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 256, (experts, layout.row_bytes), dtype=torch.uint8, generator=gen) for _ in range(layers)]
    return ExpertCache(HostSource.from_rows(rows, layout), resident=resident, max_group=2, policy="lfu-decay")


def test_cpu_site_experts_of_a_host_read_step_are_counted_apart_and_checked():
    from runmap.residency.cache import CacheError

    cache = _cache()
    req = cache.admit()
    mapped = sorted(req.mapping(0))
    absent = [e for e in range(8) if e not in mapped][:3]
    hit = mapped[0]
    c0 = dict(cache.counters)
    # union: one hit, three absent; the CPU site computes two of them, the GPU reads one over the link
    assert req.note_host_reads(0, np.array([[hit, absent[0]], [absent[1], absent[2]]]), cpu=absent[1:]) == 1
    d = {k: cache.counters[k] - c0[k] for k in ("hits", "misses", "host_reads", "host_read_bytes", "cpu_site_experts",
                                                "transactions")}
    assert d == {"hits": 1, "misses": 1, "host_reads": 1, "host_read_bytes": cache.row_bytes, "cpu_site_experts": 2,
                 "transactions": 0}
    assert all(cache.policy.value(0, e, cache._tick) > 0 for e in absent)  # the policy saw the CPU's uses too
    before = dict(cache.counters)
    with pytest.raises(CacheError, match=rf"experts \[{hit}\] at the CPU site"):
        req.note_host_reads(0, [hit, absent[0]], cpu=[hit])  # resident: not the CPU's
    with pytest.raises(CacheError, match=rf"experts \[{absent[1]}\] at the CPU site"):
        req.note_host_reads(0, [absent[0]], cpu=[absent[1]])  # not routed in this step
    assert dict(cache.counters) == before  # a refused note counts nothing
    req.release()


@settings(max_examples=60, deadline=None)
@given(pairs=st.dictionaries(st.integers(0, 63), st.integers(1, 16), max_size=24),
       share=st.floats(0.0, 1.0))
def test_the_split_gives_the_cpu_its_share_of_the_cheapest_experts(pairs, share):
    plan = TwoSitePlacement(None, None, share=share)
    chosen = plan.split(pairs.items())
    n = len(pairs)
    q = round(share * SHARE_ONE)
    assert plan.share_q() == q and len(chosen) == min(n, (n * q + SHARE_ONE // 2) // SHARE_ONE)
    assert abs(len(chosen) - n * share) <= 0.5 + n / SHARE_ONE and set(chosen) <= set(pairs)
    assert list(chosen) == sorted(chosen)
    if chosen and len(chosen) < n:  # no expert left to the link is cheaper for the CPU than one it took
        assert max((pairs[e], e) for e in chosen) < min((pairs[e], e) for e in pairs if e not in chosen)


@given(data=st.data(), E=st.integers(1, 69), q=st.sampled_from([0, 1, SHARE_ONE // 2, SHARE_ONE - 1, SHARE_ONE])
       | st.integers(0, SHARE_ONE))
def test_the_whole_step_split_is_each_layers_split(data, E, q):
    """split_mask (every layer of a step at once, what the one-graph step's host checks the device against) gives
    each layer exactly split's experts of that layer's absent ones (the per-layer rule the chain and join "rule" use),
    the resident experts never; any E (not only powers of two), ties in routed pairs, the share's ends."""
    layers = data.draw(st.lists(st.dictionaries(st.integers(0, E - 1), st.integers(1, 4), max_size=24), min_size=1,
                                max_size=6), label="routed pairs per layer")
    resident = [data.draw(st.sets(st.integers(0, E - 1)), label=f"resident of layer {layer}")
                for layer in range(len(layers))]
    pairs = np.zeros((len(layers), E), dtype=np.int64)
    for layer, routed in enumerate(layers):
        pairs[layer, list(routed)] = list(routed.values())
    res = np.zeros_like(pairs, dtype=bool)
    for layer in range(len(layers)):
        res[layer, list(resident[layer])] = True
    absent = (pairs > 0) & ~res
    mask = TwoSitePlacement.split_mask(pairs, absent, q)
    plan = TwoSitePlacement(None, None)
    for layer, routed in enumerate(layers):
        want = plan.split([(e, n) for e, n in routed.items() if e not in resident[layer]], q)
        assert np.flatnonzero(mask[layer]).tolist() == list(want), layer
    assert not (mask & ~absent).any()


def test_the_share_follows_the_rates_and_the_cpu_rate_learned_in_use():
    plan = TwoSitePlacement(30.0, 10.0)
    assert plan.share() == pytest.approx(0.25)
    for _ in range(4):  # four CPU parts at 30 GB/s replace the probe's 10
        plan.observe_cpu(30 << 20, (30 << 20) / 30e9)
    assert plan.share() == pytest.approx(0.5)
    assert TwoSitePlacement(None, 10.0).share() == 0.5  # the link's rate unmeasured
    assert TwoSitePlacement(30.0, 10.0, share=0.8).share() == 0.8
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(PlacementError, match="share"):
            TwoSitePlacement(30.0, 10.0, share=bad)


def test_a_learned_cpu_rate_that_starves_the_cpu_site_is_dropped_after_enough_layer_calls():
    """A rate learned in a slow moment gives the CPU site nothing, so nothing measures it again: after
    STARVED_LAYER_CALLS layer calls in a row where the probe's rate would have given the CPU an expert, the split goes
    back to the probe's rate. Layers the probe's rate gives nothing either, a fixed share, or a layer that gave the CPU
    experts do not count toward it."""
    limit = TwoSitePlacement.STARVED_LAYER_CALLS
    plan = TwoSitePlacement(30.0, 10.0)  # probe share 1/4: 4 absent experts give the CPU one, 1 gives it none
    for _ in range(4):  # four calls at 0.01 GB/s: the learned share rounds every layer's CPU count to 0
        plan.observe_cpu(10 << 20, (10 << 20) / 1e7)
    assert plan.cpu_gb_s() == pytest.approx(0.01) and plan.split([(e, 1) for e in range(8)]) == ()
    for _ in range(limit - 1):
        plan.count_split(4, 0)
    plan.count_split(1, 0)  # the probe's share gives one absent expert none either: no evidence, no count
    assert plan.cpu_rate_resets == 0 and plan.starved == limit - 1
    plan.count_split(4, 0)
    assert plan.cpu_rate_resets == 1 and plan.starved == 0
    assert plan.cpu_gb_s() == 10.0 and plan.share() == pytest.approx(0.25) and len(plan.split([(e, 1) for e in
                                                                                                 range(4)])) == 1
    assert plan.describe()["cpu_rate_resets"] == 1

    # a layer with CPU experts breaks the run; a fixed share never resets
    plan = TwoSitePlacement(30.0, 10.0)
    for _ in range(4):
        plan.observe_cpu(10 << 20, (10 << 20) / 1e7)
    for i in range(2 * limit):
        plan.count_split(4, 1 if i == limit - 1 else 0)
    assert plan.cpu_rate_resets == 1  # (the run restarted at limit: one drop, at 2 limit - 1)
    for plan in (TwoSitePlacement(30.0, 10.0, share=0.0), TwoSitePlacement(None, 10.0)):  # a fixed share; no link
        for _ in range(4):  # rate (the share is 1/2 whatever the CPU's): the learned rate decides nothing
            plan.observe_cpu(10 << 20, (10 << 20) / 1e7)
        for _ in range(2 * limit):
            plan.count_split(4, 0)
        assert plan.cpu_rate_resets == 0
    plan = TwoSitePlacement(30.0, None)  # the build probe failed: the way back is to the share of 1/2
    for _ in range(limit):
        plan.count_split(4, 0)  # (no rate learned yet: no starving counted)
    assert plan.starved == 0
    for _ in range(4):
        plan.observe_cpu(10 << 20, (10 << 20) / 1e7)
    for _ in range(limit):
        plan.count_split(4, 0)
    assert plan.cpu_rate_resets == 1 and plan.cpu_gb_s() is None and plan.share() == 0.5
    # the split's learned rate is clipped: a call stalled 1000x moves it by less than half
    plan = TwoSitePlacement(30.0, 10.0)
    for _ in range(6):
        plan.observe_cpu(10 << 20, (10 << 20) / 20e9)
    plan.observe_cpu(10 << 20, 1000 * (10 << 20) / 20e9)
    assert plan.describe()["cpu_calls_clipped"] == 1 and plan.cpu_gb_s() > 10.0


def test_the_first_cpu_part_of_a_layer_binds_its_call_outside_the_rate_the_split_learns(seed3_tiny_packs,
                                                                                        test_device, record_decode,
                                                                                        monkeypatch):
    """Join "mask" binds each layer's call on its first use: that bind is the join's work, not the CPU site's, so the
    seconds the split learns its rate from never contain it. A bind made to take 0.3 s shows in the joins' split time
    and in no CPU part's seconds."""
    from runmap.engine.engine import TWO_SITE_JOIN_ENV, TWO_SITE_STEP_ENV, SegmentDecoder

    monkeypatch.setenv(TWO_SITE_STEP_ENV, "graph")
    monkeypatch.setenv(TWO_SITE_JOIN_ENV, "mask")
    real_bind = SegmentDecoder._bind_masked
    binds = []

    def slow_bind(self, layer):
        binds.append(layer)
        time.sleep(0.3)
        return real_bind(self, layer)
    monkeypatch.setattr(SegmentDecoder, "_bind_masked", slow_bind)
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    eng = _run(pack, test_device, record_decode, resident=cfg.top_k, expert_placement="two-site",
               cache_contract=_contract(test_device), two_site_share=0.5)
    try:
        plan = eng.experts.placement
        seen = []
        real_observe = plan.observe_cpu
        monkeypatch.setattr(plan, "observe_cpu", lambda n, s, tokens=None: (seen.append(s), real_observe(n, s, tokens)))
        bound_before = len(binds)  # (on a GPU the warm-up's capture bound them already)
        eng.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        bound_in_run = len(binds) - bound_before
        assert seen, "the run computed no CPU part: nothing was tested"
        assert max(seen) < 0.3, f"a CPU part's seconds held a bind: {max(seen):.3f} s"
        if test_device == "cpu":  # eager steps: the run's first CPU part of each layer bound its call
            joins = plan.describe()["joins"]
            assert bound_in_run > 0 and joins["split_us"] * joins["layers"] >= 0.3e6 * bound_in_run
    finally:
        eng.close()


def _host_rule(ids, table, R, q):
    """The split as the host applies it (TwoSitePlacement.split on the absent experts the table names) -> the slots
    row the kernel should write: int32 (E + B k,)."""
    E = table.shape[0]
    flat = ids.reshape(-1)
    experts, pairs = np.unique(flat, return_counts=True)
    absent = [(e, n) for e, n in zip(experts.tolist(), pairs.tolist()) if table[e] >= R]
    cpu = TwoSitePlacement(None, None).split(absent, q)
    out = table.copy()
    out[list(cpu)] = table[table < R].min()
    keep = np.array([0 if e in cpu else 1 for e in flat.tolist()], dtype=np.int32)
    return np.concatenate([out, keep]), cpu


@pytest.mark.parametrize("E,B,k", [(8, 1, 4), (64, 1, 8), (64, 8, 8), (60, 3, 4), (60, 8, 4), (128, 5, 8), (7, 2, 2)])
def test_the_split_kernel_decides_what_the_host_rule_decides(E, B, k, test_device):
    """runmap.kernels.site_split against the host's rule on fresh random steps: random residency (a random
    permutation of rows, R of them resident), random routed ids (distinct per token), shares 0 / a random one / 1,
    an output poisoned first; the row table and keep mask equal exactly."""
    from runmap.kernels.site_split import SHARE_ONE as KERNEL_SHARE_ONE, two_site_split

    assert KERNEL_SHARE_ONE == SHARE_ONE
    rng = np.random.default_rng(E * 100 + B * 10 + k)
    for trial in range(4):
        resident = int(rng.integers(1, E))
        R = resident + int(rng.integers(0, 3))  # spare rows past the resident ones
        table = (R + np.arange(E)).astype(np.int32)
        on_device = rng.choice(E, resident, replace=False)
        table[on_device] = rng.permutation(R)[:resident]
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(B)]).astype(np.int64)
        for q in (0, int(rng.integers(1, SHARE_ONE)), SHARE_ONE):
            out = torch.full((E + B * k,), -7, dtype=torch.int32, device=test_device)
            share = torch.tensor([q], dtype=torch.int32, device=test_device)
            two_site_split(torch.from_numpy(ids).to(test_device), torch.from_numpy(table).to(test_device), share, R, out)
            want, cpu = _host_rule(ids, table, R, q)
            got = out.cpu().numpy()
            assert np.array_equal(got, want), (trial, q, cpu, got, want)
            if q == SHARE_ONE:  # every absent expert on the CPU: the device part reads no host row
                assert (got[:E][np.unique(ids)] < R).all()
            _check_handoff(ids, table, share, R, q, want, rng, test_device)


def _check_handoff(ids, table, share, R, q, want, rng, device):
    """The split with handoff "mapped": the same row table, keep mask and count, and the layer's ids, input and gate
    weights stored into the host's buffers (on a GPU pinned host memory through its mapped device view, as the
    one-graph step uses it; all poisoned first), for an input of an odd width, over one or several of the kernel's
    1,024-element blocks."""
    from runmap.kernels.site_split import two_site_split
    from runmap.residency.transport import mapped_tensor

    B, k = ids.shape
    E = table.shape[0]
    H = int(rng.choice([37, 1500]))
    x = torch.from_numpy(rng.standard_normal((B, H)).astype(np.float16)).to(device)
    gw = torch.from_numpy(rng.random((B, k)).astype(np.float32)).to(device)
    pin = device == "cuda"
    host = [torch.full((B, k), -9, dtype=torch.int64, pin_memory=pin),
            torch.full((B, H), float("nan"), dtype=torch.float16, pin_memory=pin),
            torch.full((B, k), float("nan"), dtype=torch.float32, pin_memory=pin),
            torch.full((1, B * k), -9, dtype=torch.int32, pin_memory=pin),
            torch.full((1, 1), -9, dtype=torch.int32, pin_memory=pin)]
    views = [mapped_tensor(t, device) for t in host]
    out = torch.full((E + B * k,), -7, dtype=torch.int32, device=device)
    count = torch.full((1,), -7, dtype=torch.int32, device=device)
    two_site_split(torch.from_numpy(ids).to(device), torch.from_numpy(table).to(device), share, R, out, count,
                   handoff=(x, gw, views[0], views[1], views[2], views[3].view(-1), views[4].view(-1)))
    if pin:
        torch.cuda.synchronize()  # (the host reads the pinned buffers once the kernel completed)
    assert np.array_equal(out.cpu().numpy(), want), q
    assert np.array_equal(host[0].numpy(), ids) and torch.equal(host[1], x.cpu()) and torch.equal(host[2], gw.cpu())
    assert np.array_equal(host[3].numpy().reshape(-1), want[E:])
    assert int(host[4]) == int(count.cpu()) == int((want[:E] != table).sum()), q


def test_an_id_outside_the_layer_routes_nothing_in_the_split(test_device):
    """An id past E (a routing bug the host's note then raises on) is not an expert of the split: the kernel's row
    table and the other pairs' keep flags are those of the step without it, and its own pair keeps 1 (the executor
    gives its row NaN, never another expert's)."""
    from runmap.kernels.site_split import two_site_split

    E, R = 16, 4
    table = (R + np.arange(E)).astype(np.int32)
    table[[1, 5, 9, 12]] = [0, 1, 2, 3]
    good = np.array([[2, 1, 7], [7, 3, 5]], dtype=np.int64)  # absent 2, 3, 7 (7 twice), resident 1, 5
    bad = np.array([[2, 1, E + 3, 7], [7, 3, 5, E]], dtype=np.int64)
    for q in (SHARE_ONE // 2, SHARE_ONE):
        want, _ = _host_rule(good, table, R, q)
        out = torch.full((E + bad.size,), -7, dtype=torch.int32, device=test_device)
        two_site_split(torch.from_numpy(bad).to(test_device), torch.from_numpy(table).to(test_device),
                       torch.tensor([q], dtype=torch.int32, device=test_device), R, out)
        got = out.cpu().numpy()
        assert np.array_equal(got[:E], want[:E])
        keep = got[E:].reshape(bad.shape)
        assert keep[0, 2] == 1 and keep[1, 3] == 1
        assert np.array_equal(np.delete(keep.reshape(-1), [2, 7]), want[E:])


def test_a_share_for_another_placement_is_refused(seed3_tiny_packs):
    from runmap.engine.engine import Engine, EngineError

    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    with pytest.raises(EngineError, match="two_site_share=0.5 is placement two-site's"):
        Engine.from_pack(pack, executor="grouped", device="cpu", resident=cfg.top_k, expert_placement="host-read",
                         two_site_share=0.5)


def test_the_split_kernel_refuses_bad_arguments(test_device):
    from runmap.kernels.common import KernelInputError
    from runmap.kernels.site_split import two_site_split

    ids = torch.zeros(1, 4, dtype=torch.int64, device=test_device)
    table = torch.arange(8, dtype=torch.int32, device=test_device)
    share = torch.zeros(1, dtype=torch.int32, device=test_device)
    out = torch.zeros(12, dtype=torch.int32, device=test_device)
    with pytest.raises(KernelInputError, match="ids: dtype int32"):
        two_site_split(ids.to(torch.int32), table, share, 4, out)
    with pytest.raises(KernelInputError, match="out: shape"):
        two_site_split(ids, table, share, 4, out[:11])
    with pytest.raises(KernelInputError, match="resident_rows"):
        two_site_split(ids, table, share, 0, out)


def test_a_campaign_refuses_a_share_without_placement_two_site():
    from runmap.bench.campaign import BenchError, expand

    group = {"name": "hr", "kind": "engine", "models": ["m"], "resident": [4], "executors": ["grouped"], "batch": [1],
             "prompt_len": 4, "decode_len": 3, "params": {"expert_placement": "host-read", "two_site_share": 0.5}}
    spec = {"name": "s", "description": "d", "device": "cpu", "defaults": {"repeats": 1},
            "models": {"m": {"preset": "tiny-olmoe"}}, "groups": [group]}
    with pytest.raises(BenchError, match="two_site_share fixes placement two-site's CPU share; expert_placement is "
                                         "'host-read'"):
        expand(spec)
    group["params"]["expert_placement"] = "two-site"
    (cfg,) = expand(spec)
    assert cfg.id.endswith("placement-two-site.share0p5") and cfg.p["two_site_share"] == 0.5


@pytest.mark.skipif(os.environ.get("RUNMAP_TEST_DEVICE") == "cuda",
                    reason="the CPU device's eager chain standing in for a capture (on a GPU the capture itself runs: "
                           "the warm-up test below)")
def test_a_captures_warm_up_steps_leave_counts_and_policy_as_they_were(seed3_tiny_packs):
    """SegmentDecoder._uncounted, around a two-site capture's eager warm-up steps (on CUDA; here around eager steps of
    the same chain): the cache's counters, its policy's clock and the placement's split counts are put back, as a
    host-read capture (which notes nothing) leaves them; the steps themselves did count."""
    from runmap.engine.engine import Engine, SegmentDecoder

    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    eng = Engine.from_pack(pack, executor="grouped", device="cpu", resident=cfg.top_k, max_batch=2, max_seq_len=48,
                           expert_placement="two-site", two_site_share=0.5)
    try:
        ex = eng.experts
        dec = SegmentDecoder(eng, 2, None, capture=False, mixed=True, two_site=True)
        tokens, pad = torch.tensor([5, 9]), torch.zeros(2, dtype=torch.long)
        with torch.inference_mode():
            dec.run(tokens, 3, pad)  # a counted step first: the policy has history to keep
            before = dict(ex.cache.counters), ex.cache._tick, ex.placement.split_counts()
            with dec._uncounted():
                dec._load(tokens, 4, pad)
                dec._run_eager(5)
                dec._run_eager(5)
                assert ex.placement.split_counts()[0] > before[2][0]  # the steps split (and noted) inside
        assert (dict(ex.cache.counters), ex.cache._tick, ex.placement.split_counts()) == before
        assert ex.cache.live_requests() == 0
    finally:
        eng.close()


# ---- placement auto with both sites: the step chosen per batch size by measured step time ----------------------------

def _drive(chooser, batch, durations, n, slot0=40):
    """Run ``n`` steps at ``batch`` on a fake clock, each step taking durations[mode]; returns the modes in order."""
    now, modes = 0.0, []
    for i in range(n):
        mode = chooser.mode(batch, slot0 + i, now=now)
        modes.append(mode)
        now += durations[mode]
    return modes


def test_the_step_chooser_probes_both_steps_then_runs_the_faster_and_revisits_the_slower():
    from runmap.engine.placement import StepChooser

    ch = StepChooser(min_batch=4, probe_steps=3, revisit_steps=6, rounds=1)
    assert _drive(ch, 2, {"host-read": 1.0, "two-site": 0.1}, 9) == ["host-read"] * 9  # below min_batch: host-read
    assert ch.describe()["by_batch"] == {}  # (and nothing kept for it)
    modes = _drive(ch, 8, {"host-read": 2e-3, "two-site": 1e-3}, 5 + 5 + 6 + 5 + 6)
    assert modes == ["host-read"] * 5 + ["two-site"] * 5 + ["two-site"] * 6 + ["host-read"] * 5 + ["two-site"] * 6
    d = ch.describe()["by_batch"]["8"]
    assert d["chosen"] == "two-site" and d["choices"] == 2 and d["steps"] == {"host-read": 10, "two-site": 17}
    # a run of one mode times its steps 2..n-1 (a step is timed at the third call of its run): 3 per probe of 5; the
    # winner's run goes on through its 6 steps (3 + 6), and after the slower's probe 4 of its next 6; the probed step's
    # old times were dropped (3)
    assert d["timed"]["host-read"] == 3 and d["timed"]["two-site"] == 3 + 6 + 4
    assert d["median_ms"]["host-read"] == pytest.approx(2.0) and d["median_ms"]["two-site"] == pytest.approx(1.0)
    # another batch size has its own probes; a slower two-site step loses
    assert _drive(ch, 5, {"host-read": 1e-3, "two-site": 3e-3}, 16)[10:] == ["host-read"] * 6


def test_the_step_chooser_alternates_its_first_probes_so_both_steps_are_timed_early_and_late():
    """The default's first probes: host-read, two-site, host-read, two-site, each ceil(probe_steps / 2) + 2 steps, the
    times of both rounds kept. Here host-read's steps are slow (2.5 ms) only in the first 7 steps after the prompt and
    faster than two-site's (1 against 2 ms) after them: the alternation's median (1.75 ms) chooses host-read, where one
    round of 10 host-read steps, timed mostly while slow, would have chosen two-site."""
    from runmap.engine.placement import StepChooser

    def drive(ch, n):
        now, modes = 0.0, []
        for i in range(n):
            modes.append(ch.mode(8, i, now=now))
            now += (2.5e-3 if i < 7 else 1e-3) if modes[-1] == "host-read" else 2e-3
        return modes

    ch = StepChooser(min_batch=4, probe_steps=8, revisit_steps=5)
    assert ch.describe()["rounds"] == 2
    modes = drive(ch, 24 + 5 + 10)
    assert modes[:24] == (["host-read"] * 6 + ["two-site"] * 6) * 2
    assert modes[24:29] == ["host-read"] * 5  # chosen: the faster by the medians of both rounds
    assert modes[29:] == ["two-site"] * 10  # the revisit: the slower probed again for probe_steps + 2 steps
    d = ch.describe()["by_batch"]["8"]
    # a step is timed from the third call of its run: 4 per probe round, 3 of the 5 chosen steps; the revisit dropped
    # two-site's probe times and timed 8 of its 10
    assert d["chosen"] == "host-read" and d["timed"] == {"host-read": 4 + 4 + 3, "two-site": 8}
    one = StepChooser(min_batch=4, probe_steps=8, revisit_steps=5, rounds=1)
    assert drive(one, 21)[20] == "two-site" and one.describe()["by_batch"]["8"]["chosen"] == "two-site"
    with pytest.raises(PlacementError, match="rounds 0 must be >= 1"):
        StepChooser(rounds=0)


def test_the_step_chooser_times_only_steps_at_consecutive_slots_and_otherwise_keeps_host_read():
    """Slots that never follow each other (one-token runs) time nothing: after the probes host-read runs."""
    from runmap.engine.placement import StepChooser

    ch = StepChooser(min_batch=1, probe_steps=2, revisit_steps=4, rounds=1)
    now, modes = 0.0, []
    for i in range(12):
        modes.append(ch.mode(1, 10 * i, now=now))  # slots 0, 10, 20, ...
        now += 1e-3 if modes[-1] == "two-site" else 5e-3
    assert modes[:8] == ["host-read"] * 4 + ["two-site"] * 4 and modes[8:] == ["host-read"] * 4
    d = ch.describe()["by_batch"]["1"]
    assert d["timed"] == {"host-read": 0, "two-site": 0} and d["chosen"] == "host-read"
    with pytest.raises(PlacementError, match="must be >= 1"):
        StepChooser(probe_steps=0)


@settings(max_examples=60, deadline=None)
@given(hr=st.floats(1e-4, 1.0), ts=st.floats(1e-4, 1.0), probe=st.integers(1, 6), revisit=st.integers(1, 20),
       extra=st.integers(0, 40), rounds=st.integers(1, 3))
def test_the_step_chooser_runs_the_step_that_measured_faster(hr, ts, probe, revisit, extra, rounds):
    """Constant step times (1 % apart at least: the fake clock's sums round): after ``rounds`` alternations of the two
    probes the faster step runs for revisit steps, then the slower is probed again, then the faster again; every call
    is counted once under the mode it ran."""
    from runmap.engine.placement import StepChooser

    assume(abs(hr - ts) > 0.01 * max(hr, ts))
    ch = StepChooser(min_batch=2, probe_steps=probe, revisit_steps=revisit, rounds=rounds)
    each, p = -(-probe // rounds) + 2, probe + 2
    first = 2 * rounds * each
    n = first + revisit + p + revisit + extra
    modes = _drive(ch, 3, {"host-read": hr, "two-site": ts}, n)
    best = "two-site" if ts < hr else "host-read"
    other = "host-read" if best == "two-site" else "two-site"
    assert modes[:first] == (["host-read"] * each + ["two-site"] * each) * rounds
    assert modes[first:first + revisit] == [best] * revisit
    assert modes[first + revisit:first + revisit + p] == [other] * p
    assert modes[first + revisit + p:first + 2 * revisit + p] == [best] * revisit  # the revisit did not change it
    d = ch.describe()["by_batch"]["3"]
    assert sum(d["steps"].values()) == n and d["chosen"] == best and d["choices"] >= 2


def _auto_both(pack, cfg, device, record_decode, **kw):
    import os

    from runmap.engine.engine import TWO_SITE_MIN_BATCH_ENV, Engine
    from runmap.engine.placement import PlacementCosts

    # these tests assume the default minimum (4): an A/B device call may export another one
    assert TWO_SITE_MIN_BATCH_ENV not in os.environ, f"unset {TWO_SITE_MIN_BATCH_ENV} to run the two-site tests"

    # the host-read site given faster than the CPU site: auto chooses host-read's steps, with both sites at batch >= 4
    costs = PlacementCosts(h2d_gb_s=0.5, cpu_gb_s=1.0, row_bytes=100, source="test", host_read_gb_s=2.0)
    eng = record_decode(Engine.from_pack(pack, executor="grouped", device=device, resident=cfg.top_k, max_batch=4,
                                         max_seq_len=48, cache_contract=_contract(device), expert_placement="auto",
                                         placement_costs=costs, **kw))
    eng._prefiller = None
    return eng


PROMPTS_4 = PROMPTS + ["a token routed elsewhere", "and one more row"]
NEW_4 = 8  # new tokens of the 4-row runs: 7 decode steps (the prompt's pass gives the first)


def _full_4(pack, device, record_decode):
    """Full residency's tokens and decode logits of PROMPTS_4 (NEW_4 tokens each), computed once per pack and device."""
    from runmap.engine.engine import Engine

    key = (str(pack), device, 4)
    if key not in _FULL:
        eng = record_decode(Engine.from_pack(pack, executor="grouped", device=device, max_batch=4, max_seq_len=48))
        eng._prefiller = None
        try:
            _FULL[key] = ([r.token_ids for r in eng.generate(PROMPTS_4, max_new_tokens=NEW_4, ignore_eos=True)],
                          eng.decoded)
        finally:
            eng.close()
    return _FULL[key]


def test_auto_with_both_sites_probes_both_steps_at_batch_4_and_decodes_what_full_residency_decodes(
        seed3_tiny_packs, test_device, record_decode):
    """auto (the host-read site measured faster than the CPU site, max batch 4) becomes two-site with a step chooser:
    batch 2 runs host-read's steps only (bit for bit full residency's logits), batch 4 probes both steps (host-read,
    then the two-site chain with the CPU site's share) and the logits stay within the CPU kernel's tolerance of full
    residency's; the telemetry validates and says what ran."""
    import json

    from runmap.cli.options import placement_line
    from runmap.conformance.schemas import load_schemas
    from runmap.engine.placement import StepChooser

    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    want2, logits2 = _full(pack, test_device, record_decode)
    want4, logits4 = _full_4(pack, test_device, record_decode)
    eng = _auto_both(pack, cfg, test_device, record_decode)
    try:
        plan = eng.experts.placement
        assert isinstance(plan.steps, StepChooser) and eng.use_two_site and eng.experts.cpu_site is not None
        plan.steps = StepChooser(min_batch=4, probe_steps=1, revisit_steps=3, rounds=1)  # probes of 3 steps: 7 see both
        got2 = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]
        assert eng.decode_paths["two_site"] == 0 and eng.decode_paths["host_read"] == len(logits2)
        assert got2 == want2 and all(torch.equal(a, b) for a, b in zip(eng.decoded, logits2))
        n2 = len(eng.decoded)
        got4 = [r.token_ids for r in eng.generate(PROMPTS_4, max_new_tokens=NEW_4, ignore_eos=True)]
        assert eng.decode_paths["two_site"] > 0 and eng.decode_paths["host_read"] > len(logits2)
        assert eng.experts.cache.counters["cpu_site_experts"] > 0
        d = plan.steps.describe()["by_batch"]["4"]
        rest = len(logits4) - 6  # the steps after both probes
        assert d["steps"] == {"host-read": 3 + rest * (d["chosen"] == "host-read"),
                              "two-site": 3 + rest * (d["chosen"] == "two-site")} and d["choices"] == 1
        assert eng.experts.cache.outstanding_leases() == 0 and eng.experts.cache.live_requests() == 0
        tel = json.loads(json.dumps(eng.telemetry()))
        assert load_schemas().validate_document(tel, "telemetry") == []
        pl = tel["placement"]
        assert pl["mode"] == "two-site" and pl["requested"] == "auto" and pl["steps"]["by_batch"]["4"] == d
        assert "from batch 4 up the two-site step where it measures faster" in pl["why"]
        line = placement_line(eng)
        assert line.startswith("expert placement auto: host-read, and from batch 4 the two-site step where it measures "
                               "faster (the CPU site's 1.0 GB/s") and "margin 1" in line
    finally:
        eng.close()
    assert got4 == want4 and len(eng.decoded) - n2 == len(logits4)
    for t, (a, b) in enumerate(zip(eng.decoded[n2:], logits4)):
        err, bound = float((a - b).abs().max()), LOGITS_REL * float(b.abs().max())
        assert err <= bound, f"step {t}: max |diff| {err:.3g} > {bound:.3g}"


def test_auto_with_both_sites_warms_both_steps_up_without_asking_its_chooser(seed3_tiny_packs, test_device,
                                                                             record_decode, monkeypatch):
    """warm_up runs host-read's step at batch 1 and both steps at the max batch (on a GPU: captures them), asks the
    chooser nothing and leaves the counters, paths, split counts and the CPU rate learned in use as they were.
    RUNMAP_TWO_SITE_MIN_BATCH sets the chooser's smallest batch (default 4): a max batch below it keeps auto as plain
    host-read."""
    from runmap.engine.placement import HostReadPlacement, TwoSitePlacement

    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    eng = _auto_both(pack, cfg, test_device, record_decode, warm_up=False)
    try:
        plan, cache = eng.experts.placement, eng.experts.cache
        before = (dict(cache.counters), dict(eng.decode_paths), plan.split_counts(), plan.cpu_rate.calls,
                  plan.cpu_rate.clipped, plan.starved, plan.cpu_rate_resets)
        eng.warm_up()
        assert plan.steps.describe()["by_batch"] == {}
        assert plan.steps.min_batch == 4
        assert set(eng._host_read) == {1, 4} and set(eng._two_site) == {4}
        # the warm-up's CPU-site calls (pad tokens) teach the CPU rate nothing
        assert (dict(cache.counters), dict(eng.decode_paths), plan.split_counts(), plan.cpu_rate.calls,
                plan.cpu_rate.clipped, plan.starved, plan.cpu_rate_resets) == before
    finally:
        eng.close()
    from runmap.engine.engine import TWO_SITE_MIN_BATCH_ENV, Engine
    from runmap.engine.placement import PlacementCosts

    costs = PlacementCosts(h2d_gb_s=0.5, cpu_gb_s=1.0, row_bytes=100, source="test", host_read_gb_s=2.0)

    def small(given):
        return Engine.from_pack(pack, executor="grouped", device=test_device, resident=cfg.top_k, max_batch=3,
                                max_seq_len=48, cache_contract=_contract(test_device), expert_placement="auto",
                                placement_costs=costs, warm_up=False, two_site_min_batch=given)
    # the env, then from_pack's two_site_min_batch, which wins over the env
    for min_batch, given, both in [("3", None, True), ("4", None, False), (None, None, False), ("4", 3, True),
                                   ("3", 4, False), (None, 3, True)]:
        if min_batch is None:
            monkeypatch.delenv(TWO_SITE_MIN_BATCH_ENV, raising=False)
        else:
            monkeypatch.setenv(TWO_SITE_MIN_BATCH_ENV, min_batch)
        eng = small(given)
        try:
            plan = eng.experts.placement
            if both:
                assert isinstance(plan, TwoSitePlacement) and plan.steps.min_batch == 3 and eng.use_two_site
                assert eng.warm_step_modes(2) == ("host-read",) and eng.warm_step_modes(3) == ("host-read", "two-site")
            else:
                assert type(plan) is HostReadPlacement and not eng.use_two_site and eng.experts.cpu_site is None
        finally:
            eng.close()


def test_auto_hands_over_between_host_read_and_two_site_steps_without_losing_a_promotion(seed3_tiny_packs, test_device,
                                                                                       record_decode):
    """A chooser scripted to switch both ways (host-read, host-read, two-site, host-read, two-site, two-site, ...): the
    logits stay within the CPU kernel's tolerance of full residency's at every step, every step's reads are offered
    for promotion exactly once (a host-read step still in flight when a two-site step starts included), and nothing is
    left held."""
    from runmap.engine.placement import StepChooser

    script = ["host-read", "host-read", "two-site", "host-read", "two-site", "two-site", "host-read"]  # NEW_4 - 1

    class Scripted(StepChooser):
        def mode(self, batch, slot, now=None):
            super().mode(batch, slot, now)  # (keeps describe() honest about what ran)
            return script[(self._batches[batch]["steps"]["host-read"] + self._batches[batch]["steps"]["two-site"]
                           - 1) % len(script)]

    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    want, logits = _full_4(pack, test_device, record_decode)
    eng = _auto_both(pack, cfg, test_device, record_decode)
    try:
        eng.experts.placement.steps = Scripted(min_batch=4)
        offered = []
        promote_step = eng.experts.cache.promote_step

        def spy(ids, margin, max_layers=None):
            offered.append(np.array(ids, copy=True))
            return promote_step(ids, margin, max_layers)

        eng.experts.cache.promote_step = spy
        got = [r.token_ids for r in eng.generate(PROMPTS_4, max_new_tokens=NEW_4, ignore_eos=True)]
        assert eng.decode_paths["two_site"] == script.count("two-site")
        assert eng.decode_paths["host_read"] == script.count("host-read")
        assert len(offered) == len(script)  # each step's (L, B, k) reads once
        assert eng.experts.cache.outstanding_leases() == 0 and eng.experts.cache.live_requests() == 0
    finally:
        eng.close()
    assert got == want and len(eng.decoded) == len(logits)
    for t, (a, b) in enumerate(zip(eng.decoded, logits)):
        err, bound = float((a - b).abs().max()), LOGITS_REL * float(b.abs().max())
        assert err <= bound, f"step {t} ({script[t]}): max |diff| {err:.3g} > {bound:.3g}"


def test_the_step_chooser_never_times_a_step_across_two_runs():
    """break_runs (called when a run's steps end): a next run whose first slot follows the last one's is not timed."""
    from runmap.engine.placement import StepChooser

    ch = StepChooser(min_batch=1, probe_steps=4, revisit_steps=4, rounds=1)
    _drive(ch, 2, {"host-read": 1e-3, "two-site": 1e-3}, 4, slot0=10)  # slots 10..13, 2 timed
    ch.break_runs()
    ch.mode(2, 14, now=100.0)  # a new run (a prompt's pass between): slot 14 follows 13, 100 s later
    ch.mode(2, 15, now=100.001)
    assert ch.describe()["by_batch"]["2"]["timed"]["host-read"] == 2
    assert ch.describe()["by_batch"]["2"]["median_ms"]["host-read"] == pytest.approx(1.0)


@pytest.mark.cpu_device
def test_a_campaign_row_sets_the_chooser_minimum_only_for_auto(tiny_olmoe_campaign, tmp_path, monkeypatch):
    """two_site_min_batch in a spec: refused unless the placement is auto; with auto the id says so (__sitesb1), the
    engine's chooser has that minimum and the record's config keeps it (validated against the record schema)."""
    from runmap.bench import campaign as bench
    from runmap.conformance.schemas import validate_document

    group, spec = tiny_olmoe_campaign(
        "sb", {"expert_placement": "host-read", "two_site_min_batch": 1, "routing": "calibrated"}, decode_len=3)
    with pytest.raises(bench.BenchError, match="two_site_min_batch is .* expert_placement is 'host-read'"):
        bench.expand(spec)
    group["params"]["expert_placement"] = "auto"
    for bad in (1.0, 0):  # (1.0 passes the schema, which counts it an integer)
        group["params"]["two_site_min_batch"] = bad
        with pytest.raises(bench.BenchError, match=rf"two_site_min_batch {bad!r}: allowed values are integers >= 1"):
            bench.expand(spec)
    group["params"]["two_site_min_batch"] = 1
    (c,) = bench.expand(spec)
    assert c.id.endswith("placement-auto.sitesb1.routing-calibrated-olmoe")
    from runmap.engine.engine import Engine

    seen, build = [], Engine.from_pack.__func__

    def spy(cls, *args, **kw):
        seen.append(kw.get("two_site_min_batch"))
        return build(cls, *args, **kw)
    monkeypatch.setattr(Engine, "from_pack", classmethod(spy))
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=False, command="pytest")
    assert not summary["failed"], summary["failed"]
    (rec,) = bench.load_records(tmp_path / "sb")
    assert validate_document({k: v for k, v in rec.items() if k != "_path"}, "bench-record.schema.json") == []
    assert rec["config"]["two_site_min_batch"] == 1
    assert seen == [1]  # the engine was built with it (on the CPU device auto has no link to read over)


def test_the_one_graph_steps_host_phases_are_reported_and_a_warm_up_leaves_them_as_they_were():
    """note_step: per step means of the host phases (admit, replay, joins, release, promotions, in microseconds) and
    the median gap between steps (robust to a run's first step, whose gap holds its prompt); put_back after a warm-up
    restores them; the telemetry schema takes the description."""
    plan = TwoSitePlacement(30.0, 10.0)
    assert "step_host" not in plan.describe()
    kept = plan.kept()
    plan.note_step(1e-5, 2e-5, 3e-3, 4e-6, 5e-5, None)
    plan.note_step(3e-5, 4e-5, 5e-3, 6e-6, 7e-5, 2e-4)
    plan.note_step(2e-5, 3e-5, 4e-3, 5e-6, 6e-5, 9.0)  # a run's first step: its gap holds the prompt's pass
    plan.note_step(2e-5, 3e-5, 4e-3, 5e-6, 6e-5, 3e-4)
    h = plan.describe()["step_host"]
    assert h["steps"] == 4 and h["gaps"] == 3
    want = {"admit_us": 20.0, "replay_us": 30.0, "joins_us": 4000.0, "release_us": 5.0, "promote_us": 60.0,
            "gap_median_us": 300.0}
    assert all(h[k] == pytest.approx(v) for k, v in want.items()), h
    import json
    from pathlib import Path

    import jsonschema

    schema = json.loads((Path(__file__).parents[1] / "schemas" / "telemetry.schema.json").read_text())
    sub = schema["properties"]["placement"]["properties"]["step_host"]
    jsonschema.Draft202012Validator(sub).validate(h)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(sub).validate({**h, "unknown_us": 1.0})
    plan.put_back(kept)
    assert "step_host" not in plan.describe() and len(plan.step_gaps) == 0
    for i in range(TwoSitePlacement.BETWEEN_KEPT + 5):  # the gaps kept are the last ones
        plan.note_step(0.0, 0.0, 0.0, 0.0, 0.0, float(i))
    assert len(plan.step_gaps) == TwoSitePlacement.BETWEEN_KEPT and plan.step_gaps[0] == 5.0


@pytest.mark.parametrize("step", ["chain", "graph"])
def test_a_two_site_step_promotes_in_at_most_the_layers_the_bound_allows(seed3_tiny_packs, monkeypatch, test_device,
                                                                         record_decode, step):
    """RUNMAP_TWO_SITE_PROMOTIONS=1: after each two-site step (either form) the cache is asked to promote in at most one
    layer, the placement's description says so, and the decode still equals full residency's tokens; unset, no bound
    is passed."""
    from runmap.engine.engine import TWO_SITE_PROMOTIONS_ENV, TWO_SITE_STEP_ENV

    monkeypatch.setenv(TWO_SITE_STEP_ENV, step)
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    toks_f, _ = _full(pack, test_device, record_decode)
    for bound in ("1", None):
        if bound is None:
            monkeypatch.delenv(TWO_SITE_PROMOTIONS_ENV)
        else:
            monkeypatch.setenv(TWO_SITE_PROMOTIONS_ENV, bound)
        eng = _run(pack, test_device, record_decode, resident=cfg.top_k, expert_placement="two-site",
                   cache_contract=_contract(test_device), two_site_share=0.0)
        try:
            cache, asked = eng.experts.cache, []
            promote_step = cache.promote_step

            def spy(ids, margin=1.0, max_layers=None):
                asked.append(max_layers)
                out = promote_step(ids, margin, max_layers)
                assert max_layers is None or sum(map(bool, out)) <= max_layers
                return out

            cache.promote_step = spy
            toks = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]
            assert toks == toks_f
            assert asked and set(asked) == {None if bound is None else int(bound)}, asked
            d = eng.experts.placement.describe()
            assert d.get("promotions_per_step") == (None if bound is None else int(bound))
        finally:
            eng.close()


def test_the_one_graph_step_notes_what_the_chain_notes(seed3_tiny_packs, monkeypatch, test_device, record_decode):
    """The one-graph step notes a step's reads in one call after its last join, the chain one layer at a time: the
    same decode leaves the same cache counters, clock, eviction-policy history, residency and split counts."""
    from runmap.engine.engine import TWO_SITE_STEP_ENV

    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    seen = {}
    for step in ("chain", "graph"):
        monkeypatch.setenv(TWO_SITE_STEP_ENV, step)
        eng = _run(pack, test_device, record_decode, resident=cfg.top_k, expert_placement="two-site",
                   cache_contract=_contract(test_device), two_site_share=0.5)
        try:
            toks = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]
            cache, plan = eng.experts.cache, eng.experts.placement
            cache.policy._grow(cache.num_layers, cfg.num_experts)
            seen[step] = (toks, dict(cache.counters), cache._tick, cache.policy._t.copy(), cache.policy._s.copy(),
                          [dict(cache.mapping(layer)) for layer in range(cache.num_layers)], plan.split_counts(),
                          eng.decode_paths["two_site"])
        finally:
            eng.close()
    (t1, c1, k1, pt1, ps1, m1, s1, n1), (t2, c2, k2, pt2, ps2, m2, s2, n2) = seen["chain"], seen["graph"]
    assert n1 == n2 > 0 and t1 == t2
    assert c1["cpu_site_experts"] > 0 and c1["host_reads"] > 0  # both sites had work
    assert (c1, k1, m1, s1) == (c2, k2, m2, s2)
    np.testing.assert_array_equal(pt1, pt2)
    np.testing.assert_allclose(ps1, ps2, rtol=1e-12)


def test_balance_wait_moves_the_split_toward_the_site_that_is_late_and_only_between_its_bounds():
    """Balance "wait": after a one-graph step whose host waited long for the ids (the device part late) the link's
    rate the split uses drops by BALANCE_FACTOR and the CPU share rises; after one whose host hardly waited (the host
    late) it rises and the share falls; inside the dead band, with balance off or with a fixed share nothing moves;
    the scale stays within its bounds, a warm-up's put_back restores it, and the description validates."""
    import json
    from pathlib import Path

    import jsonschema

    def step(plan, wait_s, layers=16):
        for _ in range(layers):
            plan.note_join(wait_s, 1e-5, 1e-4, True)
        plan.note_step(1e-5, 1e-5, 1e-3, 1e-5, 1e-5, None)

    plan = TwoSitePlacement(30.0, 30.0)
    plan.balance = "wait"
    share0 = plan.share()
    assert share0 == pytest.approx(0.5)
    kept = plan.kept()
    step(plan, 400e-6)
    assert plan.read_scale == pytest.approx(1 / TwoSitePlacement.BALANCE_FACTOR) and plan.share() > share0
    step(plan, 50e-6)  # the dead band
    assert plan.read_scale == pytest.approx(1 / TwoSitePlacement.BALANCE_FACTOR)
    step(plan, 5e-6)
    step(plan, 5e-6)
    assert plan.read_scale == pytest.approx(TwoSitePlacement.BALANCE_FACTOR) and plan.share() < share0
    assert plan.balance_moves == [1, 2]
    for _ in range(200):
        step(plan, 1e-6)
    assert plan.read_scale == TwoSitePlacement.BALANCE_BOUND
    for _ in range(400):
        step(plan, 1e-3)
    assert plan.read_scale == pytest.approx(1 / TwoSitePlacement.BALANCE_BOUND)
    d = plan.describe()["balance"]
    assert d["mode"] == "wait" and d["lowered"] > 0 and d["raised"] > 0
    schema = json.loads((Path(__file__).parents[1] / "schemas" / "telemetry.schema.json").read_text())
    jsonschema.Draft202012Validator(schema["properties"]["placement"]["properties"]["balance"]).validate(d)
    plan.put_back(kept)
    assert plan.read_scale == 1.0 and plan.share() == pytest.approx(share0)
    off, fixed = TwoSitePlacement(30.0, 30.0), TwoSitePlacement(30.0, 30.0, share=0.25)
    fixed.balance = "wait"
    for p in (off, fixed):
        step(p, 400e-6)
        step(p, 1e-6)
        assert p.read_scale == 1.0
    assert "balance" not in off.describe() and fixed.balance_moves == [0, 0] and fixed.share() == 0.25


def test_balance_wait_needs_the_one_graph_step(seed3_tiny_packs, monkeypatch):
    """RUNMAP_TWO_SITE_BALANCE=wait balances the one-graph step's joins: with the chain it is one line naming both."""
    from runmap.engine.engine import Engine, EngineError

    monkeypatch.setenv("RUNMAP_TWO_SITE_STEP", "chain")
    monkeypatch.setenv("RUNMAP_TWO_SITE_BALANCE", "wait")
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    with pytest.raises(EngineError, match=r"^RUNMAP_TWO_SITE_BALANCE=wait balances the one-graph step; .* chain"):
        Engine.from_pack(pack, executor="grouped", device="cpu", max_batch=2, max_seq_len=48, resident=cfg.top_k,
                         expert_placement="two-site", two_site_share=0.5)
    monkeypatch.setenv("RUNMAP_TWO_SITE_STEP", "graph")
    eng = Engine.from_pack(pack, executor="grouped", device="cpu", max_batch=2, max_seq_len=48, resident=cfg.top_k,
                           expert_placement="two-site", two_site_share=0.5)
    try:
        assert eng.experts.placement.describe()["balance"]["mode"] == "wait"
    finally:
        eng.close()


def test_reset_reports_starts_the_joins_and_step_phases_afresh_and_keeps_what_decides():
    """reset_reports (a bench row's timed runs): joins, step phases and gaps start from zero; the learned CPU rate, the
    split's counts and the chooser's state stay; the base placement has nothing to reset."""
    from runmap.engine.placement import Placement

    plan = TwoSitePlacement(30.0, 10.0)
    plan.note_join(1e-5, 2e-5, 3e-4, True)
    plan.note_step(1e-5, 2e-5, 3e-3, 4e-6, 5e-5, 2e-4)
    plan.observe_cpu(1 << 20, 1e-4)
    plan.split_counts((7, 5, 3))
    rate_before = (plan.cpu_rate.gb_s, plan.cpu_rate.calls)
    assert "joins" in plan.describe() and "step_host" in plan.describe()
    plan.reset_reports()
    d = plan.describe()
    assert "joins" not in d and "step_host" not in d and len(plan.step_gaps) == 0
    assert (plan.cpu_rate.gb_s, plan.cpu_rate.calls) == rate_before and plan.split_counts() == (7, 5, 3)
    plan.note_step(2e-5, 3e-5, 4e-3, 5e-6, 6e-5, None)
    assert plan.describe()["step_host"]["steps"] == 1 and plan.describe()["step_host"]["joins_us"] == pytest.approx(4e3)
    Placement().reset_reports()


@pytest.mark.cpu_device
def test_the_cli_passes_the_chooser_minimum_and_refuses_one_below_1(seed3_tiny_packs, tmp_path, monkeypatch, capsys):
    """runmap logits --two-site-min-batch B: the engine is built with it (over the env); 0 is refused by the parser
    with exit 2 naming the option, before any engine is built."""
    from runmap.cli.main import main
    from runmap.engine.engine import TWO_SITE_MIN_BATCH_ENV, Engine

    pack, cfg = seed3_tiny_packs["tiny-olmoe"]
    seen, build = [], Engine.from_pack.__func__

    def spy(cls, *args, **kw):
        seen.append(kw.get("two_site_min_batch"))
        return build(cls, *args, **kw)
    monkeypatch.setattr(Engine, "from_pack", classmethod(spy))
    monkeypatch.setenv(TWO_SITE_MIN_BATCH_ENV, "5")
    base = ["logits", "--packed", str(pack), "--tokens", "5,6,7", "--device", "cpu", "--executor", "grouped",
            "--resident", str(cfg.top_k), "--expert-placement", "auto", "--out", str(tmp_path / "l.safetensors")]
    assert main(base + ["--two-site-min-batch", "3"]) == 0 and seen == [3]
    assert main(base) == 0 and seen == [3, None]  # (None: the env's, then the default)
    with pytest.raises(SystemExit) as exit_:
        main(base + ["--two-site-min-batch", "0"])
    assert exit_.value.code == 2 and "--two-site-min-batch" in capsys.readouterr().err and seen == [3, None]
