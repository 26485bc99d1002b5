# Stage: pack. INT4 qpack of the routed experts + FP16 non-routed tensors + manifest.json
# (docs/architecture.md#the-qpack-format).
# The block size is part of the output path, so changing it makes a new pack and leaves the checkpoint alone.


def pack_dir(model, block=None):
    return f"{RESULTS}/packs/{model}-b{block or config['block_size']}"


rule pack:
    output:
        directory(f"{RESULTS}/packs/{{model}}-b{{block}}"),
    input:
        checkpoint=lambda wc: checkpoint_dir(wc.model),
        code=code("cli.pack", "format", "arch", "conformance", "resources", "atomic"),
    params:
        extra=config["pack_args"],
    log:
        f"{LOGS}/packs/{{model}}-b{{block}}.log",
    shell:
        "runmap pack --no-progress {input.checkpoint} {output} --block-size {wildcards.block} {params.extra} > {log} 2>&1"


FINAL_OUTPUTS.extend(pack_dir(m) for m in config["models"])
