# Stage: bench (docs/architecture.md#pipeline-stages, issue 6).
# Runs the campaign the pipeline config names (`campaign:`, default
# specs/campaigns/default.yaml) on the packs this pipeline built: every campaign model's preset must be
# one of the pipeline's `models`; its pack (and checkpoint, for the transformers baseline) come from the
# pack / checkpoint stages, overriding the paths written in the spec.
# Outputs: results/campaigns/<name>/records/*.json (schemas/bench-record.schema.json) and
# results/campaigns/<name>/campaign.json (schemas/bench-campaign.schema.json).
import yaml as _bench_yaml

CAMPAIGN_SPEC = config.get("campaign", "specs/campaigns/default.yaml")


def _bench_campaign_presets():
    """campaign model name -> preset, each preset one the pipeline packs."""
    with open(CAMPAIGN_SPEC) as fh:
        spec = _bench_yaml.safe_load(fh)
    presets = {name: m["preset"] for name, m in spec["models"].items()}
    for name, preset in presets.items():
        if preset not in config["models"]:
            raise ValueError(f"pipeline config: campaign {CAMPAIGN_SPEC} model {name!r} uses preset {preset!r}, "
                             f"which is not in models {config['models']} (the pipeline packs only those)")
    return spec["name"], presets


CAMPAIGN_NAME, BENCH_PRESETS = _bench_campaign_presets()
CAMPAIGN_DIR = f"{RESULTS}/campaigns/{CAMPAIGN_NAME}"


def _bench_overrides():
    args = []
    for name, preset in sorted(BENCH_PRESETS.items()):
        args += [f"--pack {name}={pack_dir(preset)}", f"--checkpoint {name}={checkpoint_dir(preset)}"]
    return " ".join(args)


rule bench:
    """One JSON record per campaign configuration (progress bar in the log)."""
    output:
        summary=f"{CAMPAIGN_DIR}/campaign.json",
        records=directory(f"{CAMPAIGN_DIR}/records"),
    input:
        spec=CAMPAIGN_SPEC,
        packs=sorted({pack_dir(p) for p in BENCH_PRESETS.values()}),
        checkpoints=sorted({checkpoint_dir(p) for p in BENCH_PRESETS.values()}),
        code=code("cli.bench", "bench", "engine", "residency", "kernels", "format", "arch", "conformance"),
    params:
        overrides=_bench_overrides(),
        out=f"{RESULTS}/campaigns",
    log:
        f"{LOGS}/campaigns/{CAMPAIGN_NAME}.log",
    shell:
        "runmap bench {input.spec} --out {params.out} {params.overrides} > {log} 2>&1"


FINAL_OUTPUTS.extend([f"{CAMPAIGN_DIR}/campaign.json", f"{CAMPAIGN_DIR}/records"])
