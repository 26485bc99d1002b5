"""Triton W4A16 kernels for qpacked expert rows, and their torch references.

Every executor has the same entry point (see ``runmap.kernels.executors``)::

    y = moe_experts(executor, x, topk_ids, topk_weights, storage, row_table, layout)

    x            float16 (T, H) contiguous activations
    topk_ids     int32/int64 (T, k) routed expert ids in [0, E)
    topk_weights float32 (T, k) router gate weights (already in their final form; no renormalisation here)
    storage      uint8 (R, row_bytes) contiguous: one qpacked expert row per physical row (runmap.format.qpack.RowLayout)
    row_table    int32 (E,) physical row of each expert in ``storage``; -1 where the expert is not resident.
                 Every routed id must be resident: a -1 is an error, never a substitution.
    layout       runmap.format.qpack.RowLayout
    returns      float16 (T, H) = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]
"""
