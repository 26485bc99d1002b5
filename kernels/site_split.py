"""The two-site split on the device: which of a decode step's absent experts of one layer the CPU site computes,
decided inside the captured step so that the device part never waits for the host
(runmap.engine.engine.SegmentDecoder, placement two-site; docs/engine.md, "Two sites in one step").

The rule (the host applies the same one to the ids it reads back, ``runmap.engine.placement.TwoSitePlacement.split``):
an expert is absent when the step routes it and the generation's host-read table maps it to a host row (entry >= R);
of the n absent experts the CPU site takes c = (n * share + SHARE_ONE / 2) // SHARE_ONE in integers, those with the
fewest routed pairs, the lower id first among equals. The kernel writes the device part's row table, the generation's
table with each CPU-site expert pointed at the lowest resident row (a complete published expert the step's request
pins; its gate weight is zeroed), and the keep mask of the step's (token, slot) pairs (0 where the CPU site computes
the pair's expert).

One program: E <= 256 experts and B x k <= 1,024 pairs, a few (E, E) and (E, B k) comparisons. The kernel also writes
c, so that the one-graph step (below) knows on the device whether the layer waits for the host.

``add_site_sum`` is the one-graph two-site step's join (``SegmentDecoder`` with ``one_graph``): after a layer's device
part it adds the CPU site's FP32 sum, read from pinned host memory mapped into the device's address space, once the
host has published it by writing the step's sequence number into the layer's flag (host memory too). A layer whose
split gave the CPU nothing (c = 0) does not wait at all, so the whole step is one CUDA graph and the host joins only
the layers that need it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runmap.kernels import common

# the share's fixed-point unit: share 0.5 is 512 (integers, so that the device and the host round alike)
SHARE_ONE = 1024


@triton.jit
def _two_site_split_kernel(ids_ptr, table_ptr, share_ptr, out_ptr, count_ptr, E, BK, R,
                           x_ptr, gw_ptr, h_ids_ptr, h_x_ptr, h_gw_ptr, h_keep_ptr, h_count_ptr, BH,
                           E_P2: tl.constexpr, BK_P2: tl.constexpr, SHARE_ONE: tl.constexpr,
                           WRITE_COUNT: tl.constexpr, HANDOFF: tl.constexpr, BLOCK_X: tl.constexpr,
                           X_BLOCKS: tl.constexpr):
    offs_e = tl.arange(0, E_P2)
    offs_j = tl.arange(0, BK_P2)
    e_ok = offs_e < E
    ids64 = tl.load(ids_ptr + offs_j, mask=offs_j < BK, other=-1)  # (BK_P2,) int64
    ids = ids64.to(tl.int32)  # -1 past the pairs
    table = tl.load(table_ptr + offs_e, mask=e_ok, other=0)  # (E_P2,) int32: a device row < R, or R + e
    routes = ids[None, :] == offs_e[:, None]  # (E_P2, BK_P2): pair j routes expert e
    pairs = tl.sum(routes.to(tl.int32), axis=1)  # (E_P2,) routed pairs per expert
    absent = (pairs > 0) & (table >= R) & e_ok
    n = tl.sum(absent.to(tl.int32), axis=0)
    c = (n * tl.load(share_ptr) + SHARE_ONE // 2) // SHARE_ONE  # experts the CPU site takes
    key = pairs * E_P2 + offs_e  # (E_P2,) distinct: fewest pairs first, then the lower id
    key_absent = tl.where(absent, key, 2147483647)
    rank = tl.sum((key_absent[None, :] < key[:, None]).to(tl.int32), axis=1)  # (E_P2,) absent experts before e
    on_cpu = absent & (rank < c)
    if WRITE_COUNT:
        tl.store(count_ptr, tl.minimum(c, n))  # (c <= n for any share <= SHARE_ONE; the min keeps it so for any)
    pinned = tl.min(tl.where((table < R) & e_ok, table, 2147483647), axis=0)  # the lowest resident row
    tl.store(out_ptr + offs_e, tl.where(on_cpu, pinned, table), mask=e_ok)
    pair_on_cpu = tl.sum((routes & on_cpu[:, None]).to(tl.int32), axis=0)  # (BK_P2,) 1 where the CPU has the pair
    tl.store(out_ptr + E + offs_j, 1 - pair_on_cpu, mask=offs_j < BK)
    if HANDOFF:  # the host's inputs straight into its pinned memory (mapped): no copy after this kernel
        tl.store(h_ids_ptr + offs_j, ids64, mask=offs_j < BK)
        tl.store(h_gw_ptr + offs_j, tl.load(gw_ptr + offs_j, mask=offs_j < BK, other=0.0), mask=offs_j < BK)
        tl.store(h_keep_ptr + offs_j, 1 - pair_on_cpu, mask=offs_j < BK)
        # (one program stores the input block after block, each store waiting for its load; a grid of programs, one
        # block each, is the change to try if the handoff's A/B shows this kernel on the chain's path. A constexpr
        # count: the interpreter's range refuses a runtime bound here)
        for i in range(0, X_BLOCKS):
            offs_x = i * BLOCK_X + tl.arange(0, BLOCK_X)
            tl.store(h_x_ptr + offs_x, tl.load(x_ptr + offs_x, mask=offs_x < BH, other=0.0), mask=offs_x < BH)
        tl.store(h_count_ptr, tl.minimum(c, n))


def two_site_split(ids: torch.Tensor, table: torch.Tensor, share: torch.Tensor, resident_rows: int,
                   out: torch.Tensor, count: torch.Tensor | None = None, handoff: tuple | None = None) -> torch.Tensor:
    """Write one layer's two-site split into ``out`` (module docstring), one launch (capturable: no value is read
    back). With ``handoff`` the same launch also writes what the host reads for the layer's CPU part into the host's
    pinned memory, mapped into the device's address space, instead of five copies after it (the one-graph step's
    handoff "mapped"; the host reads them once an event recorded after this launch completed: a kernel's stores to
    mapped host memory are visible to the host when the kernel has completed).

    Args:
        ids: int64 (B, k) contiguous, the step's routed ids of the layer (ids outside [0, E) route nothing here: the
            executor gives their rows NaN and the host's note of the step raises on them).
        table: int32 (E,) contiguous, the generation's host-read row table (entry < resident_rows: a device row;
            resident_rows + e: host row e), at least one device row among its entries.
        share: int32 (1,), the CPU site's share in units of SHARE_ONE (0..SHARE_ONE).
        resident_rows: R, the rows of the layer's device storage.
        out: int32 (E + B k,) contiguous: the device part's row table (E,), then the keep mask of the pairs (B k,)
            in ids' order (1: the device computes the pair, 0: the CPU site does).
        count: int32 (1,) or None: where to write c, the number of experts given to the CPU site.
        handoff: None, or (x, gw, host_ids, host_x, host_gw, host_keep, host_count): the layer's input x fp16 (B, H)
            and gate weights gw fp32 (B, k), both contiguous on the device, and where their copies go with the ids,
            the keep mask and c: host_ids int64 (B, k), host_x fp16 (B, H), host_gw fp32 (B, k), host_keep int32
            (B k,), host_count int32 (1,), each contiguous, on a GPU pinned host memory viewed as device tensors
            (``runmap.residency.transport.mapped_tensor``).
    Returns:
        ``out``.
    """
    common.check_tensor("ids", ids, dtype=torch.int64, ndim=2)
    dev = ids.device
    common.check_tensor("table", table, dtype=torch.int32, ndim=1, device=dev)
    bk, E = ids.numel(), table.numel()
    common.check_tensor("share", share, dtype=torch.int32, shape=(1,), device=dev)
    common.check_tensor("out", out, dtype=torch.int32, shape=(E + bk,), device=dev)
    if count is not None:
        common.check_tensor("count", count, dtype=torch.int32, shape=(1,), device=dev)
    if not (1 <= E <= 256 and 1 <= bk <= 1024 and resident_rows >= 1):
        raise common.KernelInputError(f"two_site_split: needs 1 <= E ({E}) <= 256, 1 <= B k ({bk}) <= 1024 and "
                                      f"resident_rows ({resident_rows}) >= 1")
    if handoff is None:
        x = gw = h_ids = h_x = h_gw = h_keep = h_count = out  # (unused: HANDOFF off)
        bh = 0
    else:
        x, gw, h_ids, h_x, h_gw, h_keep, h_count = handoff
        B, k = ids.shape
        common.check_tensor("x", x, dtype=torch.float16, ndim=2, device=dev)
        common.check_tensor("gw", gw, dtype=torch.float32, shape=(B, k), device=dev)
        common.check_tensor("host_ids", h_ids, dtype=torch.int64, shape=(B, k), device=dev)
        common.check_tensor("host_x", h_x, dtype=torch.float16, shape=tuple(x.shape), device=dev)
        common.check_tensor("host_gw", h_gw, dtype=torch.float32, shape=(B, k), device=dev)
        common.check_tensor("host_keep", h_keep, dtype=torch.int32, shape=(bk,), device=dev)
        common.check_tensor("host_count", h_count, dtype=torch.int32, shape=(1,), device=dev)
        if x.shape[0] != B:
            raise common.KernelInputError(f"two_site_split: x has {x.shape[0]} rows, ids {B}")
        bh = x.numel()
    common.launch(_two_site_split_kernel[(1,)], ids, table, share, out, out if count is None else count, E, bk,
                  resident_rows, x, gw, h_ids, h_x, h_gw, h_keep, h_count, bh,
                  E_P2=triton.next_power_of_2(E), BK_P2=triton.next_power_of_2(bk), SHARE_ONE=SHARE_ONE,
                  WRITE_COUNT=count is not None, HANDOFF=handoff is not None, BLOCK_X=1024,
                  X_BLOCKS=triton.cdiv(bh, 1024))
    return out


# spins of the join's wait before it gives up (each one load of host memory over the link, ~1 us): a few seconds, far
# past any CPU part, so that a host that never publishes (a bug, a crash mid-step) ends the step with an error flag
# instead of hanging the device
MAX_SPINS = 1 << 22


@triton.jit
def _add_site_sum_kernel(part_ptr, sum_ptr, count_ptr, flag_ptr, seq_ptr, err_ptr, y_ptr, N, max_spins,
                         BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    y = tl.load(part_ptr + offs, mask=inside, other=0.0).to(tl.float32)  # (BLOCK,) the device part's output
    if tl.load(count_ptr) > 0:  # the CPU site has experts of this layer: wait for the host's sum
        seq = tl.load(seq_ptr)
        flag = tl.load(flag_ptr, volatile=True)
        spins = 0
        while (flag != seq) & (spins < max_spins):
            flag = tl.load(flag_ptr, volatile=True)
            spins += 1
        # (the sum's loads come after the loop in program order and behind its branch, and are volatile: issued only
        # once the flag was seen, never served from a stale cache line; no acquire fence is emitted)
        if flag == seq:
            y += tl.load(sum_ptr + offs, mask=inside, other=0.0, volatile=True)
        else:  # gave up: the output is NaN, never a sum quietly left out, and the host raises at its next check
            y += float("nan")
            tl.store(err_ptr, 1)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)


def add_site_sum(part: torch.Tensor, site_sum: torch.Tensor, count: torch.Tensor, flag: torch.Tensor,
                 seq: torch.Tensor, err: torch.Tensor, out: torch.Tensor | None = None,
                 max_spins: int = MAX_SPINS) -> torch.Tensor:
    """out = part + site_sum where count > 0 (after waiting until flag == seq), else part (module docstring); NaN where
    the wait gave up. One launch, capturable (no value is read back).

    Args:
        part: fp16 (B, H) contiguous, the layer's device part.
        site_sum: fp32 (B, H) contiguous, the CPU site's sum: on a GPU pinned host memory viewed as a device tensor
            (``runmap.residency.transport.mapped_tensor``), written by the host before it publishes.
        count: int32 (1,), the experts the split gave the CPU site (``two_site_split``'s count).
        flag: int32 (1,), the layer's publication flag, host memory viewed as a device tensor on a GPU.
        seq: int32 (1,), this step's sequence number (the host writes it into ``flag`` once ``site_sum`` is whole).
        err: int32 (1,): set to 1 when the wait gave up after ``max_spins`` loads; the output is then NaN, and the
            engine raises when it next checks (the next step of that decoder, or the run's end).
        out: fp16 (B, H) or None (allocated).
    Returns:
        ``out`` fp16 (B, H).
    """
    common.check_tensor("part", part, dtype=torch.float16, ndim=2)
    dev = part.device
    common.check_tensor("site_sum", site_sum, dtype=torch.float32, shape=tuple(part.shape), device=dev)
    for name, t in (("count", count), ("flag", flag), ("seq", seq), ("err", err)):
        common.check_tensor(name, t, dtype=torch.int32, shape=(1,), device=dev)
    if out is None:
        out = common.empty(part.shape, torch.float16, dev)
    common.check_tensor("out", out, dtype=torch.float16, shape=tuple(part.shape), device=dev)
    if max_spins < 1:
        raise common.KernelInputError(f"add_site_sum: max_spins ({max_spins}) must be at least 1")
    n = part.numel()
    block = min(2048, triton.next_power_of_2(n))
    common.launch(_add_site_sum_kernel[(triton.cdiv(n, block),)], part, site_sum, count, flag, seq, err, out, n,
                  max_spins, BLOCK=block)
    return out
