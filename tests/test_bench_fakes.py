"""(No tests here.) A fake engine and helpers shared by the bench / report / campaign-check tests.

The fake implements the engine interface the runner drives (run -> GenerationRun, stats -> EngineStats,
logits, close) with deterministic figures that depend on the configuration, so tests can assert what the
runner derives (medians, deltas over the timed runs, ratios) without running a model.
"""
from __future__ import annotations

import copy
from types import MappingProxyType

import torch

from runmap.bench import campaign as bench
from runmap.engine.generation import GenerationResult, GenerationRun
from runmap.engine.telemetry import EngineStats

OBS = ("expert_d2h_bytes", "writebacks", "host_source_rewrites", "request_hash_work", "request_pack_reads")


class FakeEngine:
    ROW_BYTES = 1000
    use_graphs = True
    routes = None  # no routes recorded: partial records say their replay is UNSUPPORTED

    @property
    def routing(self) -> str:
        return self.c.p.get("routing", "model")

    def __init__(self, c: bench.BenchConfig):
        self.c = c
        self.executor = c.executor
        self.calls = 0
        self.hits = self.misses = self.h2d = 0
        self.h2d_s = 0.0
        self.logit_calls = []
        self.route_flips = 0  # positions a non-default executor's own routing routes otherwise (logits_with_routes)
        self.corrupt_positions, self.corrupt = 0, 0.0  # an arithmetic bug of the engine's own executor
        self.closed = False
        self.report_resets = []  # runs done when the bench reset the placement's reports (reset_placement_reports)

    def decode_rate(self, batch: int) -> float:
        base = {"reference": 10.0, "scalar": 20.0, "grouped": 40.0, "topk-fused": 50.0,
                "hf-bf16": 30.0, "hf-bf16-compile": 60.0, "torch-fp16": 35.0}[self.c.executor]
        return batch * base * (1.0 + self.c.resident / self.c.experts_per_layer)

    def run(self, prompts, *, max_new_tokens, ignore_eos=False):
        assert ignore_eos, "the bench always decodes exactly max_new_tokens per row"
        b = len(prompts)
        self.calls += 1
        wobble = 1.0 + 0.1 * (self.calls % 3)  # repeats differ: median/min/max are distinguishable
        rate = self.decode_rate(b) * wobble
        decode_s = (b * (max_new_tokens - 1)) / rate
        lookups = b * max_new_tokens * 4
        miss = 0 if self.c.resident == self.c.experts_per_layer else lookups // 4
        self.hits += lookups - miss
        self.misses += miss
        self.h2d += miss * self.ROW_BYTES
        self.h2d_s += miss * 1e-6
        results = tuple(GenerationResult("", [7] * max_new_tokens, "length", len(p)) for p in prompts)
        return GenerationRun(results=results, prefill_s=0.01 * len(prompts[0]), decode_s=decode_s, ttft_s=0.02,
                             prompt_tokens=b * len(prompts[0]), new_tokens=b * max_new_tokens,
                             decode_tok_s=b * (max_new_tokens - 1) / decode_s, batch=b, groups=1)

    def logits(self, token_ids, *, executor=None, fused=None, routes=None):
        """Seeded logits; another executor rounds a little differently (+1e-4). Its own routing (``routes`` None)
        moves the first ``route_flips`` positions a lot, as a near-tie routed otherwise does; the engine's own
        executor adds ``corrupt`` to its first ``corrupt_positions`` positions (an arithmetic bug)."""
        self.logit_calls.append((executor, fused))
        g = torch.Generator().manual_seed(len(token_ids))
        out = torch.randn(len(token_ids), 50, generator=g)  # (T, V)
        if executor is not None and executor != self.executor:
            out = out + 1e-4
            if routes is None:
                out[:self.route_flips] += 3.0
        elif self.corrupt_positions:
            out[:self.corrupt_positions] += self.corrupt
        return out

    def logits_with_routes(self, token_ids, *, executor=None, fused=None):
        """The fake routes every position alike under every executor, unless ``route_flips`` positions (the first
        ones) are routed differently by a non-default executor's own routing."""
        out = self.logits(token_ids, executor=executor, fused=fused)
        routes = torch.arange(4).repeat(len(token_ids), 2, 1)  # (T, L=2, k=4)
        if executor is not None and executor != self.executor:
            routes[:self.route_flips, 1, 0] = 7
        return out, routes

    def reset_placement_reports(self) -> None:
        self.report_resets.append(self.calls)

    def stats(self) -> EngineStats:
        p = self.c.p
        return EngineStats(
            executor=self.executor, expert_format=self.c.expert_format, regime=self.c.regime, device="cpu",
            cuda_graphs=self.use_graphs, fused=(), skip_experts=bool(p.get("skip_experts")),
            resident=self.c.resident, has_cache=self.c.kind == "engine", policy="lru", hits=self.hits,
            misses=self.misses, evictions=0, bytes_h2d=self.h2d, h2d_seconds=self.h2d_s, generations=1,
            runs=self.calls, resident_bytes=self.c.resident * self.ROW_BYTES, spare_bytes=2 * self.ROW_BYTES,
            staging_bytes=self.ROW_BYTES, nonrouted_bytes=0, kv_cache_bytes=0,
            observations=MappingProxyType(
                {n: {"status": "OBSERVED", "value": 0, "unit": "bytes", "source": "fake"} for n in OBS}))

    def baseline_info(self, batch: int) -> dict:
        """What a transformers baseline reports about its path (the runner asks HF kinds only)."""
        mode = bench.HF_KINDS[self.c.kind]
        out = {"hf_mode": mode, "status": "OBSERVED"}
        if mode == "static-compile":
            out.update(compile={"mode": "reduce-overhead", "fullgraph": True}, compile_s=bench.bm.observed(1.5))
        return out

    def close(self) -> None:
        self.closed = True


