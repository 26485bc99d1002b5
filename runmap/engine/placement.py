"""Where a routed expert that is not resident on the GPU is computed (issue 25): transferred into a spare row
(``gpu``, the contract's miss transaction), computed at the CPU site from the immutable host source (``cpu``), or
chosen at each layer call from measured costs (``auto``).

The route never changes: every expert the router (or the routing workload) names is computed, with the same
gate weight; only its execution site does. The cache decides what is absent under its lock and asks the
placement which of those experts the CPU site takes (``Request.acquire(..., place=...)``,
runmap/residency/cache.py); they are never leased, transferred or published.

``auto`` rule (decided at each layer call, for the call's absent experts together). Moving an absent expert costs
``row_bytes / h2d_rate`` once; it then stays resident for the uses that follow until it is evicted. Computing it on the CPU costs ``row_bytes / cpu_rate`` at each use (a decode
step reads the whole expert once, whatever the few tokens). If a resident expert is routed again with
probability ``h`` at each later routing of its layer (the cache's measured hit rate), a transferred expert
serves ``1 / (1 - h)`` uses in expectation, so the transfer wins when

    row_bytes / h2d_rate  <  (row_bytes / cpu_rate) / (1 - h)    <=>    h  >  1 - h2d_rate / cpu_rate

so a link at least as fast as the CPU site always transfers, and a slower link transfers only where reuse is likely
enough. The engine asks the rule (``uses_cpu_now``) at each layer call of the per-call path (prefill, larger batches,
decode steps where the segment chain is off) and, with ``split`` or ``learn=False``, at each segment-chain decode step:
a call or step on which it would transfer runs the plain path or plain segment chain, so choosing to transfer costs
what placement ``gpu`` costs; a step on which it may use the CPU runs the segment chain with a CPU part per layer
(runmap.engine.engine.SegmentDecoder), the rule deciding again at each lease. ``auto``'s own segment-chain decode
steps are chosen by measured step times instead (below).
``h`` is what transferring would give, not what the cache shows: experts computed on the CPU are never published,
so the cache's own hit rate falls toward resident / experts once the rule chooses the CPU and would keep it there. The
rule reads a shadow LRU instead (``ReuseEstimator``): the routed experts of every layer call, in an LRU of the cache's
resident count per layer, whichever site computed them; its hit rate is the hit rate of the routing workload at this
residency with every miss transferred. Not modelled: a batch's tokens sharing a CPU expert (the CPU cost is per expert
read, as the transfer's is). The rates are measured on this machine when the engine is built (``measure_costs``: one
expert alone, best of a few), then replaced by what the engine observes in use (``InUseRate``): the wall time of each
CPU-site call per expert byte it read (decode-sized calls and prompt passes learned apart, ``DECODE_CALL_TOKENS``), and
of each acquisition that moved experts per byte moved, host work included. On
the H200 host the build-time probe said 0.14 ms per OLMoE expert on the CPU where a decode step's CPU part took ~1 ms per
expert (results/campaigns/h200-host-overhead), so a rule fed only the probe chose the CPU where it was the slower site.
``h`` starts from 0 (no evidence of reuse yet). The plan (rates, their source, threshold, decisions so far) is in the
engine's telemetry and printed by the CLI.

Split (``split=True``, placement ``auto-split``; off by default: not measured in decode, see the end of this paragraph). The CPU site and the
link work at once: in the segment chain the CPU part starts on the site's job thread as soon as the placement has
chosen, while the miss transaction copies the rest and the device computes. A call whose ``n`` absent experts are
divided, ``c`` to the CPU, takes max(c / cpu_rate, (n - c) / h2d_rate) per byte, least at c = n x share, share = cpu /
(cpu + h2d). The rule above still says which way to round: where it favours transferring (reuse), the CPU takes
floor(n x share), so it finishes no later than the link; where it favours the CPU, the link takes floor(n x (1 -
share)). The experts left on the CPU are the least recently routed (the shadow LRU's order before the call, never-seen
ones first): those the cache would most likely evict again first. ``uses_cpu_now`` is then true also where a call with
the expected number of absent experts, (1 - h) x the mean group size, would give the CPU one. Not measured in decode
yet: in the one H200 campaign with split on (results/campaigns/h200-placement-split) every auto decode step ran the
plain chain, because the CPU rate auto learned in use from the prefill's CPU-site calls (2-7 GB/s per expert byte:
many tokens per expert, host work included) stayed below the transfer rate, so its decode rows are transfer rows. The
CPU rate is now learned per call size class (decode steps apart from prompt passes), which that campaign lacked; off
by default until a decode measurement says otherwise.

The host-read site under ``auto`` (``auto_chooses_host_read``). Where placement host-read is possible (grouped
executor, partial residency, contract v2 on a GPU) the engine also measures it when the engine is built: the grouped
executor computing one token's top_k experts straight from the registered host rows, distinct experts at each repeat
(best of a few; ``CachedExperts.measure_host_read_gb_s``). ``auto`` becomes placement host-read for the engine's
life unless the CPU site is AUTO_RULE_MARGIN (1.25) times faster than both the host-read site and the link's copy, and then stays the rule above
(which, with the CPU faster than the copy, gives the CPU the misses that reuse does not pay for). Where the engine
can also run the two-site step (a max batch of at least the chooser's minimum, TWO_SITE_MIN_BATCH by default; the
split kernel's bounds) ``auto`` becomes TwoSitePlacement with a StepChooser instead: host-read's steps below that batch
size, and from there whichever of host-read's step and the two-site step measures faster at each batch size (which
one wins depends on the machine and the step's misses, docs/engine.md). Why not the rule alone: host-read and the CPU
site both pay at each use, but host-read's steps stay one CUDA graph and it promotes the most used experts beside them (the transfer's reuse), and
where the copy is the faster way over the link the rule would transfer through the chain, which host-read beat on
every machine measured: 0.75-1.05 of the copy rate's transfer bound against the chain's 0.43
(results/campaigns/h100-host-read-complete, h100-host-read-slow-link). The choice, the three rates and why are in the
placement's telemetry (``requested: auto``). ``auto-split`` stays the rule (an experiment dividing calls between the
CPU and the link), and under an emulated link neither measures the host-read site (the pace holds for copies only).

Segment-chain decode steps of ``auto`` (``AutoPlacement.decode_steps``; not auto-split, not learn=False). A decode
step's layer calls go all one way, every absent expert moved or every one computed at the CPU site, and a StepChooser
with modes ("transfer", "cpu") times whole steps of each at each batch size (DECODE_PROBE_STEPS timed steps each,
``until_timed``) and then runs the faster, timing the slower again every DECODE_REVISIT_STEPS steps; warm-ups run
both modes outside its count (``Engine.forced_step``). The CPU site is probed this way even on a link much faster
than it: its few probe steps are the price (DECODE_PROBE_STEPS' comment). Why measured and not the rule's per-byte model: on an H100
host with the link emulated at 13 GB/s (OLMoE 30/64, calibrated routing) the rule transferred at batch 8, where the
CPU site's steps were 1.35x faster than the link's, because the CPU rate it learned from single-expert exploration
calls (0.74-0.96 GB/s) was far below what the site does on a step's ~30 absent experts, and its reuse term counts uses
where a batch's CPU call computes each distinct expert once (results/campaigns/h100-link13-auto). Prompt passes and
per-call decode steps keep the rule.

Exploration (``exploring``: prompt passes, per-call decode steps, and auto-split's decode steps). A site the rule never chooses is never
measured in use, so a build-time probe taken at a
bad moment would stand for good (on the H200 host one engine's probe said 0.19 GB/s where the engine built just before
it in the same process measured 11.3, results/campaigns/h200-link13-split, and that auto-split never gave the CPU an
expert). While a call size class has fewer than ``InUseRate.min_calls`` CPU-site calls in use, each of its calls gives
the CPU site one absent expert (with split the least recently routed, else the lowest id) whatever the rule says, and
the engine runs the path with a CPU part for it, while absent experts are to be expected (a class that never misses
does not explore); from then on the measured rate decides. The four calls are taken once: a rate measured on them stays
until calls on the CPU site measure it again (no periodic re-exploration). ``learn=False`` (the rule alone) never
explores.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import statistics
import time

import numpy as np

# auto-split: auto with split=True (the module docstring's "Split"), opt-in until a decode measurement says it helps
# host-read: absent experts read by the GPU straight from the registered host source in decode steps (HostReadPlacement)
# two-site: host-read's steps with a share of each layer's absent experts computed at the CPU site in the same step
# (TwoSitePlacement)
PLACEMENTS = ("gpu", "cpu", "auto", "auto-split", "host-read", "two-site")
# Layer calls of at most this many tokens (decode steps up to batch 16) learn and use one in-use CPU rate, larger calls
# (prompt passes) another. Why: the CPU site reads each expert once per call whatever its tokens, but its arithmetic
# grows with them, so a pass's rate per expert byte is several times lower than a decode step's (on the H200 host
# 2-7 GB/s in prefill against 20-40 GB/s at batch 1, results/campaigns/h200-placement-split); one shared rate learned
# from the prompt's passes kept every decode step on the link when the CPU was the faster site there.
DECODE_CALL_TOKENS = 16
# Placement auto's rule, decode steps (AutoPlacement.decode_steps): each mode first runs until this many of its steps
# are timed (+ 2 untimed: the first after the other mode, and the one that starts the timing; more where runs end
# between them) at each batch size, then the faster runs for DECODE_REVISIT_STEPS steps before the slower is timed
# again (~1 % more time where the slower mode's steps cost 2x: the price on a link much faster than the CPU site). Few steps: the slower mode's probe is paid in
# use, and which mode is faster differs by host, not only by batch (on a 13 GB/s link at OLMoE batch 1 the CPU site's
# steps took ~2.5x the link's on one H100 host and ~0.8x on another; at batch 8 ~0.7x on both;
# results/campaigns/h100-link13-auto).
DECODE_PROBE_STEPS, DECODE_REVISIT_STEPS = 3, 512
# placement two-site's share in fixed point (runmap.kernels.site_split.SHARE_ONE, the same value: the device's split
# and the host's must round alike; here without importing the kernels, as the CLI's parser imports this module)
SHARE_ONE = 1024


class PlacementError(ValueError):
    """A placement that cannot be built (unknown name, a device executor missing, no CPU int4 kernel)."""


@dataclasses.dataclass(frozen=True)
class PlacementCosts:
    """Measured rates (GB/s of qpacked expert bytes) behind an ``auto`` placement."""

    h2d_gb_s: float  # moving one expert row host -> device through the cache's transport path (pinned copy)
    cpu_gb_s: float  # the CPU site computing one expert for one token (batch-1 decode), repacked already
    row_bytes: int
    source: str  # how they were measured
    # the host-read site (the GPU's kernels reading the registered host source over the link) computing one token's
    # top_k experts, where that site is possible (grouped executor, partial residency, contract v2 on a GPU); else None
    host_read_gb_s: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(site, host, device, layer: int = 0, repeats: int = 5,
                  transport=None) -> PlacementCosts:
    """Time the CPU site on one expert at batch 1 and a host -> device copy of that expert's row (pinned
    staging on CUDA, as the miss path copies; a host copy on a CPU device). Best of ``repeats`` each."""
    import torch

    row = host.row_tensor(layer, 0)  # uint8 (row_bytes,) CPU, the immutable host source
    nbytes = int(row.numel())
    x = torch.randn(1, host.layout.hidden_size).to(torch.float16)  # (1, H): a decode token
    site.expert(layer, 0)  # the one-time repack is not part of the rate
    site.expert_output(layer, 0, x)  # nor the first call's setup (the kernel's thread team starting)
    cpu_s = _best_seconds(lambda: site.expert_output(layer, 0, x), repeats)
    if device.type == "cuda":
        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staging.copy_(row)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def copy():
            dst.copy_(staging, non_blocking=True)
            torch.cuda.synchronize(device)
        copy()
        h2d_s = _best_seconds(copy, repeats)
        how = "best of %d: one expert row pinned host -> device; the CPU site on one expert at batch 1" % repeats
    else:
        dst = torch.empty_like(row)
        h2d_s = _best_seconds(lambda: dst.copy_(row), repeats)
        how = "best of %d: one expert row host copy (CPU device); the CPU site on one expert at batch 1" % repeats
    h2d_gb_s = nbytes / max(h2d_s, 1e-9) / 1e9
    paced = getattr(transport, "pace_gb_s", None) if transport is not None else None
    if paced is not None and paced < h2d_gb_s:  # an emulated slower link (runmap.residency.transport.pace)
        h2d_gb_s, how = paced, how + f"; host->device capped at the emulated link's {paced:g} GB/s"
    return PlacementCosts(h2d_gb_s=h2d_gb_s, cpu_gb_s=nbytes / max(cpu_s, 1e-9) / 1e9, row_bytes=nbytes, source=how)


class InUseRate:
    """A rate (GB/s) observed in use: bytes and wall seconds of recent calls, the oldest share forgotten at each
    call (an exponential average with weight ``1 - decay`` on the newest), trusted from ``min_calls`` calls on.

    ``clip`` (None: off, the default): once trusted, one call counts at most clip times the seconds the current rate
    predicts for its bytes. Used by the two-site split (TwoSitePlacement.CPU_RATE_CLIP), whose calls are of one kind
    (decode steps). Why: one call stalled by something else on the host (a page fault, another process) would
    otherwise weigh like tens of normal calls, and a rate that falls far enough stops its site being given work, so
    nothing measures it again (on an H100 host placement auto's two-site split learned 0.23 GB/s from 5 calls and gave
    the CPU site nothing for the rest of the run, results/campaigns/h100-auto-sites-b1-probe). A site that really slows
    down still moves the rate, by a bounded factor per call. Off for auto's rates: a size class there holds calls whose
    time per byte differs for real (prompt passes of different lengths). Calls of no bytes or no seconds say
    nothing."""

    def __init__(self, decay: float = 0.9, min_calls: int = 4, clip: float | None = None):
        if not 0.0 <= decay < 1.0 or min_calls < 1 or (clip is not None and not clip >= 1.0):
            raise PlacementError(f"in-use rate: decay {decay} must be in [0, 1), min_calls {min_calls} >= 1 and "
                                 f"clip {clip} None or >= 1")
        self.decay, self.min_calls = decay, min_calls
        self.clip = None if clip is None else float(clip)
        self.calls = 0
        self.clipped = 0  # calls counted at the clip
        self._bytes = 0.0
        self._seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = self.gb_s
        if rate is not None and self.clip is not None:
            most = self.clip * nbytes / (rate * 1e9)
            if seconds > most:
                seconds = most
                self.clipped += 1
        self._bytes = self._bytes * self.decay + nbytes
        self._seconds = self._seconds * self.decay + seconds
        self.calls += 1

    @property
    def gb_s(self) -> float | None:
        """The observed rate, or None before ``min_calls`` calls."""
        if self.calls < self.min_calls:
            return None
        return self._bytes / max(self._seconds, 1e-12) / 1e9


class ReuseEstimator:
    """The hit rate an LRU of ``capacity`` experts per layer would have over the routed groups it is shown: what
    transferring every miss would give, whatever site actually computed each expert."""

    def __init__(self, capacity: int, track_recency: bool = False):
        if capacity < 1:
            raise PlacementError(f"reuse estimator: capacity {capacity} must be >= 1 expert per layer")
        self.capacity = capacity
        self.hits = 0
        self.uses = 0
        self.calls = 0
        # with track_recency (a splitting auto's choice of which experts stay on the CPU): the latest call's experts ->
        # their LRU position before it; off, observe does not rank the whole LRU at every layer call
        self.track_recency = track_recency
        self.last_recency: dict[int, int] = {}
        self._lru: dict[int, dict[int, None]] = {}  # layer -> experts, least recent first (dicts keep order)

    def observe(self, layer: int, experts) -> None:
        """One layer call's routed experts (any iterable of ids; a batch's union counts each expert once)."""
        lru = self._lru.setdefault(layer, {})
        step = sorted({int(v) for v in experts})
        if self.track_recency:  # how recently each of this call's experts was routed before it (-1: not in the LRU)
            rank = {e: i for i, e in enumerate(lru)}
            self.last_recency = {e: rank.get(e, -1) for e in step}
        self.calls += 1
        self.hits += sum(1 for e in step if e in lru)  # against the cache as the call found it
        self.uses += len(step)
        for e in step:
            lru.pop(e, None)
            lru[e] = None  # most recent
        for e in list(lru)[:max(0, len(lru) - self.capacity)]:  # the least recently routed; never this call's,
            del lru[e]                                           # which a group <= capacity leaves at the end

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0


class Placement:
    """Base: decides, under the cache's lock, which absent experts the CPU site computes."""

    name = "gpu"

    def observe(self, layer: int, ids, tokens: int | None = None) -> None:
        """Told every layer call's routed ids before the cache is asked (only auto uses them); ``tokens``: the size of
        the whole call when ``ids`` are one token group of it."""

    def __call__(self, absent: tuple) -> tuple:
        return ()

    def may_use_cpu(self) -> bool:
        """False when this placement can never give the CPU site an expert (the engine then runs the plain path)."""
        return False

    def uses_cpu_now(self, tokens: int | None = None) -> bool:
        """True when the next layer call or decode step (of ``tokens`` tokens) may give the CPU site an expert. Read at
        each layer call of the per-call path and at each decode step: when it is False the plain path (or plain
        segment chain) runs, whose transfers are exactly what this placement would choose."""
        return self.may_use_cpu()

    def describe(self) -> dict:
        return {"mode": self.name}

    def reset_reports(self) -> None:
        """Start the reports that describe() averages over (joins, step phases) afresh; what decides is kept."""


