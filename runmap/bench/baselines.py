"""Baseline: transformers' own model of the family (the adapter's ``hf_architecture``) in bfloat16, timed like the engine.

It duck-types the engine surface the campaign runner uses: ``generate(prompts, max_new_tokens)``,
``last_timing`` and ``telemetry()``. Greedy decoding with transformers' KV cache, one forward per step;
the first token comes from the prefill forward (time to first token = prefill time), the remaining
``max_new_tokens - 1`` from decode steps (decode tok/s = batch x (max_new_tokens - 1) / decode time).

Two modes (the record's ``config.hf_mode``):
  eager           transformers' dynamic KV cache, every forward eager (the original baseline).
  static-compile  transformers' StaticCache sized once for the engine's max_seq_len, the prefill eager
                  (its shape changes with every prompt length) and the decode step, whose shapes never
                  change, through torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False):
                  inductor kernels replayed as CUDA graphs on CUDA. This is the split transformers' own
                  ``generate(cache_implementation="static")`` makes (compiled decode, eager prefill), done
                  here by hand so that prefill and decode are timed apart. On non-CPU devices the decode
                  step also uses transformers' 'batched_mm' experts implementation where the model defaults
                  to 'grouped_mm', as its generate does for decoding. Compilation happens in the first call
                  of each batch size (the bench's warmup): ``compile_s`` records that call's wall time and
                  ``compiled_graphs`` how many graphs dynamo built; a model that cannot be compiled raises
                  BaselineUnavailable, never a silent eager run under the compiled label.

Weights: the model's HF checkpoint directory when given (the same synthetic weights the pack was made
from), otherwise transformers' own random initialisation of the preset's config on the device
(``weights_source`` says which; routing statistics, hence speed, depend only weakly on the values).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from runmap.arch.config import ModelConfig


MODES = ("eager", "static-compile")


class BaselineUnavailable(RuntimeError):
    """The asked-for baseline path cannot run this model here (e.g. torch.compile fails on it)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFBaseline:
    regime = "full"

    def __init__(self, cfg: ModelConfig, device: torch.device, checkpoint: str | None = None, seed: int = 0,
                 mode: str = "eager", max_cache_len: int | None = None):
        if mode not in MODES:
            raise ValueError(f"HFBaseline mode {mode!r}: choose from {MODES}")
        if mode == "static-compile" and not max_cache_len:
            raise ValueError("HFBaseline static-compile needs max_cache_len (the static cache is sized once)")
        self.mode, self.max_cache_len = mode, max_cache_len
        self.executor = "hf-bf16" if mode == "eager" else "hf-bf16-compile"
        # the family's own transformers classes, as its adapter names them (runmap/arch/<family>.py)
        config_class, model_class = cfg.adapter.hf_config_class(), cfg.adapter.hf_model_class()
        self.cfg, self.device = cfg, torch.device(device)
        t0 = time.perf_counter()
        if checkpoint:
            if not (Path(checkpoint) / "config.json").is_file():
                raise FileNotFoundError(f"{checkpoint}: HF checkpoint directory without config.json")
            # no device_map: that path needs `accelerate`, which neither machine has
            model = model_class.from_pretrained(checkpoint, dtype=torch.bfloat16).to(self.device)
            self.weights_source = f"checkpoint {checkpoint}"
        else:
            hf = config_class(**cfg.to_hf_dict())
            torch.manual_seed(seed)
            with self.device:  # initialise directly on the device: no 14-28 GB host round trip
                # what AutoModelForCausalLM.from_config(hf, dtype=...) calls once it has picked the class
                model = model_class._from_config(hf, dtype=torch.bfloat16)
            self.weights_source = f"transformers random init (seed {seed})"
        self.model = model.eval()
        _sync(self.device)
        self.load_s = time.perf_counter() - t0
        self.last_timing: dict = {}
        self.generations = 0
        self._caches: dict[int, object] = {}  # batch -> StaticCache (static-compile): same tensors every call
        self._step = None  # the compiled decode step (static-compile)
        self.compile_s: dict[int, float] = {}  # batch -> wall s of the first call (where compilation happens)
        self.compile_info: dict = {}
        if mode == "static-compile":
            self._prepare_compile()

    def _prepare_compile(self) -> None:
        import torch._dynamo

        if not getattr(self.model, "_can_compile_fullgraph", False):
            raise BaselineUnavailable(f"{type(self.model).__name__} does not declare _can_compile_fullgraph: "
                                      "transformers does not support compiling it in one graph")
        # hitting dynamo's recompile limit would otherwise run the step eagerly, silently, under this label
        if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
            torch._dynamo.config.fail_on_recompile_limit_hit = True
        # one graph per batch size and model instance of the process; the default limit (8) is per code object
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
                break
        experts = {}
        if self.device.type != "cpu" and hasattr(self.model, "get_experts_implementation"):
            experts = self.model.get_experts_implementation()
        self._decode_experts = ({k: "batched_mm" if v == "grouped_mm" else v for k, v in experts.items()}
                                if "grouped_mm" in experts.values() else None)
        self._default_experts = experts or None
        opts = {"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}
        self._step = torch.compile(self.model.forward, **opts)
        self.compile_info = {**opts, "backend": "inductor", "cache_implementation": "static",
                             "max_cache_len": self.max_cache_len, "compiled": "decode step (prefill eager)",
                             "decode_experts_implementation": self._decode_experts or experts or None}

    def _static_cache(self, batch: int):
        from transformers import StaticCache

        cache = self._caches.get(batch)
        if cache is None:
            cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
            self._caches[batch] = cache
        else:
            cache.reset()  # zeroes the tensors in place: the compiled graphs keep their addresses
        return cache

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0) -> list[list[int]]:
        """prompts: B lists of P token ids (equal lengths) -> B lists of max_new_tokens greedy ids."""
        if temperature != 0.0:
            raise ValueError("HFBaseline is greedy only (temperature 0.0)")
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("HFBaseline needs prompts of equal length (no padding path)")
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)  # (B, P)
        b, plen = ids.shape
        if self.mode == "static-compile":
            return self._generate_static(ids, max_new_tokens)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)  # (B,)
        past = out.past_key_values
        toks = [nxt]
        _sync(self.device)
        t1 = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            out = self.model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)  # (B,)
            toks.append(nxt)
        _sync(self.device)
        t2 = time.perf_counter()
        decode_s = t2 - t1
        steps = max_new_tokens - 1
        self.last_timing = {
            "prefill_s": t1 - t0, "ttft_s": t1 - t0, "decode_s": decode_s if steps else float("nan"),
            "prompt_tokens": b * plen, "new_tokens": b * max_new_tokens,
            "decode_tok_s": b * steps / decode_s if steps else float("nan"),
        }
        self.generations += 1
        return torch.stack(toks, dim=1).tolist()  # (B, N)

    def _generate_static(self, ids: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
        import torch._dynamo

        b, plen = ids.shape
        if plen + max_new_tokens > self.max_cache_len:
            raise ValueError(f"prompt {plen} + {max_new_tokens} new tokens exceed the static cache "
                             f"({self.max_cache_len})")
        first = b not in self.compile_s
        graphs0 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        cache = self._static_cache(b)
        _sync(self.device)
        t0 = time.perf_counter()
        # only the last position's logits are needed, as transformers' generate asks for
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)  # (B,)
        toks = [nxt]
        _sync(self.device)
        t1 = time.perf_counter()
        if self._decode_experts:
            self.model.set_experts_implementation(self._decode_experts)
        try:
            for _ in range(max_new_tokens - 1):
                if self.device.type == "cuda":  # a new step: the previous replay's outputs may be overwritten
                    torch.compiler.cudagraph_mark_step_begin()
                try:
                    out = self._step(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
                except Exception as e:  # noqa: BLE001 - any compiler failure: this path does not exist here
                    raise BaselineUnavailable(f"torch.compile of the decode step failed: {type(e).__name__}: "
                                              f"{str(e).splitlines()[0] if str(e) else ''}") from e
                nxt = out.logits[:, -1].argmax(-1)  # (B,)
                toks.append(nxt)
            _sync(self.device)
        finally:
            if self._decode_experts:
                self.model.set_experts_implementation(self._default_experts)
        t2 = time.perf_counter()
        steps = max_new_tokens - 1
        if first and steps:
            self.compile_s[b] = t2 - t0
            built = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs0
            self.compile_info.setdefault("compiled_graphs", {})[str(b)] = built
            if built < 1:  # dynamo compiled nothing: the steps ran eagerly (e.g. torch.compile disabled)
                raise BaselineUnavailable("torch.compile built no graph for the decode step (it ran eagerly)")
        decode_s = t2 - t1
        self.last_timing = {
            "prefill_s": t1 - t0, "ttft_s": t1 - t0, "decode_s": decode_s if steps else float("nan"),
            "prompt_tokens": b * plen, "new_tokens": b * max_new_tokens,
            "decode_tok_s": b * steps / decode_s if steps else float("nan"),
        }
        self.generations += 1
        return torch.stack(toks, dim=1).tolist()  # (B, N)

    def telemetry(self) -> dict:
        return {"executor": self.executor, "regime": self.regime, "generations": self.generations, "observations": {}}
