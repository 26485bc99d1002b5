# Stage: IFEval (docs/architecture.md#pipeline-stages: pack -> ... -> IFEval generate -> IFEval score -> conformance).
# Per model: the first `limit` prompts of the inputs -> greedy answers from the packed model (runmap ifeval
# generate, sidecar with model / pack / executor / regime / settings / timing) -> strict and loose scores
# (runmap ifeval score). Section `ifeval` of the config, schema schemas/ifeval-pipeline.schema.json.
# The embedded default answers 16 prompts with 32 new tokens on the tiny model with the `reference` executor
# (the Triton executors run in Triton's interpreter on a CPU, far too slowly for the default run);
# a GPU config sets executor: grouped, limit: 541, max_new_tokens: 1280.
# Snakemake deletes a job's outputs before it runs, so inside the pipeline every run generates afresh;
# resuming an interrupted long run is a property of `runmap ifeval generate` itself (see README / --help).
from runmap.resources import data_dir as _ifeval_data_dir

validate(config.setdefault("ifeval", {}), "../../schemas/ifeval-pipeline.schema.json")

IFEVAL = config["ifeval"]
# Inputs default to the prompts vendored with the installed package (absolute: the workflow may run in a
# scratch directory that holds no data/).
IFEVAL_INPUTS = IFEVAL["inputs"] or str(_ifeval_data_dir() / "ifeval" / "input_data.jsonl")
IFEVAL_MODELS = (IFEVAL["models"] or config["models"][:1]) if IFEVAL["enabled"] else []
_ifeval_unknown = [m for m in IFEVAL_MODELS if m not in config["models"]]
if _ifeval_unknown:
    raise ValueError(f"pipeline config: ifeval.models names {_ifeval_unknown[0]!r}, which is not in models "
                     f"{config['models']}")


def ifeval_dir(model, block=None):
    return f"{RESULTS}/ifeval/{model}-b{block or config['block_size']}"


def _ifeval_generate_options():
    opts = [
        f"--max-new-tokens {IFEVAL['max_new_tokens']}",
        f"--batch-size {IFEVAL['batch_size']}",
        f"--executor {IFEVAL['executor']}",
    ]
    if IFEVAL["resident"] is not None:
        opts.append(f"--resident {IFEVAL['resident']}")
    if IFEVAL["device"]:
        opts.append(f"--device {IFEVAL['device']}")
    if IFEVAL["extra_args"]:
        opts.append(IFEVAL["extra_args"])
    return " ".join(opts)


rule ifeval_inputs:
    """The first `limit` prompts: generation and scoring both read exactly this file."""
    output:
        f"{RESULTS}/ifeval/{{model}}-b{{block}}/inputs.jsonl",
    input:
        IFEVAL_INPUTS,
    params:
        limit=IFEVAL["limit"],
    log:
        f"{LOGS}/ifeval/{{model}}-b{{block}}-inputs.log",
    shell:
        "(head -n {params.limit} {input:q} > {output:q}.tmp && mv {output:q}.tmp {output:q}) > {log} 2>&1"


IFEVAL_CODE = code("cli.ifeval", "ifeval", "engine", "residency", "kernels", "format", "arch")
IFEVAL_SHARDS = IFEVAL["shards"]

if IFEVAL_SHARDS == 1:

    rule ifeval_generate:
        output:
            answers=f"{RESULTS}/ifeval/{{model}}-b{{block}}/answers.jsonl",
            meta=f"{RESULTS}/ifeval/{{model}}-b{{block}}/answers.jsonl.meta.json",
        input:
            pack=lambda wc: pack_dir(wc.model, wc.block),
            inputs=f"{RESULTS}/ifeval/{{model}}-b{{block}}/inputs.jsonl",
            code=IFEVAL_CODE,
        params:
            opts=_ifeval_generate_options(),
        resources:
            **GPU_RESOURCES,
        log:
            f"{LOGS}/ifeval/{{model}}-b{{block}}-generate.log",
        shell:
            gpu_command("runmap ifeval generate --no-progress --packed {input.pack} --inputs {input.inputs} "
                        "--out {output.answers} --model-name {wildcards.model} {params.opts}") + " > {log} 2>&1"

