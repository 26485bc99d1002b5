"""The benchmark's baseline paths: what a bench record names as its executor when the engine's INT4
executors are not what ran. Together with ``runmap.kernels.registry.EXECUTORS`` they are every executor
name a record may carry (``schemas/bench-record.schema.json``)."""
from runmap.kernels.registry import EXECUTOR_NAMES

BASELINE_EXECUTORS: dict[str, str] = {
    "hf-bf16": "transformers' own model in bf16 (the checkpoint the pack came from)",
    "torch-fp16": "the engine with FP16 experts computed by torch (no qpack, no cache)",
}
# record kind -> the executor its records name (engine records name an INT4 executor)
BASELINE_KINDS: dict[str, str] = {"hf-bf16": "hf-bf16", "engine-fp16": "torch-fp16"}
RECORD_EXECUTORS: tuple[str, ...] = EXECUTOR_NAMES + tuple(BASELINE_EXECUTORS)