class HostReadPlacement(Placement):
    """Decode steps compute absent experts on the GPU from the host source itself, read over the link by the grouped
    executor through the registered mapping (runmap.kernels.core.expert_site_row): no miss transaction and no host
    round trip inside a step, so the whole step is one CUDA graph as under full residency. Residency changes beside
    the steps: while the next step runs the cache promotes, per layer, a step's hottest host-read expert when the
    eviction policy values it above the coldest resident by ``margin`` (ExpertCache.promote; with lfu-decay over a half-life of
    ``half_life_tokens`` decode steps that converges on the most used experts with a fraction of a promotion per token).
    Prompt passes run the miss transactions of placement gpu (a pass reads each expert many times). Nothing goes to
    the CPU site."""

    name = "host-read"
    HALF_LIFE_TOKENS = 512.0  # the lfu-decay policy's half-life the engine builds for it, in decode steps

    def __init__(self, margin: float = 1.0, half_life_tokens: float = HALF_LIFE_TOKENS,
                 chosen_by: PlacementCosts | None = None, requested: str = "host-read",
                 read_gb_s: float | None = None):
        """chosen_by: the measured rates with which ``auto`` (``requested``) chose this placement; None when asked
        for by name. read_gb_s: the host-read site's rate measured at build (one token's top_k experts over the link;
        GPUs of one kind read host memory at 25-58 GB/s, results/campaigns/h100-host-read-slow-link), None where not
        measured (the CPU device, a failed measurement); with chosen_by, its host_read_gb_s."""
        if not (margin >= 0 and half_life_tokens > 0):  # (NaN fails both)
            raise PlacementError(f"host-read: margin {margin} must be >= 0 and half_life_tokens {half_life_tokens} > 0")
        self.margin, self.half_life_tokens = float(margin), float(half_life_tokens)
        self.chosen_by, self.requested = chosen_by, requested
        self.read_gb_s = chosen_by.host_read_gb_s if chosen_by is not None else read_gb_s

    @classmethod
    def eviction_policy(cls, num_layers: int):
        """The lfu-decay policy the engine builds for host-read: a half-life of HALF_LIFE_TOKENS decode steps, one tick
        per layer each step."""
        from runmap.residency.eviction import LFUDecayPolicy

        return LFUDecayPolicy(half_life=cls.HALF_LIFE_TOKENS * num_layers)

    def describe(self) -> dict:
        d = {"mode": self.name, "promotion_margin": self.margin, "half_life_tokens": self.half_life_tokens,
             "host_read_gb_s": self.read_gb_s}
        if self.chosen_by is not None:
            c = self.chosen_by
            d.update(requested=self.requested, costs=c.to_dict(),
                     why=f"the CPU site's {c.cpu_gb_s:.1f} GB/s per expert byte is not {AUTO_RULE_MARGIN:g}x above both the host-read "
                         f"site's {c.host_read_gb_s:.1f} and the copy's {c.h2d_gb_s:.1f}")
        return d


