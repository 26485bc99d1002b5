# Stage: bench (docs/architecture.md#pipeline-stages, issue 6).
# Runs the campaign the pipeline config names (`campaign:`, default
# specs/campaigns/default.yaml) on the packs this pipeline built: every campaign model's preset must be
# one of the pipeline's `models`; its pack (and checkpoint, for the transformers baseline) come from the
# pack / checkpoint stages, overriding the paths written in the spec.
# Outputs: results/campaigns/<name>/records/*.json (schemas/bench-record.schema.json) and
# results/campaigns/<name>/campaign.json (schemas/bench-campaign.schema.json).
# Snakemake deletes a job's outputs before it runs, so the rule passes --overwrite for its own output; a
# campaign directory holding a README.md is committed evidence and is refused at parse time unless the
# config sets `bench: {overwrite_evidence: true}` (schemas/pipeline-bench.schema.json).
import json as _bench_json
import os as _bench_os

import yaml as _bench_yaml

validate(config.setdefault("bench", {}), "../../schemas/pipeline-bench.schema.json")

BENCH_SPEC = config.get("campaign", "specs/campaigns/default.yaml")


def _bench_campaign_presets():
    """campaign model name -> preset, each preset one the pipeline packs."""
    with open(BENCH_SPEC) as fh:
        spec = _bench_yaml.safe_load(fh)
    presets = {name: m["preset"] for name, m in spec["models"].items()}
    for name, preset in presets.items():
        if preset not in config["models"]:
            fits = _bench_specs_for(config["models"])
            hint = (f"; campaigns of those models: {', '.join('campaign=' + f for f in fits)}" if fits
                    else "; write a campaign spec of those models and pass it as campaign=SPEC")
            raise ValueError(f"pipeline config: campaign {BENCH_SPEC} model {name!r} uses preset {preset!r}, "
                             f"which is not in models {config['models']} (the pipeline packs only those){hint}")
    return spec["name"], presets


def _bench_specs_for(models):
    """The campaign specs under specs/campaigns/ whose every model's preset is in ``models`` and whose results folder
    holds no committed evidence (a run would not be refused), for the error above."""
    found = []
    for path in sorted(_bench_os.listdir("specs/campaigns")):
        if not path.endswith(".yaml"):
            continue
        with open(_bench_os.path.join("specs/campaigns", path)) as fh:
            spec = _bench_yaml.safe_load(fh)
        evidence = _bench_os.path.join(RESULTS, "campaigns", spec["name"], "README.md")
        if all(m["preset"] in models for m in spec["models"].values()) and not _bench_os.path.exists(evidence):
            found.append(f"specs/campaigns/{path}")
    return found


BENCH_CAMPAIGN, BENCH_PRESETS = _bench_campaign_presets()
BENCH_DIR = f"{RESULTS}/campaigns/{BENCH_CAMPAIGN}"


def _bench_refuse_evidence():
    """A campaign directory with a README.md holds committed evidence: the run would replace its records."""
    readme = _bench_os.path.join(BENCH_DIR, "README.md")
    if _bench_os.path.exists(readme) and not config["bench"]["overwrite_evidence"]:
        raise ValueError(f"pipeline config: the bench stage would overwrite the committed evidence in {BENCH_DIR} "
                         f"(it holds {readme}); choose another campaign, or set bench: {{overwrite_evidence: true}} "
                         "(config key bench.overwrite_evidence) to replace it")


_bench_refuse_evidence()


def _bench_overrides():
    args = []
    for name, preset in sorted(BENCH_PRESETS.items()):
        args += [f"--pack {name}={pack_dir(preset)}", f"--checkpoint {name}={checkpoint_dir(preset)}"]
    return " ".join(args)


BENCH_CODE = code("cli.bench", "bench", "engine", "residency", "kernels", "format", "arch", "conformance")

if not GPU["enabled"]:

    rule bench:
        """One JSON record per campaign configuration (progress bar in the log)."""
        output:
            summary=f"{BENCH_DIR}/campaign.json",
            records=directory(f"{BENCH_DIR}/records"),
        input:
            spec=BENCH_SPEC,
            packs=sorted({pack_dir(p) for p in BENCH_PRESETS.values()}),
            checkpoints=sorted({checkpoint_dir(p) for p in BENCH_PRESETS.values()}),
            code=BENCH_CODE,
        params:
            overrides=_bench_overrides(),
            out=f"{RESULTS}/campaigns",
        log:
            f"{LOGS}/campaigns/{BENCH_CAMPAIGN}.log",
        shell:
            "runmap bench {input.spec} --out {params.out} --overwrite {params.overrides} > {log} 2>&1"

else:
    # GPU mode (05-gpu.smk): one gpu=1 job per campaign group, each writing its own campaign folder under
    # results/bench-parts/<campaign>/<group>/, then `bench` joins them (runmap bench --aggregate). A group's
    # job depends on its own definition (a parameter: editing one group reruns that job only), its models'
    # packs and the code; a failed group is rerun alone on the next invocation.
    BENCH_PARTS = f"{RESULTS}/bench-parts/{BENCH_CAMPAIGN}"

    def _bench_groups():
        with open(BENCH_SPEC) as fh:
            spec = _bench_yaml.safe_load(fh)
        shared = {k: spec.get(k) for k in ("name", "device", "defaults")}
        return {g["name"]: {"group": g, "models": {m: spec["models"][m] for m in g["models"]}, **shared}
                for g in spec["groups"]}

    BENCH_GROUPS = _bench_groups()

    rule bench_group:
        """The configurations of one campaign group, on one GPU slot."""
        output:
            directory(f"{BENCH_PARTS}/{{group}}"),
        input:
            packs=lambda wc: sorted({pack_dir(BENCH_PRESETS[m]) for m in BENCH_GROUPS[wc.group]["models"]}),
            checkpoints=lambda wc: sorted({checkpoint_dir(BENCH_PRESETS[m]) for m in BENCH_GROUPS[wc.group]["models"]}),
            code=BENCH_CODE,
        params:
            spec=BENCH_SPEC,
            definition=lambda wc: _bench_json.dumps(BENCH_GROUPS[wc.group], sort_keys=True),
            overrides=_bench_overrides(),
        resources:
            **GPU_RESOURCES,
        wildcard_constraints:
            group=r"[^/]+",
        log:
            f"{LOGS}/campaigns/{BENCH_CAMPAIGN}/{{group}}.log",
        shell:
            gpu_command("runmap bench {params.spec} --group {wildcards.group} --out {output} --overwrite --no-progress "
                        "{params.overrides}") + " > {log} 2>&1"

    rule bench:
        """campaign.json and records/ of the whole campaign from the groups' records (no GPU)."""
        output:
            summary=f"{BENCH_DIR}/campaign.json",
            records=directory(f"{BENCH_DIR}/records"),
        input:
            spec=BENCH_SPEC,
            parts=[f"{BENCH_PARTS}/{g}" for g in BENCH_GROUPS],
            code=BENCH_CODE,
        params:
            overrides=_bench_overrides(),
            out=f"{RESULTS}/campaigns",
        log:
            f"{LOGS}/campaigns/{BENCH_CAMPAIGN}.log",
        shell:
            "runmap bench {input.spec} --aggregate {input.parts} --out {params.out} --overwrite {params.overrides} "
            "> {log} 2>&1"


FINAL_OUTPUTS.extend([f"{BENCH_DIR}/campaign.json", f"{BENCH_DIR}/records"])