else:
    # One job per shard (runmap ifeval generate --shard I/N: the prompts whose rank in key order is I-1 mod N),
    # then one merge (runmap ifeval merge: checks the N shards are one complete split of one configuration)
    # into the answers file + sidecar an unsharded run writes; scoring is unchanged. A failed shard is rerun
    # alone; greedy answers do not depend on the batch, so the merged run equals the unsharded one.

    rule ifeval_generate_shard:
        output:
            answers=f"{RESULTS}/ifeval/{{model}}-b{{block}}/shards/{{shard}}-of-{IFEVAL_SHARDS}/answers.jsonl",
            meta=f"{RESULTS}/ifeval/{{model}}-b{{block}}/shards/{{shard}}-of-{IFEVAL_SHARDS}/answers.jsonl.meta.json",
        input:
            pack=lambda wc: pack_dir(wc.model, wc.block),
            inputs=f"{RESULTS}/ifeval/{{model}}-b{{block}}/inputs.jsonl",
            code=IFEVAL_CODE,
        params:
            opts=_ifeval_generate_options(),
        resources:
            **GPU_RESOURCES,
        wildcard_constraints:
            shard=r"\d+",
        log:
            f"{LOGS}/ifeval/{{model}}-b{{block}}-generate-{{shard}}-of-{IFEVAL_SHARDS}.log",
        shell:
            gpu_command("runmap ifeval generate --no-progress --packed {input.pack} --inputs {input.inputs} "
                        "--out {output.answers} --model-name {wildcards.model} --shard {wildcards.shard}/"
                        f"{IFEVAL_SHARDS} {{params.opts}}") + " > {log} 2>&1"

    rule ifeval_merge:
        output:
            answers=f"{RESULTS}/ifeval/{{model}}-b{{block}}/answers.jsonl",
            meta=f"{RESULTS}/ifeval/{{model}}-b{{block}}/answers.jsonl.meta.json",
        input:
            shards=[f"{RESULTS}/ifeval/{{model}}-b{{block}}/shards/{i}-of-{IFEVAL_SHARDS}/answers.jsonl"
                    for i in range(1, IFEVAL_SHARDS + 1)],
            metas=[f"{RESULTS}/ifeval/{{model}}-b{{block}}/shards/{i}-of-{IFEVAL_SHARDS}/answers.jsonl.meta.json"
                   for i in range(1, IFEVAL_SHARDS + 1)],
            inputs=f"{RESULTS}/ifeval/{{model}}-b{{block}}/inputs.jsonl",
            code=code("cli.ifeval", "ifeval.shard", "ifeval.generate", "atomic"),
        log:
            f"{LOGS}/ifeval/{{model}}-b{{block}}-merge.log",
        shell:
            "runmap ifeval merge --inputs {input.inputs} --out {output.answers} {input.shards} > {log} 2>&1"


rule ifeval_score:
    output:
        results=f"{RESULTS}/ifeval/{{model}}-b{{block}}/score/results.jsonl",
        summary=f"{RESULTS}/ifeval/{{model}}-b{{block}}/score/summary.json",
    input:
        answers=f"{RESULTS}/ifeval/{{model}}-b{{block}}/answers.jsonl",
        meta=f"{RESULTS}/ifeval/{{model}}-b{{block}}/answers.jsonl.meta.json",
        inputs=f"{RESULTS}/ifeval/{{model}}-b{{block}}/inputs.jsonl",
        code=code("cli.ifeval", "ifeval.score"),
    params:
        out=lambda wc: f"{ifeval_dir(wc.model, wc.block)}/score",
    log:
        f"{LOGS}/ifeval/{{model}}-b{{block}}-score.log",
    shell:
        "runmap ifeval score --no-progress --inputs {input.inputs} --responses {input.answers} "
        "--meta {input.meta} --out {params.out} > {log} 2>&1"


FINAL_OUTPUTS.extend(f"{ifeval_dir(m)}/{name}" for m in IFEVAL_MODELS for name in (
    "inputs.jsonl", "answers.jsonl", "answers.jsonl.meta.json", "score/results.jsonl", "score/summary.json"))
