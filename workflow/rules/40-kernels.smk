# Stage: kernel checks. Every W4A16 executor (reference, scalar, grouped, topk-fused) against the FP32
# reference on the CPU through Triton's interpreter, tiny expert shapes (docs/architecture.md#executors; record schema
# schemas/kernel-check.schema.json). Independent of the packs: the check builds its own random experts.
# The kernels' source files are inputs, so editing a kernel reruns this stage (and only it).
# The H200 record (full OLMoE / Qwen shapes) is committed as results/kernels/h200.json, not produced here.
# Config section `kernels` (schemas/pipeline-kernels.schema.json): the token counts M of each case.
validate(config.setdefault("kernels", {}), "../../schemas/pipeline-kernels.schema.json")

KERNEL_CHECK = f"{RESULTS}/kernels/cpu.json"


rule check_kernels:
    output:
        KERNEL_CHECK,
    input:
        code=code("cli.check_kernels", "kernels", "format.qpack", "atomic", "provenance"),
    params:
        m=",".join(str(m) for m in config["kernels"]["m"]),
    log:
        f"{LOGS}/kernels/cpu.log",
    shell:
        "runmap check-kernels --no-progress --device cpu --shapes tiny --m {params.m} --out {output} > {log} 2>&1"


FINAL_OUTPUTS.append(KERNEL_CHECK)
