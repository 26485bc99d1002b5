"""The benchmark's baseline paths: what a bench record names as its executor when the engine's INT4
executors are not what ran. Together with ``runmap.kernels.registry.EXECUTORS`` they are every executor
name a record may carry (``schemas/bench-record.schema.json``)."""
from runmap.kernels.registry import EXECUTOR_NAMES

BASELINE_EXECUTORS: dict[str, str] = {
    "hf-bf16": "transformers' own model in bf16 (the checkpoint the pack came from), eager, its dynamic KV cache",
    "hf-bf16-compile": "transformers' own model in bf16 with a static KV cache and its decode step under "
                       "torch.compile (mode reduce-overhead: CUDA graphs on CUDA)",
    "torch-fp16": "the engine with FP16 experts computed by torch (no qpack, no cache)",
}
# record kind -> the executor its records name (engine records name an INT4 executor)
BASELINE_KINDS: dict[str, str] = {"hf-bf16": "hf-bf16", "hf-bf16-compile": "hf-bf16-compile",
                                  "engine-fp16": "torch-fp16"}
# the kinds that run transformers' model (no expert cache, its own router); kind -> HFBaseline mode
HF_KINDS: dict[str, str] = {"hf-bf16": "eager", "hf-bf16-compile": "static-compile"}
RECORD_EXECUTORS: tuple[str, ...] = EXECUTOR_NAMES + tuple(BASELINE_EXECUTORS)
