"""Baseline: transformers' own model of the family (the adapter's ``hf_architecture``) in bfloat16, timed like the engine.

It duck-types the engine surface the campaign runner uses: ``generate(prompts, max_new_tokens)``,
``last_timing`` and ``telemetry()``. Greedy decoding with transformers' KV cache, one forward per step;
the first token comes from the prefill forward (time to first token = prefill time), the remaining
``max_new_tokens - 1`` from decode steps (decode tok/s = batch x (max_new_tokens - 1) / decode time).

Weights: the model's HF checkpoint directory when given (the same synthetic weights the pack was made
from), otherwise transformers' own random initialisation of the preset's config on the device
(``weights_source`` says which; routing statistics, hence speed, depend only weakly on the values).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from runmap.arch.config import ModelConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFBaseline:
    executor = "hf-bf16"
    regime = "full"

    def __init__(self, cfg: ModelConfig, device: torch.device, checkpoint: str | None = None, seed: int = 0):
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

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0) -> list[list[int]]:
        """prompts: B lists of P token ids (equal lengths) -> B lists of max_new_tokens greedy ids."""
        if temperature != 0.0:
            raise ValueError("HFBaseline is greedy only (temperature 0.0)")
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("HFBaseline needs prompts of equal length (no padding path)")
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)  # (B, P)
        b, plen = ids.shape
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

    def telemetry(self) -> dict:
        return {"executor": self.executor, "regime": self.regime, "generations": self.generations, "observations": {}}
