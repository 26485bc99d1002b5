# Stage: checkpoint. A Hugging Face checkpoint directory per model: synthetic (built from the seed)
# for presets with `synthetic: true`, or a local directory named in config["checkpoints"].
import yaml as _checkpoint_yaml


def checkpoint_preset(model):
    path = f"specs/models/{model}.yaml"
    if not os.path.isfile(path):
        raise ValueError(f"pipeline config: model {model!r} has no preset {path}")
    with open(path) as fh:
        return _checkpoint_yaml.safe_load(fh)


def _checkpoint_check_models():
    for model in config["models"]:
        if not checkpoint_preset(model)["synthetic"] and model not in config["checkpoints"]:
            raise ValueError(
                f"pipeline config: {model!r} is a real model; give its local checkpoint directory in "
                f"checkpoints: {{{model}: /path/to/hf/checkpoint}} (nothing is downloaded)"
            )


_checkpoint_check_models()


def checkpoint_dir(model):
    """The checkpoint directory the pack stage reads for `model`."""
    return config["checkpoints"].get(model, f"{RESULTS}/checkpoints/{model}")


rule synth_checkpoint:
    """Deterministic synthetic HF checkpoint (config.json + safetensors) of a synthetic preset."""
    output:
        directory(f"{RESULTS}/checkpoints/{{model}}"),
    input:
        preset="specs/models/{model}.yaml",
        code=code("cli.synth", "synth", "format", "arch", "resources", "atomic"),
    params:
        seed=config["seed"],
    log:
        f"{LOGS}/checkpoints/{{model}}.log",
    shell:
        "runmap synth --no-progress --preset {wildcards.model} --seed {params.seed} {output} > {log} 2>&1"


FINAL_OUTPUTS.extend(f"{RESULTS}/checkpoints/{m}" for m in config["models"] if m not in config["checkpoints"])
