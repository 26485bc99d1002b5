"""schemas/: well-formed, offline-resolvable, and each spec schema accepts the repo's specs and rejects bad ones."""
import copy
import dataclasses
import json
import re

import pytest
import yaml
from hypothesis import given, strategies as st

from runmap.arch import config as runmap_config
from pathlib import Path

from runmap.conformance.schemas import ID_BASE, Schema, SchemaError, SchemaSet, glob_to_regex, load_schemas

REPO_ROOT = Path(__file__).resolve().parent.parent

SCHEMAS = sorted((REPO_ROOT / "schemas").glob("*.schema.json"))


@pytest.fixture(scope="module")
def ss():
    return load_schemas()


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.name)
def test_schema_file_follows_the_convention(path, ss):
    doc = json.loads(path.read_text())
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert doc["$id"] == ID_BASE + path.name
    assert path.name in ss.schemas


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.name)
def test_every_ref_resolves_offline(path, ss):
    s = ss.schemas[path.name]
    resolver = ss.registry.resolver(base_uri=s.id)
    for ref in _refs(s.contents):
        # a ref to a name that does not exist raises (referencing.exceptions.Unresolvable)
        resolver.lookup(ref)


def test_a_broken_ref_is_an_error_not_a_pass(tmp_path):
    (tmp_path / "common.schema.json").write_text((REPO_ROOT / "schemas/common.schema.json").read_text())
    (tmp_path / "x.schema.json").write_text(json.dumps({
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": ID_BASE + "x.schema.json",
        "properties": {"e": {"$ref": "common.schema.json#/$defs/no_such_def"}}}))
    from referencing.exceptions import Unresolvable
    with pytest.raises(Unresolvable):
        SchemaSet(tmp_path).validate_document({"e": 1}, "x")


@pytest.mark.parametrize("bad, why", [
    ({"$id": ID_BASE + "wrong-name.schema.json"}, "$id must be"),
    ({"type": "objekt"}, "not a valid draft 2020-12 schema"),
    ({"x-artifact-glob": "results/*.json"}, "must be a list"),
    ({"x-artifact-glob": ["/abs/*.json"]}, "relative POSIX"),
    ({"x-artifact-format": "csv"}, "x-artifact-format"),
])
def test_bad_schema_files_are_rejected_with_the_file_named(tmp_path, bad, why):
    doc = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": ID_BASE + "s.schema.json", **bad}
    (tmp_path / "s.schema.json").write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match=re.escape(why)) as e:
        SchemaSet(tmp_path)
    assert "s.schema.json" in str(e.value)


# ---- glob convention ---------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, path, hit", [
    ("packs/*/manifest.json", "/r/results/packs/m-b256/manifest.json", True),
    ("packs/*/manifest.json", "/r/packs/m/sub/manifest.json", False),
    ("packs/*/manifest.json", "/r/xpacks/m/manifest.json", False),
    ("manifest.json", "/r/a/notmanifest.json", False),
    ("**/model.safetensors.index.json", "/model.safetensors.index.json", True),
    ("**/model.safetensors.index.json", "/a/b/c/model.safetensors.index.json", True),
    ("campaigns/**/records/*.json", "/x/campaigns/records/r.json", True),
    ("campaigns/**/records/*.json", "/x/campaigns/a/b/records/r.json", True),
    ("specs/models/*.yaml", "/w/specs/models/tiny.yaml", True),
    ("specs/models/*.yaml", "/w/specs/models/tiny.yml", False),
    ("r?.json", "/a/r1.json", True),
    ("r[0-9].json", "/a/rx.json", False),
])
def test_glob_matches_trailing_components(pattern, path, hit):
    assert Schema("t", Path("t"), {}, (pattern,), None).claims(Path(path)) is hit


@given(parts=st.lists(st.from_regex(r"[a-z0-9_-]{1,6}(\.json)?", fullmatch=True), min_size=1, max_size=6),
       n=st.integers(1, 7))
def test_star_stays_inside_one_component(parts, n):
    path = "/".join(parts)
    # n "*" components claim exactly the paths with at least n components (trailing-component matching)
    assert bool(glob_to_regex("/".join(["*"] * n)).search(path)) is (len(parts) >= n)
    # "**/" spans any depth, including none
    assert glob_to_regex("**/" + parts[-1].replace(".", "[.]")).search(path)


# ---- model presets -----------------------------------------------------------------------------

