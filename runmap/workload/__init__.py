"""Routing workloads: which experts each MoE layer is asked for, step after step.

``routing``     the names a run can choose (``model``, ``calibrated:<family>``, ``trace:FILE``) and the
                workload objects the engine draws imposed routes from
``calibration`` the seeded stochastic routing model per family, its published targets and fitted parameters
``trace``       route traces: what every layer routed at every step, written and read (schema-validated)
``replay``      cache hit rates of a route sequence under LRU, LFU-decay and Belady's optimum
"""
