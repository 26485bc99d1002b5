"""specs/architecture.yaml: valid, complete, and unable to drift from the shared schema enumerations."""
from pathlib import Path
import copy
import json

import pytest
import yaml

from runmap.format import qpack
from runmap.conformance.schemas import ID_BASE, SchemaSet, load_schemas

REPO_ROOT = Path(__file__).resolve().parent.parent

ARCH = REPO_ROOT / "specs" / "architecture.yaml"
COMMON = REPO_ROOT / "schemas" / "common.schema.json"


@pytest.fixture(scope="module")
def arch():
    return yaml.safe_load(ARCH.read_text())


@pytest.fixture(scope="module")
def common_defs():
    return json.loads(COMMON.read_text())["$defs"]


def test_architecture_yaml_conforms(arch):
    assert load_schemas().validate_document(arch, "architecture") == []


@pytest.mark.parametrize("defname, select", [
    ("executor", lambda a: [e["id"] for e in a["executors"]]),
    ("regime", lambda a: [r["id"] for r in a["regimes"]]),
    ("observation_status", lambda a: [s["id"] for s in a["observations"]["statuses"]]),
    ("observation_name", lambda a: [o["id"] for o in a["observations"]["required_zero"]]),
    ("architecture", lambda a: a["models"]["architectures"]),
])
def test_shared_enumerations_agree_with_architecture(arch, common_defs, defname, select):
    ids = select(arch)
    assert len(ids) == len(set(ids)), f"duplicate ids in architecture.yaml for {defname}: {ids}"
    assert set(ids) == set(common_defs[defname]["enum"]), (
        f"schemas/common.schema.json $defs/{defname} and specs/architecture.yaml disagree")


def test_cache_contract_id_agrees(arch, common_defs):
    assert arch["cache_contract"]["id"] == common_defs["reference_cache_contract_id"]["const"] == "resident-qpacked-cache-v1"
    # reports may name either contract; the architecture describes v1, the reference
    assert common_defs["cache_contract_id"]["enum"] == ["resident-qpacked-cache-v1", "resident-qpacked-cache-v2"]


def test_contract_rules_are_the_nine_named_properties(arch):
    ids = [r["id"] for r in arch["cache_contract"]["rules"]]
    assert ids == ["host-source", "fixed-capacity", "generations", "leases", "all-hit", "miss-transaction",
                   "eviction", "failure", "full-residency"]
    assert all(len(r["statement"]) > 40 for r in arch["cache_contract"]["rules"])


def test_representation_matches_the_qpack_implementation(arch):
    src = arch["representation"]["routed_expert_source"]
    assert src["block_size"] == qpack.DEFAULT_BLOCK_SIZE == 256
    assert src["quant_rule"] == qpack.QUANT_RULE["name"]
    assert src["int_range"] == qpack.QUANT_RULE["int_range"] == [qpack.QMIN, qpack.QMAX]
    assert src["scale_dtype"] == qpack.QUANT_RULE["scale_dtype"] == "float16"
    assert arch["representation"]["non_routed_path"]["runtime_dtype"] == "float16"
    assert arch["representation"]["persistent_expert_expansion"]["allowed"] is False
    assert {e["accumulation"] for e in arch["executors"]} == {"fp32"}


def test_supported_models_have_presets(arch):
    for name in arch["models"]["supported"]:
        assert (REPO_ROOT / arch["models"]["presets_dir"] / f"{name}.yaml").is_file(), name


def test_observation_units_agree_with_instrumentation(arch):
    from runmap.residency import observations as obs

    assert {o["id"]: o["unit"] for o in arch["observations"]["required_zero"]} == obs.REQUIRED_ZERO


def test_implemented_executors_are_the_declared_ones(arch):
    from runmap.kernels import executors

    assert tuple(executors.EXECUTORS) == tuple(e["id"] for e in arch["executors"])


# ---- drift is rejected by the validator itself, not only by the equality tests above ----------------

def test_validator_rejects_an_executor_unknown_to_common(arch):
    drifted = copy.deepcopy(arch)
    drifted["executors"].append(dict(drifted["executors"][1], id="turbo"))
    errs = load_schemas().validate_document(drifted, "architecture")
    assert [e.json_path for e in errs] == [f"$.executors[{len(arch['executors'])}].id"]  # the appended one
    assert "turbo" in errs[0].message


@pytest.mark.parametrize("path, value", [
    (("regimes", 0, "id"), "hybrid"),
    (("observations", "statuses", 1, "id"), "ZERO"),
    (("observations", "required_zero", 0, "id"), "expert_h2d_bytes"),
    (("cache_contract", "id"), "resident-qpacked-cache-v2"),
])
def test_validator_rejects_drifted_ids(arch, path, value):
    drifted = copy.deepcopy(arch)
    node = drifted
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    errs = load_schemas().validate_document(drifted, "architecture")
    assert errs, f"drifted {path} = {value!r} was accepted"
    want = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    assert [e.json_path for e in errs] == [want]


def test_removing_a_value_from_common_breaks_the_architecture(tmp_path, arch):
    """The other direction: common.schema.json losing an executor makes architecture.yaml invalid."""
    for p in (REPO_ROOT / "schemas").glob("*.schema.json"):
        (tmp_path / p.name).write_text(p.read_text())
    common = json.loads(COMMON.read_text())
    common["$defs"]["executor"]["enum"].remove("grouped")
    (tmp_path / "common.schema.json").write_text(json.dumps(common))
    errs = SchemaSet(tmp_path).validate_document(arch, "architecture")
    assert any(e.json_path == "$.executors[2].id" for e in errs)


def test_other_schemas_can_reference_common_definitions(tmp_path):
    for p in (REPO_ROOT / "schemas").glob("*.schema.json"):
        (tmp_path / p.name).write_text(p.read_text())
    (tmp_path / "probe.schema.json").write_text(json.dumps({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": ID_BASE + "probe.schema.json",
        "type": "object",
        "properties": {"executor": {"$ref": "common.schema.json#/$defs/executor"},
                       "regime": {"$ref": "common.schema.json#/$defs/regime"}},
    }))
    ss = SchemaSet(tmp_path)
    assert ss.validate_document({"executor": "grouped", "regime": "partial"}, "probe") == []
    errs = ss.validate_document({"executor": "grouped-v2", "regime": "partial"}, "probe")
    assert [e.json_path for e in errs] == ["$.executor"]
    assert "common" not in errs[0].schema and errs[0].schema == "probe.schema.json"