PRESETS = sorted((REPO_ROOT / "specs" / "models").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_presets_conform_and_load(path, ss):
    doc = yaml.safe_load(path.read_text())
    assert ss.validate_document(doc, "model-preset") == []
    assert doc["name"] == path.stem
    cfg, _ = runmap_config.load_preset(path.stem)
    assert cfg.arch == doc["config"]["arch"]


def test_preset_schema_fields_are_the_modelconfig_fields():
    props = json.loads((REPO_ROOT / "schemas/model-preset.schema.json").read_text())["properties"]["config"]["properties"]
    assert set(props) == {f.name for f in dataclasses.fields(runmap_config.ModelConfig)}


def test_tiny_presets_exercise_partial_blocks():
    for name in ("tiny-olmoe", "tiny-qwen2-moe"):
        cfg, doc = runmap_config.load_preset(name)
        assert doc["synthetic"] is True
        assert cfg.moe_intermediate_size % 256 or cfg.hidden_size % 256, name


@pytest.mark.parametrize("mutate, json_path", [
    (lambda d: d["config"].update(arch="deepseek_v2"), "$.config.arch"),
    (lambda d: d["config"].update(hidden_size=255), "$.config.hidden_size"),
    (lambda d: d["config"].update(num_expert=8), "$.config"),
    (lambda d: d["config"].pop("top_k"), "$.config"),
    (lambda d: d.update(synthetic=False), "$"),  # a real model needs hf_id
])
def test_bad_presets_are_rejected_at_the_right_path(ss, mutate, json_path):
    doc = yaml.safe_load((REPO_ROOT / "specs/models/tiny-olmoe.yaml").read_text())
    mutate(doc)
    errs = ss.validate_document(doc, "model-preset")
    assert errs and errs[0].json_path == json_path, errs


def test_qwen_preset_requires_shared_expert_size(ss):
    doc = yaml.safe_load((REPO_ROOT / "specs/models/qwen1.5-moe-a2.7b.yaml").read_text())
    del doc["config"]["shared_expert_intermediate_size"]
    assert [e.json_path for e in ss.validate_document(doc, "model-preset")] == ["$.config"]


# ---- pipeline config ---------------------------------------------------------------------------

def test_default_pipeline_config(ss):
    doc = yaml.safe_load((REPO_ROOT / "specs/pipeline/default.yaml").read_text())
    assert ss.validate_document(doc, "pipeline-config") == []
    assert doc["models"] == ["tiny-olmoe", "tiny-qwen2-moe"] and doc["block_size"] == 256
    for m in doc["models"]:
        assert runmap_config.load_preset(m)[1]["synthetic"] is True


@pytest.mark.parametrize("patch, json_path", [
    ({"block_size": 255}, "$.block_size"),
    ({"block_size": "256"}, "$.block_size"),
    ({"models": []}, "$.models"),
    ({"models": ["Tiny OLMoE"]}, "$.models[0]"),
    ({"blocksize": 128}, "$.blocksize"),  # a typo of a scalar key is not taken for a stage section
    ({"checkpoints": {"tiny-olmoe": ""}}, '$.checkpoints["tiny-olmoe"]'),
])
def test_bad_pipeline_configs_are_rejected(ss, patch, json_path):
    doc = {**yaml.safe_load((REPO_ROOT / "specs/pipeline/default.yaml").read_text()), **patch}
    errs = ss.validate_document(doc, "pipeline-config")
    assert [e.json_path for e in errs] == [json_path]


def test_stage_sections_are_allowed(ss):
    doc = {"models": ["tiny-olmoe"], "bench": {"executors": ["grouped"]}}
    assert ss.validate_document(doc, "pipeline-config") == []


# ---- observation records (common.schema.json#/$defs/observation) -------------------------------

def _obs_schema(tmp_path):
    for p in SCHEMAS:
        (tmp_path / p.name).write_text(p.read_text())
    (tmp_path / "obs.schema.json").write_text(json.dumps({
        "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": ID_BASE + "obs.schema.json",
        "$ref": "common.schema.json#/$defs/observation"}))
    return SchemaSet(tmp_path)


@given(status=st.sampled_from(["OBSERVED", "UNKNOWN", "UNSUPPORTED"]),
       value=st.one_of(st.none(), st.integers(0, 2**40), st.floats(0, 1e12)),
       reason=st.one_of(st.none(), st.text(min_size=1, max_size=5)))
def test_observation_value_only_when_observed(tmp_path_factory, status, value, reason):
    ss = _OBS_SS.get("ss") or _OBS_SS.setdefault("ss", _obs_schema(tmp_path_factory.mktemp("obs")))
    doc = {"status": status}
    if value is not None:
        doc["value"] = value
    if reason is not None:
        doc["reason"] = reason
    ok = not ss.validate_document(doc, "obs")
    expected = (value is not None) if status == "OBSERVED" else (value is None and reason is not None)
    assert ok is expected, doc


_OBS_SS: dict = {}