def fake_factory(built: list | None = None):
    def factory(c, model_entry, device):
        if built is not None:
            built.append(c.engine_key())
        return FakeEngine(c), {"pack": model_entry.get("pack"), "checkpoint": None, "block_size": 256, "load_s": 0.0}
    return factory


def tiny_spec(**over) -> dict:
    spec = {
        "name": "t",
        "description": "test campaign",
        "device": "cpu",
        "defaults": {"repeats": 3, "warmup": 1, "warmup_new_tokens": 2},
        "models": {"m": {"preset": "tiny-olmoe", "pack": "unused"}},
        "groups": [
            {"name": "hf", "kind": "hf-bf16", "models": ["m"], "batch": [1, 2], "prompt_len": 4, "decode_len": 3},
            {"name": "fp16", "kind": "engine-fp16", "models": ["m"], "batch": [1, 2], "prompt_len": 4, "decode_len": 3},
            {"name": "res", "kind": "engine", "models": ["m"], "resident": [4, 6, "full"], "executors": ["grouped"],
             "batch": [1, 2], "prompt_len": 4, "decode_len": 3},
        ],
    }
    spec.update(over)
    return spec


def run_fake(tmp_path, spec=None, **kw) -> tuple[dict, list[dict]]:
    spec = spec or tiny_spec()
    summary = bench.run_campaign(spec, tmp_path, engine_factory=fake_factory(), command="pytest", progress=False,
                                 measure_bandwidth=kw.pop("measure_bandwidth", False), **kw)
    return summary, bench.load_records(tmp_path / spec["name"])


def as_gpu(rec: dict, alloc_gib: float) -> dict:
    """A copy of a CPU record made to look like a CUDA run with an observed peak."""
    r = copy.deepcopy(rec)
    r["device"] = {"type": "cuda", "name": "Fake GPU"}
    v = int(alloc_gib * 1024**3)
    r["memory"]["peak_allocated_bytes"] = {"status": "OBSERVED", "value": v}
    r["memory"]["peak_reserved_bytes"] = {"status": "OBSERVED", "value": v + 1024**3}
    return r
