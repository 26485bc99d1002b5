# Stage: conformance. Validates every final output of the stages included before this file, plus the
# specs, against schemas/ and writes the conformance summary (schemas/conformance.schema.json).
# Fails (and keeps the log) when any artifact does not conform.

CONFORMANCE_SUMMARY = f"{RESULTS}/conformance/summary.json"
_CONFORMANCE_INPUTS = list(FINAL_OUTPUTS)


rule conformance:
    output:
        CONFORMANCE_SUMMARY,
    input:
        artifacts=_CONFORMANCE_INPUTS,
        specs=sorted(glob.glob("specs/**/*.yaml", recursive=True)),
        schemas=sorted(glob.glob("schemas/*.schema.json")),
        code=code("cli.validate", "conformance", "format", "arch", "bench.checks", "bench.registry", "kernels.registry",
                  "residency.observations", "residency.regimes", "resources", "atomic", "provenance"),
    log:
        f"{LOGS}/conformance.log",
    shell:
        "runmap validate specs {input.artifacts} --summary {output} > {log} 2>&1"


FINAL_OUTPUTS.append(CONFORMANCE_SUMMARY)