class TwoSitePlacement(HostReadPlacement):
    """Both sites in one decode step (docs/engine.md, "Two sites in one step"): each MoE layer's absent experts are
    divided between the GPU, which reads its share over the link from the registered host source as under
    placement host-read, and the CPU site, which computes the rest from the same host source at the same time. The
    step (runmap.engine.engine.SegmentDecoder, ``two_site``; on a GPU one CUDA graph whose layers wait on the device for
    the host's CPU sum only where the split gave the CPU site experts, ``step_form`` "graph"; else the segment chain
    with a CPU part per layer, "chain"): one request pins the generation for the whole step, no lease and no miss
    transaction inside it; the host splits each layer's absent experts once its routed ids arrive. Residency changes
    as under host-read: after each step the hottest absent expert of a layer is promoted when the policy values it
    above the coldest resident by ``margin``
    (the CPU site's uses count: its experts were routed). Prompt passes run as host-read's (the GPU reads every
    absent expert: a pass's many tokens per expert are the GPU's work).

    The split. A layer with ``n`` absent experts gives the CPU site about n x share of them, share = cpu / (cpu +
    read): the two sites then finish together when each reads at its rate. In integers, so that the captured step's
    kernel (runmap.kernels.site_split, which decides on the device so that the device part never waits for the host)
    and the host (which starts the CPU part from the ids it reads back) round alike: the share is fixed at each step's
    start as q = round(share x SHARE_ONE) and c = (n q + SHARE_ONE / 2) // SHARE_ONE. ``read`` is the host-read site's rate
    measured at build (one token's top_k experts over the link; not observable inside a captured step), ``cpu`` the
    CPU site's rate learned in use (the job's seconds per expert byte, ``InUseRate``) once it has enough calls, before
    that the build probe's (a call of top_k / 2 experts for one token). Where a rate is missing (the CPU device, where
    no link is read; a failed probe) the share is 1/2. ``share`` given fixes it (benchmarks sweeping it; tests). The
    CPU takes the experts with the fewest routed pairs in the step (its work grows with them, the GPU's reads do not),
    lowest id first among equals."""

    name = "two-site"

    def __init__(self, read_gb_s: float | None, cpu_gb_s: float | None, *,
                 share: float | None = None, margin: float = 1.0, probe: str = "",
                 steps: "StepChooser | None" = None, chosen_by: PlacementCosts | None = None):
        """steps: with it, each decode step is host-read's or the two-site chain as it chooses (placement auto with
        both sites, ``chosen_by`` its measured rates); without, every decode step is the two-site chain."""
        super().__init__(margin=margin, read_gb_s=read_gb_s, chosen_by=chosen_by,
                         requested="auto" if chosen_by is not None else "two-site")
        if share is not None and not 0.0 <= share <= 1.0:  # (NaN fails too)
            raise PlacementError(f"two-site: share {share} must be in [0, 1]")
        self.steps = steps
        self.fixed_share, self.probe_cpu_gb_s, self.probe = share, cpu_gb_s, probe
        self.cpu_rate = InUseRate(clip=self.CPU_RATE_CLIP)
        self.calls = 0  # layer calls split
        self.cpu_experts = 0  # experts given to the CPU site
        self.absent_experts = 0  # absent experts seen by the split
        self.joins = [0, 0, 0.0, 0.0, 0.0]  # the one-graph step's joined layers (note_join): n, with CPU, seconds
        # the one-graph step's host phases (note_step): steps, then seconds in admit, replay, joins, release, promotions;
        # and the last BETWEEN_KEPT gaps between a step and the one before of the same batch (the caller's work)
        self.step_host = [0, 0.0, 0.0, 0.0, 0.0, 0.0]
        self.step_gaps: collections.deque = collections.deque(maxlen=self.BETWEEN_KEPT)
        # layers that may promote an expert after a two-site step (None: every layer that qualifies; the engine sets it
        # from RUNMAP_TWO_SITE_PROMOTIONS)
        self.promotions_per_step: int | None = None
        # balance "wait" (the engine sets it from RUNMAP_TWO_SITE_BALANCE; None: off): the link's rate the split uses is
        # the build probe's x read_scale, moved after each one-graph step by how long the host waited for the ids
        # (note_step); the step's waits so far: seconds, layers
        self.balance: str | None = None
        self.read_scale = 1.0
        self.balance_moves = [0, 0]  # steps that lowered / raised read_scale
        self._step_wait = [0.0, 0]
        self.starved = 0  # layer calls in a row the learned CPU rate gave nothing where the probe's would (count_split)
        self.cpu_rate_resets = 0  # learned CPU rates dropped for it

    def may_use_cpu(self) -> bool:
        return True

    def step_mode(self, batch: int, slot: int) -> str:
        """``two-site`` or ``host-read``: which step decodes ``batch`` rows at KV slot ``slot`` now (always two-site
        when asked for by name)."""
        return "two-site" if self.steps is None else self.steps.mode(batch, slot)

    def observe_cpu(self, nbytes: int, seconds: float, tokens: int | None = None) -> None:
        self.cpu_rate.add(nbytes, seconds)

    def cpu_gb_s(self) -> float | None:
        """The CPU site's rate the split uses: in use once measured there, else the build probe's (None: neither)."""
        rate = self.cpu_rate.gb_s
        return rate if rate is not None else self.probe_cpu_gb_s

    def share(self) -> float:
        if self.fixed_share is not None:
            return self.fixed_share
        return self._share_at(self.cpu_gb_s())

    def _share_at(self, cpu: float | None) -> float:
        """cpu / (cpu + read) for a CPU rate ``cpu``; 1/2 where it or the link's rate is missing."""
        read = self.read_gb_s * self.read_scale if self.read_gb_s else None
        return cpu / (cpu + read) if cpu and read else 0.5

    @staticmethod
    def _cpu_count(n: int, share_q: int) -> int:
        """The CPU site's experts of a layer with ``n`` absent ones at share ``share_q`` / SHARE_ONE, rounded as the
        device's split kernel rounds."""
        return min(n, (n * share_q + SHARE_ONE // 2) // SHARE_ONE)

    def share_q(self) -> int:
        """The share in units of SHARE_ONE, as a step fixes it for the device and the host."""
        return int(round(self.share() * SHARE_ONE))

    def split(self, absent_pairs, share_q: int | None = None) -> tuple:
        """``absent_pairs``: (expert, routed pairs in the step) of each absent expert of one layer -> the experts the
        CPU site computes (sorted). ``share_q``: the step's share in units of SHARE_ONE (default: now's). Counts
        nothing: the caller counts the layer (``count_split``) once the cache has accepted its note."""
        absent_pairs = list(absent_pairs)
        n = len(absent_pairs)
        q = self.share_q() if share_q is None else int(share_q)
        c = self._cpu_count(n, q)
        chosen = sorted(absent_pairs, key=lambda ep: (ep[1], ep[0]))[:c]
        return tuple(sorted(int(e) for e, _ in chosen))

    @classmethod
    def split_mask(cls, pairs: np.ndarray, absent: np.ndarray, share_q: int) -> np.ndarray:
        """``split`` for every layer of a step at once: ``pairs`` int (L, E) each expert's routed pairs in the step,
        ``absent`` bool (L, E) routed and absent -> bool (L, E), the CPU site's experts (per layer the ``split`` of its
        absent experts at ``share_q``: the fewest pairs first, lowest id among equals)."""
        L, E = pairs.shape
        n = absent.sum(axis=1)  # (L,)
        c = np.minimum(n, (n * int(share_q) + SHARE_ONE // 2) // SHARE_ONE)  # as _cpu_count, per layer
        key = np.where(absent, pairs.astype(np.int64) * E + np.arange(E), np.iinfo(np.int64).max)  # (L, E)
        rank = np.empty((L, E), dtype=np.int64)
        np.put_along_axis(rank, np.argsort(key, axis=1), np.arange(E)[None, :].repeat(L, 0), axis=1)
        return absent & (rank < c[:, None])

    # the two-site step's form, set by the engine that runs it (runmap.engine.engine.TWO_SITE_STEP_ENV): "graph", one
    # CUDA graph per step whose layers wait on the device only where the CPU site has experts, or "chain", 2L + 1
    # segments with a host wait between each
    step_form: str | None = None
    # the one-graph form's wait for a layer's ids (runmap.engine.engine.TWO_SITE_WAIT_ENV): "event" or "poll"
    step_wait: str | None = None
    # the one-graph form's handoff of a layer's ids, input, gate weights, keep mask and count to the host
    # (runmap.engine.engine.TWO_SITE_HANDOFF_ENV): "copy" or "mapped"
    step_handoff: str | None = None
    # the one-graph form's host join (runmap.engine.engine.TWO_SITE_JOIN_ENV): "mask" (the device split's pairs in one
    # bound call, the rule checked for every layer after the step's last join) or "rule" (the rule and its check first)
    step_join: str | None = None

    def note_join(self, wait_s: float, split_s: float, cpu_s: float, cpu: bool) -> None:
        """One layer joined by the host in the one-graph step: seconds waiting for its ids, applying and checking the
        split, and computing the CPU part (0 where it had none). The step's reads are noted once after its last join
        (in step_host's joins, not here)."""
        j = self.joins
        j[0] += 1
        j[1] += int(cpu)
        j[2] += wait_s
        self._step_wait[0] += wait_s
        self._step_wait[1] += 1
        j[3] += split_s
        j[4] += cpu_s

    def note_step(self, admit_s: float, replay_s: float, joins_s: float, release_s: float, promote_s: float,
                  between_s: float | None) -> None:
        """One one-graph two-site step's host phases: seconds admitting its request, queueing its graph, joining its
        layers, releasing its request and running its promotions; ``between_s``: seconds since the step before of the
        same batch ended (the caller's work: reading the logits, choosing tokens), None for a first step. The gaps are
        reported by their median: the gap before a run's first step also holds its prompt's pass."""
        h = self.step_host
        h[0] += 1
        for i, v in enumerate((admit_s, replay_s, joins_s, release_s, promote_s), start=1):
            h[i] += v
        if between_s is not None:
            self.step_gaps.append(between_s)
        self._balance_step()

    # Balance "wait": a one-graph step whose host waited more than BALANCE_HIGH_S per layer on average for the ids
    # (the device part, which reads the GPU's share over the link, ends after the host's CPU part) lowers the link's
    # rate the next steps' split uses by BALANCE_FACTOR, giving the CPU site more; one that waited less than
    # BALANCE_LOW_S (the host is late: the device waits at the joins) raises it; between them nothing moves.
    # read_scale stays in [1 / BALANCE_BOUND, BALANCE_BOUND]. Why: the split's link rate is the build probe's (one
    # token's experts at batch 1), while a batch-8 step's union reads slower on some GPUs (19 against 32 GB/s on an
    # H100, results/campaigns/h100-host-read-38af465); on an H100 a batch-8 two-site step's host waited 400 us per
    # layer for the ids against a 595 us CPU part (results/campaigns/h100-llama-matched-sites-b1, n-cpu-moe 12). The
    # dead band's low edge is above an event's wake-up (~5-10 us); its high edge above a next layer's attention and
    # split, which the host waits for even when the device never waits for it. Not measured on a GPU yet: off by default.
    BALANCE_LOW_S = 20e-6
    BALANCE_HIGH_S = 80e-6
    BALANCE_FACTOR = 1.1
    BALANCE_BOUND = 8.0

    def _balance_step(self) -> None:
        """End of a one-graph step (note_step): move read_scale by the step's mean wait for the ids (balance "wait")."""
        wait_s, layers = self._step_wait
        self._step_wait = [0.0, 0]
        if self.balance != "wait" or not layers or self.fixed_share is not None:
            return
        mean = wait_s / layers
        if mean > self.BALANCE_HIGH_S:
            self.read_scale = max(self.read_scale / self.BALANCE_FACTOR, 1.0 / self.BALANCE_BOUND)
            self.balance_moves[0] += 1
        elif mean < self.BALANCE_LOW_S:
            self.read_scale = min(self.read_scale * self.BALANCE_FACTOR, self.BALANCE_BOUND)
            self.balance_moves[1] += 1

    BETWEEN_KEPT = 4096  # gaps between steps kept for their median (note_step)

    # a CPU part counts at most this many times the seconds the learned rate predicts for it (InUseRate's clip)
    CPU_RATE_CLIP = 4.0
    # Layer calls in a row that the rate learned in use gives the CPU site nothing where the build probe's rate would
    # have given it at least one expert, after which that learned rate is forgotten (``count_split``): 16 decode steps
    # of a 16-layer model
    STARVED_LAYER_CALLS = 256

    def count_split(self, absent: int, cpu: int) -> None:
        """One layer split: ``absent`` absent experts, ``cpu`` of them given to the CPU site.

        Also the way back from a learned rate too low to be tested: while the CPU site gets no experts its rate is
        never measured again, so a rate learned in a slow moment would stand for the rest of the engine's life. After
        STARVED_LAYER_CALLS layer calls in a row where the learned rate gave the CPU site nothing and the probe's
        (1/2 where the build probe failed) would have given it an expert, the learned rate is dropped: the split uses
        the probe's rate until ``InUseRate.min_calls`` new calls have measured it again (``cpu_rate_resets`` counts
        the drops). A step fixes its share when it starts, so where the CPU site really is that slow this costs the
        next whole step at the probe's share, once every STARVED_LAYER_CALLS layer calls."""
        self.calls += 1
        self.absent_experts += absent
        self.cpu_experts += cpu
        if cpu or self.fixed_share is not None or self.cpu_rate.gb_s is None or not self.read_gb_s:
            self.starved = 0  # (no link rate or a fixed share: the learned rate does not decide the share)
            return
        probe_q = int(round(self._share_at(self.probe_cpu_gb_s) * SHARE_ONE))
        if self._cpu_count(absent, probe_q) < 1:  # the probe's rate would not have given one either
            return
        self.starved += 1
        if self.starved >= self.STARVED_LAYER_CALLS:
            self.cpu_rate = InUseRate(self.cpu_rate.decay, self.cpu_rate.min_calls, self.cpu_rate.clip)
            self.cpu_rate_resets += 1
            self.starved = 0

    def kept(self) -> tuple:
        """What a warm-up must leave as it was (``put_back``): the split counts, the one-graph step's join times, the
        starved run and rate resets (``count_split``) and the CPU rate learned in use (the
        warm-up's pad-token steps give the CPU site few experts per call, slower per byte than a user's: on an H100
        they left 3.6-4.4 GB/s learned where a user's batch-8 steps learned 36-39, results/campaigns/h100-auto-sites)."""
        return (self.split_counts(), copy.deepcopy(self.cpu_rate), list(self.joins),
                (self.starved, self.cpu_rate_resets), (list(self.step_host), list(self.step_gaps)),
                (self.read_scale, list(self.balance_moves)))

    def put_back(self, kept: tuple) -> None:
        self.split_counts(kept[0])
        self.cpu_rate = kept[1]
        self.joins = list(kept[2])
        self.starved, self.cpu_rate_resets = kept[3]
        self.step_host = list(kept[4][0])
        self.step_gaps = collections.deque(kept[4][1], maxlen=self.BETWEEN_KEPT)
        self.read_scale, self.balance_moves = kept[5][0], list(kept[5][1])
        self._step_wait = [0.0, 0]

    def reset_reports(self) -> None:
        """The one-graph step's joins and host phases from here on (a bench row's timed runs on an engine that earlier
        rows and warm-ups used too); the rates, shares and chooser that decide are kept."""
        self.joins = [0, 0, 0.0, 0.0, 0.0]
        self.step_host = [0, 0.0, 0.0, 0.0, 0.0, 0.0]
        self.step_gaps.clear()
        self.balance_moves = [0, 0]

    def split_counts(self, restore: tuple | None = None) -> tuple:
        """(calls, absent experts, CPU experts) so far; with ``restore``, set them back to it first."""
        if restore is not None:
            self.calls, self.absent_experts, self.cpu_experts = restore
        return self.calls, self.absent_experts, self.cpu_experts

    def describe(self) -> dict:
        d = super().describe()
        if self.chosen_by is not None:
            c = self.chosen_by
            d["why"] = (f"the CPU site's {c.cpu_gb_s:.1f} GB/s per expert byte is not {AUTO_RULE_MARGIN:g}x above both the host-read site's "
                        f"{c.host_read_gb_s:.1f} and the copy's {c.h2d_gb_s:.1f}, so host-read's steps, and from batch "
                        f"{self.steps.min_batch} up the two-site step where it measures faster")
        if self.steps is not None:
            d["steps"] = self.steps.describe()
        d.update(mode=self.name, cpu_share=self.share(), fixed_share=self.fixed_share,
                 cpu_gb_s=self.cpu_gb_s(), cpu_gb_s_probe=self.probe_cpu_gb_s, cpu_gb_s_in_use=self.cpu_rate.gb_s,
                 cpu_calls_in_use=self.cpu_rate.calls, cpu_calls_clipped=self.cpu_rate.clipped,
                 cpu_rate_resets=self.cpu_rate_resets, split_calls=self.calls, split_absent=self.absent_experts,
                 split_cpu=self.cpu_experts, probe=self.probe)
        if self.step_form is not None:
            d["step_form"] = self.step_form
        if self.step_wait is not None:
            d["step_wait"] = self.step_wait
        if self.step_handoff is not None:
            d["step_handoff"] = self.step_handoff
        if self.step_join is not None:
            d["step_join"] = self.step_join
        if self.promotions_per_step is not None:
            d["promotions_per_step"] = self.promotions_per_step
        if self.balance is not None:
            d["balance"] = {"mode": self.balance, "read_scale": self.read_scale, "lowered": self.balance_moves[0],
                            "raised": self.balance_moves[1]}
        if self.joins[0]:
            n, ncpu, wait_s, split_s, cpu_s = self.joins
            d["joins"] = {"layers": n, "cpu_layers": ncpu, "wait_us": 1e6 * wait_s / n, "split_us": 1e6 * split_s / n,
                          "cpu_us_per_cpu_layer": 1e6 * cpu_s / ncpu if ncpu else None}
        if self.step_host[0]:
            n, admit, replay, joins, release, promote = self.step_host
            d["step_host"] = {"steps": n, "admit_us": 1e6 * admit / n, "replay_us": 1e6 * replay / n,
                              "joins_us": 1e6 * joins / n, "release_us": 1e6 * release / n,
                              "promote_us": 1e6 * promote / n, "gaps": len(self.step_gaps),
                              "gap_median_us": 1e6 * statistics.median(self.step_gaps) if self.step_gaps else None}
        return d


# The device split's bounds (runmap.kernels.site_split, one program: every expert and routed pair of a layer), here
# without importing the kernels, as SHARE_ONE: the engine refuses placement two-site past them and auto never runs it.
TWO_SITE_MAX_EXPERTS, TWO_SITE_MAX_PAIRS = 256, 1024


def two_site_fits(num_experts: int, top_k: int, max_batch: int) -> bool:
    """Whether the device split can decide a layer of ``num_experts`` experts at ``max_batch`` x ``top_k`` pairs."""
    return num_experts <= TWO_SITE_MAX_EXPERTS and top_k * max_batch <= TWO_SITE_MAX_PAIRS


# Placement auto with both sites: below this decode batch size it runs host-read's steps only, from it the faster of
# the two steps as measured. Measured: the two-site chain lost at batch 1 in every row on two H100 hosts (0.47-0.82x
# host-read, results/campaigns/h100-two-site and h100-two-site-repeat: a host wait per layer of ~1.4 ms a token). The
# one-graph step with the mask join won at batch 1 on an H100 whose GPU reads host memory slowly (n-cpu-moe 12 / 16:
# 1.49 / 1.59x host-read, results/campaigns/h100-two-site-mask-join). A minimum of 1 on an H100 that reads it fast
# (results/campaigns/h100-auto-sites-b1-probe) was slower at batch 1 in every row than host-read alone on a like
# machine (259 against 549 tok/s at n-cpu-moe 4): there the two-site step it kept gave the CPU site nothing (its rate
# learned in use from 5 small calls, 0.23 GB/s), so it was host-read's work plus a join per layer, and the probe timed
# host-read's steps ~1.5x slower than host-read runs (why: UNKNOWN). TWO_SITE_MIN_BATCH_ENV in runmap.engine.engine
# sets another minimum for A/B runs.
TWO_SITE_MIN_BATCH = 4


class StepChooser:
    """Which decode step runs at each batch size, host-read's one graph (``host-read``) or the two-site chain
    (``two-site``), from their wall time per step measured in use (placement ``auto`` where both sites exist,
    docs/engine.md "Two sites in one step"). Why measured and not modelled: the two-site step pays a host wait per layer
    that the host-read step does not, and gains only where a step has enough absent experts for the CPU site's share
    to outweigh it (at batch 8 on one H100 host: 1.20-1.34x host-read at 16 of 64 resident, 0.83-0.88x at 32 of 64);
    neither term is known before the steps run.

    Per batch size (at least ``min_batch``; smaller batches always run host-read): first ``rounds`` alternations of
    the two modes, host-read first, each run for ceil(``probe_steps`` / rounds) + 2 steps; then the faster by the median
    of its measured steps for ``revisit_steps`` steps, then the slower is probed again for probe_steps + 2 steps (its
    old times dropped; the winner keeps being measured while it runs), and so on. Why alternate: a mode probed only
    first would be timed only in the steps right after the prompt, the other only later (on an H100 host the chooser
    timed host-read's steps ~1.5x slower than host-read runs, results/campaigns/h100-auto-sites-b1-probe; why:
    UNKNOWN), while both are timed on either side of each other. A step's time is the wall time from one ``mode``
    call to the next of the same batch size, counted only when both calls and the one before them ran the same mode
    at consecutive KV slots: so a host-read step (one in flight while the next is queued) is timed in its steady
    state, and the first two-site step after host-read (which ends the host-read step in flight first) is not
    counted. A probe that timed no step (slots never consecutive, e.g. one-token runs) leaves host-read (the engine's
    step without a CPU part)."""

    MODES = ("host-read", "two-site")

    def __init__(self, min_batch: int = TWO_SITE_MIN_BATCH, probe_steps: int = 8, revisit_steps: int = 512,
                 window: int = 16, rounds: int = 2, modes: tuple = MODES, until_timed: bool = False):
        """modes: (the default mode, the other); the default runs below min_batch, first in each probe round, and
        where no step of a probe was timed. Placement auto's rule uses ("transfer", "cpu") (AutoPlacement).
        until_timed: a probe runs on, a step at a time, until it has timed as many steps as it was meant to (its
        length - 2), up to 4x that many extra steps: short runs (a warm-up, one request's few tokens) break the timing
        at their ends, and a probe of fixed length could then end with one step timed or none."""
        if not (min_batch >= 1 and probe_steps >= 1 and revisit_steps >= 1 and window >= 1 and rounds >= 1):
            raise PlacementError(f"step chooser: min_batch {min_batch}, probe_steps {probe_steps}, revisit_steps "
                                 f"{revisit_steps}, window {window} and rounds {rounds} must be >= 1")
        if len(modes) != 2 or modes[0] == modes[1]:
            raise PlacementError(f"step chooser: modes {modes!r} must be two different names")
        self.min_batch, self.probe_steps, self.revisit_steps = int(min_batch), int(probe_steps), int(revisit_steps)
        self.window, self.rounds = int(window), int(rounds)
        self.MODES = tuple(modes)
        self.until_timed = bool(until_timed)
        self._batches: dict[int, dict] = {}  # batch -> its state (``_state``)

    def _state(self, batch: int) -> dict:
        st = self._batches.get(batch)
        if st is None:
            # phase: (mode run, steps left in it); queue: the phases after it, ("probe", mode, steps, drop old times)
            # or ("use",), the faster mode for revisit_steps steps
            each = -(-self.probe_steps // self.rounds) + 2
            queue = [("probe", m, each, False) for _ in range(self.rounds) for m in self.MODES][1:] + [("use",)]
            st = self._batches[batch] = {"times": {m: [] for m in self.MODES}, "phase": (self.MODES[0], each),
                                         "queue": queue, "last": None, "run": 0,
                                         "steps": dict.fromkeys(self.MODES, 0), "choices": 0, "chosen": None,
                                         # the phase running: a probe?, the steps it should time, timed, extra steps
                                         "probing": True, "need": each - 2, "phase_timed": 0, "extra": 0}
        return st

    def faster(self, batch: int) -> str | None:
        """The mode whose measured steps at ``batch`` have the lower median, None before both have one."""
        st = self._batches.get(batch)
        if st is None or not all(st["times"].values()):
            return None
        first, second = self.MODES
        med = {m: _median(v) for m, v in st["times"].items()}
        return second if med[second] < med[first] else first

    def _next_phase(self, st: dict, batch: int) -> tuple:
        """The phase that follows the one just ended: the next probe queued (its mode's old times dropped where it is
        a revisit), or the faster mode used for revisit_steps steps, after which the other is probed again."""
        item = st["queue"].pop(0)
        if item[0] == "use":
            best = self.faster(batch) or self.MODES[0]
            st["choices"] += 1
            st["chosen"] = best
            other = self.MODES[1] if best == self.MODES[0] else self.MODES[0]
            st["queue"] = [("probe", other, self.probe_steps + 2, True), ("use",)]
            st["probing"] = False
            return best, self.revisit_steps
        _, probed, steps, drop = item
        if drop:  # what it measured before: another cache state, another KV length
            st["times"][probed].clear()
        st["probing"], st["need"], st["phase_timed"], st["extra"] = True, steps - 2, 0, 0
        return probed, steps

    def mode(self, batch: int, slot: int, now: float | None = None) -> str:
        """The mode of the decode step about to run at ``batch`` rows and KV slot ``slot`` (called once per step, at
        its start; ``now``: the wall clock, perf_counter by default), counting the time since the step before."""
        if batch < self.min_batch:
            return self.MODES[0]
        now = time.perf_counter() if now is None else float(now)
        st = self._state(batch)
        mode, left = st["phase"]
        if (left <= 0 and self.until_timed and st["probing"] and st["phase_timed"] < st["need"]
                and st["extra"] < 4 * max(1, st["need"])):
            left, st["extra"] = 1, st["extra"] + 1  # the probe runs on: too few of its steps were timed
        if left <= 0:
            mode, left = self._next_phase(st, batch)
        st["phase"] = (mode, left - 1)
        last = st["last"]
        consecutive = last is not None and last[0] == mode and last[1] + 1 == int(slot)
        if consecutive and st["run"] >= 2:
            times = st["times"][mode]
            times.append(now - last[2])
            del times[:-self.window]
            st["phase_timed"] += 1
        st["run"] = st["run"] + 1 if consecutive else 1
        st["last"] = (mode, int(slot), now)
        st["steps"][mode] += 1
        return mode

    def break_runs(self) -> None:
        """The next step of every batch size starts a new run (called when a run of decode steps ends): a step is never
        timed across two runs, whatever their slots."""
        for st in self._batches.values():
            st["last"], st["run"] = None, 0

    def describe(self) -> dict:
        """Per batch size (as a string), over the engine's life: the mode chosen last (None while the first probes run), the median measured
        step of each mode in ms (None: none timed), the steps run and timed of each mode, how many choices were made."""
        out = {}
        for b, st in sorted(self._batches.items()):
            out[str(b)] = {"chosen": st["chosen"], "choices": st["choices"], "steps": dict(st["steps"]),
                           "timed": {m: len(v) for m, v in st["times"].items()},
                           "median_ms": {m: (_median(v) * 1e3 if v else None) for m, v in st["times"].items()}}
        return {"min_batch": self.min_batch, "probe_steps": self.probe_steps, "revisit_steps": self.revisit_steps,
                "rounds": self.rounds, "by_batch": out}


def _median(values) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def measure_cpu_call_gb_s(site, layer: int, top_k: int, hidden_size: int, row_bytes: int,
                          repeats: int = 5) -> float:
    """The CPU site computing top_k / 2 experts (at least one) for one token in one call, best of ``repeats`` after
    an untimed call: GB/s of expert bytes read (the two-site split's starting CPU rate)."""
    import torch

    n = max(1, top_k // 2)
    x = torch.randn(1, hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.float16)  # (1, H)
    ids = torch.arange(top_k, dtype=torch.int64).view(1, top_k)  # (1, k)
    gw = torch.full((1, top_k), 1.0 / top_k, dtype=torch.float32)  # (1, k)
    subset = tuple(range(n))
    site.moe_subset(layer, x, ids, gw, subset)
    return n * row_bytes / max(_best_seconds(lambda: site.moe_subset(layer, x, ids, gw, subset), repeats), 1e-9) / 1e9


class CpuPlacement(Placement):
    """Every absent expert is computed on the CPU: nothing is ever transferred after startup."""

    name = "cpu"

    def __call__(self, absent: tuple) -> tuple:
        return absent

    def may_use_cpu(self) -> bool:
        return True


class AutoPlacement(Placement):
    """At each layer call, transfer the absent experts or compute them on the CPU, from measured costs (module
    docstring)."""

    name = "auto"

    def __init__(self, costs: PlacementCosts, counters, resident: int | None = None, learn: bool = True,
                 split: bool = False):
        """learn=False keeps the rule on ``costs`` (tests and what-if runs with given rates); what is observed in use
        is still recorded and reported. split=False: each layer call's absent experts all go one way (the rule alone);
        True: they are divided between the two sites, which then work at once (module docstring)."""
        self.costs = costs
        self.learn = learn
        self.split = split
        self.name = "auto-split" if split else "auto"  # the registry's name (PLACEMENTS), in telemetry and records
        # h: with ``resident`` (the engine's case) a shadow LRU of the routes at that residency; without it, the
        # counters given (hits, misses, cpu_site_experts), e.g. the cache's own
        self.counters = counters
        self.reuse = ReuseEstimator(resident, track_recency=split) if resident is not None else None
        self.decisions = {"transfer": 0, "cpu": 0}
        self.explored = 0  # absent experts given to the CPU site to measure its rate in use (exploring)
        self.split_calls = 0  # layer calls whose absent experts went to both sites
        # CPU-site calls: expert bytes read / wall seconds, decode-sized calls and prompt passes apart
        # (DECODE_CALL_TOKENS)
        self.cpu_in_use = InUseRate()
        self.cpu_in_use_passes = InUseRate()
        self.h2d_in_use = InUseRate()  # acquisitions that moved experts: bytes moved / wall seconds
        self.call_tokens = 1  # tokens of the layer call being decided (observe, uses_cpu_now), 1 until told
        # decode steps of the rule (learn, no split): every absent expert of a step transferred or every one computed
        # at the CPU site, whichever measured the faster step at its batch size (``decode_step``; module docstring)
        self.decode_steps = (StepChooser(min_batch=1, probe_steps=DECODE_PROBE_STEPS,
                                         revisit_steps=DECODE_REVISIT_STEPS, rounds=1, modes=("transfer", "cpu"),
                                         until_timed=True)
                             if learn and not split else None)
        self._step_mode: str | None = None  # the decode step's mode while one runs (decode_step .. end_decode_step)
        self.forced_mode: str | None = None  # set by Engine.forced_step (warm-ups): the steps' mode, chooser not asked

    def decode_step(self, batch: int, slot: int, now: float | None = None) -> str | None:
        """A decode step of ``batch`` rows at KV slot ``slot`` starts: its mode from the step chooser (``transfer``:
        every absent expert of its layer calls moved; ``cpu``: every one computed at the CPU site), which holds until
        ``end_decode_step``; None without a chooser (split, or learn=False: the rule decides each call)."""
        if self.decode_steps is None:
            return None
        self._step_mode = self.forced_mode or self.decode_steps.mode(batch, slot, now)
        return self._step_mode

    def end_decode_step(self) -> None:
        self._step_mode = None

    def _cpu_rate(self, tokens: int | None = None) -> InUseRate:
        n = self.call_tokens if tokens is None else tokens
        return self.cpu_in_use if n <= DECODE_CALL_TOKENS else self.cpu_in_use_passes

    def cpu_gb_s(self, tokens: int | None = None) -> float:
        """The CPU site's rate for a layer call of ``tokens`` tokens (default: the call being decided): observed in use
        on calls of its size class once there is enough of it, else the build-time probe's (one expert at batch 1)."""
        seen = self._cpu_rate(tokens).gb_s if self.learn else None
        return seen if seen is not None else self.costs.cpu_gb_s

    def h2d_gb_s(self) -> float:
        """The transfer path's rate (host transaction included): observed in use once there is enough, else the
        build-time probe's (a pinned copy alone), never above an emulated link's pace."""
        seen = self.h2d_in_use.gb_s if self.learn else None
        return min(seen, self.costs.h2d_gb_s) if seen is not None else self.costs.h2d_gb_s

    def observe_cpu(self, nbytes: int, seconds: float, tokens: int | None = None) -> None:
        """One CPU-site call of ``tokens`` tokens (default: the call being decided): the expert bytes it read (experts x
        row bytes) and its wall time, counted in its size class's rate."""
        self._cpu_rate(tokens).add(nbytes, seconds)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """One acquisition that moved expert bytes host -> device and its wall time."""
        self.h2d_in_use.add(nbytes, seconds)

    def observe(self, layer: int, ids, tokens: int | None = None) -> None:
        """ids: a layer call's routed expert ids, (n, k) or flat (a host tensor, an array or a sequence). The call's
        token count (the CPU rate's size class for the decision that follows) is ``tokens`` when given (``ids`` are one
        token group of a larger call), else n of a 2-D ids."""
        import numpy as np  # here, not at import: the CLI's option module imports this one for PLACEMENTS

        arr = np.asarray(ids)
        if tokens is not None:
            self.call_tokens = int(tokens)
        elif arr.ndim == 2:
            self.call_tokens = int(arr.shape[0])
        if self.reuse is not None:
            self.reuse.observe(layer, arr.reshape(-1).tolist())

    def may_use_cpu(self) -> bool:
        """Without split, a link at least as fast as the CPU site transfers at every hit rate (threshold 0). With split
        the CPU site may take a share of any call (``cpu_count``), whatever the rates."""
        return self.split or self.cpu_gb_s() > self.h2d_gb_s()

    def hit_rate(self) -> float:
        if self.reuse is not None:
            return self.reuse.hit_rate
        c = self.counters
        seen = c["hits"] + c["misses"] + c["cpu_site_experts"]
        return c["hits"] / seen if seen else 0.0

    def transfer(self, h: float) -> bool:
        """True when moving an absent expert is expected to cost less than computing each of its uses on the CPU:
        (1 / h2d) < (1 / cpu) / (1 - h), per byte."""
        return (1.0 - h) / self.h2d_gb_s() < 1.0 / self.cpu_gb_s()

    def cpu_share(self) -> float:
        """The fraction of a call's absent experts the CPU site computes in the time the link moves the rest:
        cpu / (cpu + h2d), rates per byte."""
        c, r = self.cpu_gb_s(), self.h2d_gb_s()
        return c / (c + r)

    def exploring(self, tokens: int | None = None) -> bool:
        """True while the CPU site's rate for calls of this size class has not been measured in use (fewer than its
        ``min_calls`` calls) and the rule learns: such a call gives the CPU site one absent expert whatever the rule
        says, so that the rate it decides with comes from use. Why: a site the rule never chooses is never measured,
        and a build-time probe taken while the host was busy (0.19 GB/s on the H200 host where another engine of the
        same process measured 11.3, results/campaigns/h200-link13-split) would otherwise stand for good."""
        if self._step_mode is not None:  # a decode step: its whole mode is measured (decode_step)
            return False
        rate = self._cpu_rate(tokens)
        # only while calls have absent experts to give: a class that never misses would otherwise keep the engine on
        # the path with a CPU part (a longer chain) for good, with nothing ever measured
        return self.learn and rate.calls < rate.min_calls and self._misses_expected()

    def _misses_expected(self) -> bool:
        """Absent experts are to be expected at the next call: the shadow LRU's expected count is at least half an
        expert (no shadow: the counters say some call missed)."""
        if self.reuse is None:
            return bool(self.counters["misses"] or self.counters["cpu_site_experts"])
        return not self.reuse.calls or self.expected_absent() >= 0.5

    def cpu_count(self, n: int, h: float) -> int:
        """How many of ``n`` absent experts go to the CPU site at hit rate ``h``. Without split: all or none (the
        rule). With split, the sites work at once, so the call takes max(c / cpu, (n - c) / h2d): where the rule
        favours transferring, the CPU takes floor(n x share) (it finishes no later than the link), else
        n - floor(n x (1 - share)) (the link finishes no later than the CPU)."""
        return self._explored_count(n, self._rule_count(n, h))

    def _explored_count(self, n: int, rule: int) -> int:
        """The rule's CPU count ``rule`` of ``n`` absent experts, raised to one while exploring."""
        return max(rule, 1) if n and self.exploring() else rule

    def _rule_count(self, n: int, h: float) -> int:
        """cpu_count by the rule alone (no exploration)."""
        favour_transfer = self.transfer(h)
        if not self.split:
            return 0 if favour_transfer else n
        share = self.cpu_share()
        return int(n * share) if favour_transfer else n - int(n * (1.0 - share))

    def expected_absent(self) -> float:
        """Absent experts per layer call if every miss were transferred: (1 - h) x the calls' mean group size."""
        if self.reuse is None or not self.reuse.calls:
            return 0.0
        return (1.0 - self.hit_rate()) * self.reuse.uses / self.reuse.calls

    def uses_cpu_now(self, tokens: int | None = None) -> bool:
        """True when the next call or step (of ``tokens`` tokens, when given: its CPU rate's size class) may give the
        CPU site experts: without split, the rule at the current hit rate; with split, also where a call with the
        expected number of absent experts would give it one. False keeps the engine on its plain path or plain segment
        chain, so a decision to transfer everything costs no more than placement ``gpu`` (measured before: auto's
        transfers through the mixed per-call path ran 2.8x slower than gpu's segment chain,
        results/campaigns/h200-placement)."""
        if tokens is not None:
            self.call_tokens = int(tokens)
        if self._step_mode is not None:
            return self._step_mode == "cpu"
        if self.exploring():
            return True
        h = self.hit_rate()
        if not self.transfer(h) and self.may_use_cpu():
            return True
        if not self.split:
            return False
        n = max(1, round(self.expected_absent()))
        return self.cpu_count(n, h) > 0

    def __call__(self, absent: tuple) -> tuple:
        n = len(absent)
        if self._step_mode is not None:  # a decode step: all one way, as its mode says
            c = n if self._step_mode == "cpu" else 0
            self.decisions["transfer"] += n - c
            self.decisions["cpu"] += c
            return absent if c else ()
        rule = self._rule_count(n, self.hit_rate())
        c = self._explored_count(n, rule)
        if c != rule:  # the one expert exploration gave the CPU site
            self.explored += 1
        self.decisions["transfer"] += n - c
        self.decisions["cpu"] += c
        if c == n:
            return absent
        if c == 0:
            return ()
        self.split_calls += 1
        # the least recently routed go to the CPU site (never published, so they stay absent); the more recently
        # routed, likelier to be routed again soon, are transferred and become resident
        recency = self.reuse.last_recency if self.reuse is not None else {}
        return tuple(sorted(absent, key=lambda e: (recency.get(e, -1), e))[:c])

    def describe(self) -> dict:
        h = self.hit_rate()
        source = (f"shadow LRU of the routed experts at {self.reuse.capacity} per layer ({self.reuse.uses} uses)"
                  if self.reuse is not None else "the counters given")
        return {"mode": self.name, "costs": self.costs.to_dict(), "hit_rate": h, "hit_rate_source": source,
                # the rates of the call being decided (call_tokens tokens); the CPU's two size classes side by side
                "rates_used": {"cpu_gb_s": self.cpu_gb_s(), "h2d_gb_s": self.h2d_gb_s(), "learn": self.learn,
                               "call_tokens": self.call_tokens, "cpu_gb_s_decode": self.cpu_gb_s(1),
                               "cpu_gb_s_passes": self.cpu_gb_s(DECODE_CALL_TOKENS + 1)},
                "in_use": {"cpu_gb_s": self.cpu_in_use.gb_s, "cpu_calls": self.cpu_in_use.calls,
                           "cpu_passes_gb_s": self.cpu_in_use_passes.gb_s,
                           "cpu_passes_calls": self.cpu_in_use_passes.calls,
                           "h2d_gb_s": self.h2d_in_use.gb_s, "h2d_calls": self.h2d_in_use.calls},
                "transfer_if_hit_rate_above": max(0.0, 1.0 - self.h2d_gb_s() / self.cpu_gb_s()),
                "now": "transfer" if self.transfer(h) else "cpu", "decisions": dict(self.decisions),
                "split": self.split, "cpu_share": self.cpu_share() if self.split else None, "explored": self.explored,
                "split_calls": self.split_calls,
                "decode_steps": self.decode_steps.describe() if self.decode_steps is not None else None}


# auto leaves the host-read steps for the per-call rule only where the CPU site's build probe is this many times the
# faster of the host-read site and the copy. Why a margin: the probes time one expert (the CPU) or one token's experts
# (the link) for a few calls each, while the rule's decode steps pay a host wait per layer that host-read's one-graph
# step does not. On an H100 host a CPU probe of 41.3 GB/s against a copy of 41.0 and host reads of 32.6 chose the rule,
# which decoded 159.2 / 221.1 tok/s at batch 1 / 8 (n-cpu-moe 8 rows) where host-read's family ran 291.8 / 625.3 in the
# same call with 7 more resident rows per layer (results/campaigns/h100-llama-matched-lent); the rule had lost to
# host-read on every machine measured before it too (results/campaigns/h100-host-read-complete).
AUTO_RULE_MARGIN = 1.25


def auto_chooses_host_read(costs: PlacementCosts) -> bool:
    """True when ``auto`` should run as placement host-read (module docstring): the host-read site was measured here
    and the CPU site is not AUTO_RULE_MARGIN times faster than both it and the link's copy."""
    return costs.host_read_gb_s is not None and \
        costs.cpu_gb_s <= AUTO_RULE_MARGIN * max(costs.host_read_gb_s, costs.h2d_gb_s)


def _measured(host_read_rate) -> tuple[float | None, str | None]:
    """(the host-read site's rate from ``host_read_rate()``, None) or (None, the error it raised)."""
    try:
        return float(host_read_rate()), None
    except Exception as e:  # a measurement, never a result: the caller records or ignores it
        return None, f"{type(e).__name__}: {e}"


def make_placement(name: str, *, cache=None, site=None, costs: PlacementCosts | None = None,
                   host_read_rate=None, share: float | None = None, top_k: int = 1,
                   both_sites: bool = False, min_batch: int | None = None) -> Placement:
    """The placement registered under ``name`` (PLACEMENTS). ``auto`` measures its costs on ``cache``'s host
    source and device through ``site`` (a runmap.kernels.cpu_int4.CpuExpertSite) unless ``costs`` is given;
    ``host_read_rate`` (a callable returning GB/s, given where placement host-read is possible) measures the host-read
    site too unless ``costs`` holds its rate, and ``auto`` is then placement host-read when ``auto_chooses_host_read``
    (``auto-split`` never: it is the rule dividing calls between the CPU and the link). A measurement that raises
    leaves the rule, with the error in ``costs.source``. Placement ``host-read`` records the rate it measures (None
    where it raises). ``two-site`` measures the host-read site (where ``host_read_rate`` is given) and the CPU site
    ``site`` on a call of top_k / 2 experts; ``share`` fixes its CPU share (TwoSitePlacement). ``both_sites``
    (the engine can run the two-site step: batches of ``min_batch`` rows or more, TWO_SITE_MIN_BATCH where None; the
    split kernel's bounds): where ``auto`` becomes host-read it becomes TwoSitePlacement with a StepChooser(min_batch)
    instead, host-read's steps below ``min_batch`` rows and, from there, whichever step measures faster (its CPU rate
    to start from: the costs')."""
    if name not in PLACEMENTS:
        raise PlacementError(f"expert placement {name!r}: choose one of {', '.join(PLACEMENTS)}")
    if name == "gpu":
        return Placement()
    if name == "cpu":
        return CpuPlacement()
    if name == "host-read":  # the rate only recorded: the steps themselves fail loudly if the reads do
        return HostReadPlacement(read_gb_s=_measured(host_read_rate)[0] if host_read_rate is not None else None)
    if name == "two-site":
        read, error = _measured(host_read_rate) if host_read_rate is not None else (None, "not measured here")
        cpu, cpu_error = _measured(lambda: measure_cpu_call_gb_s(site, 0, top_k, cache.host.layout.hidden_size,
                                                                  cache.row_bytes))
        read_how = "one token's top_k experts over the link" if error is None else error
        cpu_how = "a call of top_k / 2 experts for one token" if cpu_error is None else cpu_error
        probe = f"host-read site: {read_how}; CPU site: {cpu_how}"
        return TwoSitePlacement(read, cpu, share=share, probe=probe)
    if costs is None:
        costs = measure_costs(site, cache.host, cache.device, transport=cache.transport)
    if name != "auto":
        host_read_rate = None  # auto-split is the rule dividing calls between the CPU and the link: it stays the rule
    if host_read_rate is not None and costs.host_read_gb_s is None:
        rate, error = _measured(host_read_rate)
        costs = dataclasses.replace(  # a failed measurement: the rule still runs, as before this site existed
            costs, host_read_gb_s=rate, source=costs.source + (
                "; the host-read site on one token's top_k experts" if error is None else
                f"; the host-read site could not be measured ({error}), so it is not chosen"))
    if host_read_rate is None and costs.host_read_gb_s is not None:
        costs = dataclasses.replace(costs, host_read_gb_s=None)  # given, but the site is not possible in this engine
    if auto_chooses_host_read(costs):
        if both_sites and name == "auto":
            steps = StepChooser(min_batch=min_batch or TWO_SITE_MIN_BATCH)
            return TwoSitePlacement(costs.host_read_gb_s, costs.cpu_gb_s, steps=steps, chosen_by=costs,
                                    probe=f"as auto's costs: {costs.source}")
        return HostReadPlacement(chosen_by=costs, requested=name)
    return AutoPlacement(costs, cache.counters, resident=cache.resident, split=name == "auto-split")
