# Stage: contract. The Hypothesis property run of the expert cache (resident-qpacked-cache-v1, docs/cache-contract.md)
# on the CPU, with the mutation check; report schema: schemas/contract-report.schema.json.
# The cache's source files are inputs, so editing the cache or its model reruns this stage (and only it).
# Independent of the packs: the model builds its own tiny host sources.
validate(config.setdefault("contract", {}), "../../schemas/pipeline-contract.schema.json")

CONTRACT_REPORT = f"{RESULTS}/contract/report.json"


rule contract:
    output:
        CONTRACT_REPORT,
    input:
        code=code("cli.contract", "residency", "format.qpack", "atomic", "provenance"),
    params:
        examples=config["contract"]["examples"],
        steps=config["contract"]["steps"],
        seed=config["contract"]["seed"],
        mutant_examples=config["contract"]["mutant_examples"],
    log:
        f"{LOGS}/contract/report.log",
    shell:
        "runmap contract --no-progress --device cpu --examples {params.examples} --steps {params.steps} "
        "--seed {params.seed} --mutant-examples {params.mutant_examples} --out {output} > {log} 2>&1"


FINAL_OUTPUTS.append(CONTRACT_REPORT)
