# Horizon RunMap pipeline (docs/architecture.md#pipeline-stages). Thin on purpose: config + validation + rule includes.
#
#   snakemake -c2                                   # embedded default: specs/pipeline/default.yaml
#   snakemake -c2 --config block_size=128           # override a parameter; only dependents rerun
#   snakemake -c2 --configfile specs/pipeline/X.yaml
#
# Extension convention (later stages):
#   * add workflow/rules/NN-<stage>.smk; files are included in numeric order (10 checkpoint,
#     20 pack, 30..80 later stages, 90 conformance, >90 things that read the conformance summary);
#   * outputs go to results/<stage>/<wildcards...>, logs to results/logs/<stage>/<wildcards...>.log,
#     every rule has `log:`; directory outputs use directory();
#   * append the stage's final outputs (a list of concrete paths) to FINAL_OUTPUTS. The conformance
#     rule (90) depends on everything appended before it and validates it with `runmap validate`;
#     `rule all` requests everything in FINAL_OUTPUTS, including what files > 90 append;
#   * list the runmap code a rule runs as inputs, `code=code("cli.pack", "format", "arch")` (a module or a
#     whole subpackage, names relative to `runmap`; `kernels` is runmap.kernels), so that editing it reruns
#     that rule and what depends on it (Snakemake only tracks the rule's own code);
#   * rule files share one namespace: prefix every module-level name with the stage (BENCH_SPEC,
#     ifeval_dir()) and keep loop variables inside functions.
#   * a stage's config lives in its own top-level section (`bench: {...}`), validated at the top of its
#     rule file: validate(config.setdefault("bench", {}), "../../schemas/pipeline-bench.schema.json")
#     (paths in validate() are relative to the .smk file); defaults belong in that schema.
import glob
import importlib.util
import os
from pathlib import Path

from snakemake.utils import validate


configfile: "specs/pipeline/default.yaml"


validate(config, "schemas/pipeline-config.schema.json")

RESULTS = "results"
LOGS = f"{RESULTS}/logs"
FINAL_OUTPUTS = []


def code(*names):
    """Source files of runmap modules or subpackages (names relative to ``runmap``: "cli.pack", "format",
    "kernels") as rule inputs, wherever the package is installed (editable or not)."""
    files = []
    for name in names:
        spec = importlib.util.find_spec(f"runmap.{name}")
        if spec is None:
            raise ValueError(f"Snakefile code(): no module runmap.{name}")
        if spec.submodule_search_locations:  # a package: every module in it
            for d in spec.submodule_search_locations:
                files += sorted(str(f) for f in Path(d).glob("*.py"))
        else:
            files.append(str(spec.origin))
    return files


# Model names contain dots and dashes; block sizes are integers.
wildcard_constraints:
    model=r"[a-z0-9][a-z0-9._-]*",
    block=r"\d+",


for _rules in sorted(glob.glob(os.path.join(workflow.basedir, "workflow", "rules", "[0-9][0-9]-*.smk"))):
    include: _rules


_bad = [p for p in FINAL_OUTPUTS if not isinstance(p, str) or "{" in p]
if _bad:
    raise ValueError(f"FINAL_OUTPUTS must hold concrete paths (no wildcards); got {_bad}")


rule all:
    default_target: True
    input:
        FINAL_OUTPUTS,
