# GPU mode (issue 21): section `gpu` of the config, schema schemas/pipeline-gpu.schema.json. Defines no rule,
# only what the GPU stages (50 bench, 60 IFEval) use, so it comes before them.
# Snakemake counts GPUs (`resources: gpu=1` against `--resources gpu=N`) but does not say which one a job
# may use: every GPU job's command is prefixed with `runmap gpu-slot --` (runmap/gpuslot.py), which takes a
# free GPU of the host by lock file and sets CUDA_VISIBLE_DEVICES to it. Off (the default), nothing changes:
# no resources beyond the CPU pipeline's, no prefix.

validate(config.setdefault("gpu", {}), "../../schemas/pipeline-gpu.schema.json")

GPU = config["gpu"]
# resources of one GPU job; SLURM's executor reads mem_mb and runtime, profiles/slurm turns gpu into --gpus
GPU_RESOURCES = {"gpu": 1, "mem_mb": GPU["mem_mb"], "runtime": GPU["runtime_min"]} if GPU["enabled"] else {}


def gpu_command(cmd):
    """``cmd`` as a GPU job runs it: on its own GPU slot in GPU mode, as is otherwise."""
    if not GPU["enabled"]:
        return cmd
    return f"runmap gpu-slot --wait-s {GPU['slot_wait_s']} -- {cmd}"
