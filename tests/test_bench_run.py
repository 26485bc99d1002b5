"""`runmap bench` end to end: the runner on the real engine (tiny synthetic pack, CPU), the folded engine
benchmark (variants, logits check, byte floor), output that never clobbers a campaign, clear CLI errors,
and the pipeline's refusal to overwrite committed evidence."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runmap.arch.config import load_preset
from runmap.bench import campaign as bench
from runmap.bench import checks as cc
from runmap.cli.main import main
from runmap.conformance.schemas import validate_document
from runmap.format.pack import pack_checkpoint
from runmap.synth.checkpoint import write_synthetic
from test_bench_fakes import FakeEngine, fake_factory, run_fake, tiny_spec

REPO = Path(__file__).resolve().parent.parent


def test_the_runner_uses_only_the_typed_engine_interface():
    src = (REPO / "runmap" / "bench" / "campaign.py").read_text()
    for banned in ("monkeypatch", "inspect.signature", "import inspect", ".telemetry()", "ExpertCache",
                   "eos_ids", "last_timing\"]", "_find(", "getattr(engine"):
        assert banned not in src, banned
    assert not (REPO / "scripts" / "bench_engine.py").exists(), "one engine benchmark: runmap bench"


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    base = tmp_path_factory.mktemp("tinypack")
    ck = write_synthetic(load_preset("tiny-olmoe")[0], base / "ck", seed=3)
    return ck, pack_checkpoint(ck, base / "pk", device="cpu")


def _real_spec(ck, pk):
    return {
        "name": "eng", "description": "real engine", "device": "cpu",
        "defaults": {"repeats": 2, "warmup": 0},
        "models": {"m": {"preset": "tiny-olmoe", "pack": str(pk), "checkpoint": str(ck)}},
        "groups": [
            {"name": "fp16", "kind": "engine-fp16", "models": ["m"], "batch": 2, "prompt_len": 5, "decode_len": 3},
            {"name": "res", "kind": "engine", "models": ["m"], "resident": ["full", 4], "executors": ["reference"],
             "batch": 2, "prompt_len": 5, "decode_len": 3, "params": {"check": True}},
            {"name": "skip", "kind": "engine", "models": ["m"], "resident": ["full"], "executors": ["reference"],
             "batch": 2, "prompt_len": 5, "decode_len": 3, "params": {"skip_experts": True}},
        ],
    }


def test_campaign_on_the_real_engine(tiny_pack, tmp_path):
    ck, pk = tiny_pack
    spec = _real_spec(ck, pk)
    assert validate_document(spec, "campaign-spec") == []
    summary = bench.run_campaign(spec, tmp_path, progress=False, measure_bandwidth=True, command="pytest")
    assert not summary["failed"] and len(summary["done"]) == 4
    recs = {r["id"]: r for r in bench.load_records(tmp_path / "eng")}
    for r in recs.values():
        r.pop("_path")
        assert validate_document(r, "bench-record") == []
        assert r["timing"]["new_tokens"] == 2 * 3, "EOS stopping is off: every row decodes decode_len tokens"
    assert cc.errors(cc.check_records(list(recs.values()))) == []
    full = recs["m__engine__reference__r8__b2__p5__d3"]
    part = recs["m__engine__reference__r4__b2__p5__d3"]
    skip = recs["m__engine__reference__r8__b2__p5__d3__skipexperts"]
    assert full["cache_stats"]["misses"] == {"status": "OBSERVED", "value": 0}
    assert part["cache_stats"]["misses"]["value"] > 0 and part["h2d"]["bytes"]["value"] > 0
    assert part["h2d"]["gb_s"]["status"] == "OBSERVED"
    assert {o["status"] for o in part["observations"].values()} <= {"OBSERVED", "UNKNOWN", "UNSUPPORTED"}
    # engines after the first reuse its host source (built and hash-verified once per run)
    assert full["engine"]["host_source"] == "built by this engine"
    assert part["engine"]["host_source"].startswith("reused") and skip["engine"]["host_source"].startswith("reused")
    assert part["cache"]["resident_bytes"]["value"] * 2 == full["cache"]["resident_bytes"]["value"]
    assert part["ratios"]["decode_vs_engine-fp16"]["status"] == "OBSERVED"
    assert part["config"]["block_size"] == 256
    # same-run copy bandwidth -> byte floor -> ratio
    bw = full["byte_floor"]["copy_bandwidth_gb_s"]
    assert bw["status"] == "OBSERVED" and full["ratios"]["decode_vs_byte_floor"]["status"] == "OBSERVED"
    # the logits check against the reference executor (reference vs itself here: exact)
    chk = full["check"]
    assert chk["reference_executor"] == "reference" and chk["passed"] is True
    assert chk["executor_vs_reference_max_abs"] == {"status": "OBSERVED", "value": 0.0}
    assert chk["routes_agree"] == {"status": "OBSERVED", "value": 1.0}  # the real engine reports its routes
    assert chk["executor_vs_reference_same_routes_max_abs"]["value"] <= 1e-6  # the reference imposed its own routes
    assert chk["argmax_agreement"]["value"] == 1.0 and chk["logit_scale"]["value"] > 0
    assert chk["fused_vs_torch_max_abs"]["status"] == "UNSUPPORTED"  # fused ops run on CUDA only
    assert "check" not in skip
    # the variant is a configuration of its own, labelled in the record, its own series
    assert skip["config"]["variant"] == "skipexperts" and skip["engine"]["skip_experts"] is True
    assert full["config"]["variant"] == "default" and full["engine"]["cuda_graphs"] is False  # CPU: no graphs
    assert any("profiling variant" in n for n in skip["notes"])
    assert cc.series_key(skip) != cc.series_key(full)


def test_check_with_another_executor_and_its_conformance(tmp_path):
    spec = tiny_spec()
    spec["groups"] = [{"name": "res", "kind": "engine", "models": ["m"], "resident": ["full"], "executors": ["grouped"],
                       "batch": 1, "prompt_len": 4, "decode_len": 3, "params": {"check": True, "check_prompt_len": 6}}]
    engines = []

    def factory(c, entry, device):
        e, info = fake_factory()(c, entry, device)
        engines.append(e)
        return e, info

    bench.run_campaign(spec, tmp_path, engine_factory=factory, progress=False, measure_bandwidth=False, command="t")
    (rec,) = bench.load_records(tmp_path / "t")
    rec.pop("_path")
    assert engines[0].logit_calls == [(None, None), ("reference", None), ("reference", None)]  # last: on our routes
    chk = rec["check"]
    assert chk["prompt_tokens"] == 6 and chk["executor_vs_reference_max_abs"]["value"] == pytest.approx(1e-4, rel=1e-3)
    assert chk["routes_agree"]["value"] == 1.0 and chk["min_route_agreement"] == 0.5
    assert chk["passed"] and validate_document(rec, "bench-record") == []
    assert cc.errors(cc.check_records([rec])) == []
    bad = json.loads(json.dumps(rec))
    bad["check"]["executor_vs_reference_same_routes_max_abs"]["value"] = 10.0 * bad["check"]["logit_scale"]["value"]
    errs = cc.errors(cc.check_records([bad]))
    assert [e.check for e in errs] == ["logits-check", "logits-check"]  # too far, and `passed` disagrees
    bad["check"]["passed"] = False
    assert [e.message.split(":")[0] for e in cc.errors(cc.check_records([bad]))] == ["executor grouped vs reference"]
    # the difference against the reference's own routing is recorded, not judged, where routes were compared; but most
    # positions must route as the reference's
    bad = json.loads(json.dumps(rec))
    bad["check"]["executor_vs_reference_max_abs"]["value"] = 10.0 * bad["check"]["logit_scale"]["value"]
    assert cc.errors(cc.check_records([bad])) == []
    bad["check"]["routes_agree"]["value"] = 0.4
    assert [e.check for e in cc.errors(cc.check_records([bad]))] == ["logits-check", "logits-check"]
    # a record made before routes were compared (no routes_agree): its all-position difference counts
    bad = json.loads(json.dumps(rec))
    for key in ("routes_agree", "executor_vs_reference_same_routes_max_abs"):
        bad["check"][key] = {"status": "UNSUPPORTED", "reason": "no routes"}
    assert validate_document(bad, "bench-record") == [] and cc.errors(cc.check_records([bad])) == []
    bad["check"]["executor_vs_reference_max_abs"]["value"] = 10.0 * bad["check"]["logit_scale"]["value"]
    assert [e.check for e in cc.errors(cc.check_records([bad]))] == ["logits-check", "logits-check"]


@pytest.mark.parametrize("flips, corrupt, passed", [(2, 0, True), (3, 0, True), (4, 0, False), (0, 2, False),
                                                    (2, 2, False)])
def test_the_logits_check_compares_every_position_on_the_same_routes(tmp_path, flips, corrupt, passed):
    """Of 6 positions, those a near-tie routes otherwise under the reference's own routing move its logits a lot:
    they are counted (routes_agree) and the arithmetic is compared on the engine's own routes instead, at every
    position, so they pass up to the floor (min_route_agreement 0.5). An arithmetic bug of the engine's executor at
    2 positions fails, also where those positions are the ones routed otherwise."""
    spec = tiny_spec()
    spec["groups"] = [{"name": "res", "kind": "engine", "models": ["m"], "resident": ["full"], "executors": ["grouped"],
                       "batch": 1, "prompt_len": 4, "decode_len": 3, "params": {"check": True, "check_prompt_len": 6}}]

    def factory(c, entry, device):
        e, info = fake_factory()(c, entry, device)
        e.route_flips, e.corrupt_positions, e.corrupt = flips, corrupt, 5.0
        return e, info

    bench.run_campaign(spec, tmp_path, engine_factory=factory, progress=False, measure_bandwidth=False, command="t")
    (rec,) = bench.load_records(tmp_path / "t")
    rec.pop("_path")
    chk = rec["check"]
    assert chk["routes_agree"]["value"] == pytest.approx((6 - flips) / 6)
    assert (chk["executor_vs_reference_max_abs"]["value"] > 1.0) == bool(flips or corrupt)
    assert (chk["executor_vs_reference_same_routes_max_abs"]["value"] > 1.0) == bool(corrupt)
    assert chk["passed"] is passed
    assert [e.check for e in cc.errors(cc.check_records([rec]))] == ([] if passed else ["logits-check"])


@pytest.mark.parametrize("params, match", [
    ({"check": True, "skip_experts": True}, "check with skip_experts"),
    ({"fused": ["bogus"]}, None),  # schema
])
def test_bad_variant_params(params, match):
    spec = tiny_spec()
    spec["groups"][2]["params"] = params
    if match is None:
        assert validate_document(spec, "campaign-spec")
        return
    with pytest.raises(bench.BenchError, match=match):
        bench.expand(spec)


def test_engine_options_on_a_baseline_are_refused():
    spec = tiny_spec()
    spec["groups"][0]["params"] = {"cuda_graphs": False}
    with pytest.raises(bench.BenchError, match="engine options"):
        bench.expand(spec)


def test_variant_ids_and_engine_keys():
    spec = tiny_spec()
    spec["groups"] = spec["groups"][2:]
    spec["groups"].append({"name": "v", "kind": "engine", "models": ["m"], "resident": ["full"], "executors": ["grouped"],
                           "batch": 1, "prompt_len": 4, "decode_len": 3,
                           "params": {"cuda_graphs": False, "fused": ["norm", "attn"]}})
    configs = {c.id: c for c in bench.expand(spec)}
    v = configs["m__engine__grouped__r8__b1__p4__d3__nographs.fused-attn-norm"]
    base = configs["m__engine__grouped__r8__b1__p4__d3"]
    assert v.variant == "nographs.fused-attn-norm" and base.variant == "default"
    assert v.engine_key() != base.engine_key()


def test_resident_below_top_k_names_the_real_bound():
    spec = tiny_spec()
    spec["groups"][2]["resident"] = [3]
    with pytest.raises(bench.BenchError, match=r"resident 3 < top_k 4 .* must be in \[4, 8\]"):
        bench.expand(spec)


# ---- output: no clobbering, atomic publication --------------------------------------------------------

def test_existing_campaign_is_refused_and_left_untouched(tmp_path):
    run_fake(tmp_path)
    camp = tmp_path / "t"
    before = {p: p.read_bytes() for p in camp.rglob("*") if p.is_file()}
    with pytest.raises(bench.OutputExistsError, match="already holds a campaign"):
        run_fake(tmp_path)
    assert {p: p.read_bytes() for p in camp.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"], "nothing written, not even a temp directory"


def test_overwrite_replaces_records_and_keeps_other_files(tmp_path):
    run_fake(tmp_path)
    camp = tmp_path / "t"
    (camp / "README.md").write_text("evidence\n")
    (camp / "records" / "stale.json").write_text("{}")
    old = json.loads((camp / "campaign.json").read_text())["run_id"]
    spec = tiny_spec()
    spec["groups"] = spec["groups"][2:]
    summary = bench.run_campaign(spec, tmp_path, engine_factory=fake_factory(), command="t", progress=False,
                                 measure_bandwidth=False, overwrite=True)
    assert json.loads((camp / "campaign.json").read_text())["run_id"] == summary["run_id"] != old
    assert sorted(p.stem for p in (camp / "records").iterdir()) == sorted(summary["done"])
    assert (camp / "README.md").read_text() == "evidence\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_failing_run_never_rewrites_an_existing_campaign(tmp_path, capsys):
    run_fake(tmp_path)
    camp = tmp_path / "t"
    before = {p: p.read_bytes() for p in camp.rglob("*") if p.is_file()}

    def factory(c, entry, device):
        if c.resident == 6:
            raise RuntimeError("boom")
        return fake_factory()(c, entry, device)

    with pytest.raises(RuntimeError, match="boom"):
        bench.run_campaign(tiny_spec(), tmp_path, engine_factory=factory, command="t", progress=False,
                           measure_bandwidth=False, overwrite=True)
    assert {p: p.read_bytes() for p in camp.rglob("*") if p.is_file()} == before
    # --keep-going with a failure: the run ends normally but still does not replace the campaign
    summary = bench.run_campaign(tiny_spec(), tmp_path, engine_factory=factory, command="t", progress=False,
                                 measure_bandwidth=False, overwrite=True, keep_going=True)
    assert summary["failed"]
    assert {p: p.read_bytes() for p in camp.rglob("*") if p.is_file()} == before
    err = capsys.readouterr().err
    assert "left as it was" in err
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".t.failed-")]
    assert len(kept) == 2 and all((p / "campaign.json").is_file() for p in kept)
    assert len(bench.load_records(tmp_path)) == len(before) - 1, "hidden partial output is not read as records"


def test_a_failing_first_run_still_publishes_what_it_measured(tmp_path):
    def factory(c, entry, device):
        if c.kind == "hf-bf16":
            raise RuntimeError("boom")
        return fake_factory()(c, entry, device)

    with pytest.raises(RuntimeError):
        bench.run_campaign(tiny_spec(), tmp_path, engine_factory=factory, command="t", progress=False,
                           measure_bandwidth=False)
    s = json.loads((tmp_path / "t" / "campaign.json").read_text())
    assert s["failed"][0]["id"].startswith("m__hf-bf16") and validate_document(s, "bench-campaign") == []


# ---- the command line --------------------------------------------------------------------------------

def _spec_file(tmp_path, spec=None) -> Path:
    import yaml

    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(spec or tiny_spec()))
    return f


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_cli_bad_only_regex_is_one_line(tmp_path, capsys):
    assert main(["bench", str(_spec_file(tmp_path)), "--only", "(grouped", "--out", str(tmp_path / "o")]) == 2
    assert "--only '(grouped' is not a regular expression" in _one_line(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", ["--pack", "--checkpoint"])
def test_cli_unknown_model_name_is_refused_at_once(tmp_path, capsys, flag):
    assert main(["bench", str(_spec_file(tmp_path)), flag, "qwen=/x", "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert f"{flag} names ['qwen'], not models of campaign 't'" in line and "['m']" in line
    assert main(["bench", str(_spec_file(tmp_path)), flag, "m", "--out", str(tmp_path / "o")]) == 2
    assert "expected NAME=DIR" in _one_line(capsys)
    assert not (tmp_path / "o").exists()


def test_cli_refuses_an_existing_campaign(tmp_path, capsys):
    run_fake(tmp_path / "o")
    before = (tmp_path / "o" / "t" / "campaign.json").read_bytes()
    assert main(["bench", str(_spec_file(tmp_path)), "--out", str(tmp_path / "o"), "--no-progress"]) == 1
    line = _one_line(capsys)
    assert "already holds a campaign" in line and "--overwrite" in line
    assert (tmp_path / "o" / "t" / "campaign.json").read_bytes() == before
    # --list only prints: no refusal
    assert main(["bench", str(_spec_file(tmp_path)), "--out", str(tmp_path / "o"), "--list"]) == 0


def test_cli_headline_selection_on_h200_spec(capsys):
    only = r"^olmoe__(engine__grouped|hf-bf16__hf-bf16)__r64__b1__p32__d256$"
    assert main(["bench", str(REPO / "specs" / "campaigns" / "h200.yaml"), "--only", only, "--list"]) == 0
    assert capsys.readouterr().out.split() == ["olmoe__engine__grouped__r64__b1__p32__d256",
                                               "olmoe__hf-bf16__hf-bf16__r64__b1__p32__d256"]


# ---- the pipeline: committed evidence ----------------------------------------------------------------

def _dry_run(work: Path, *args):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "-c1", "-p", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)


def test_pipeline_refuses_to_overwrite_committed_evidence(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    for name in ("Snakefile", "workflow", "schemas", "specs"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / name)
    camp = work / "results" / "campaigns" / "default"
    proc = _dry_run(work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "runmap bench specs/campaigns/default.yaml --out results/campaigns --overwrite" in proc.stdout
    camp.mkdir(parents=True)
    (camp / "README.md").write_text("committed evidence\n")
    proc = _dry_run(work)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "results/campaigns/default" in out and "bench.overwrite_evidence" in out
    (work / "over.yaml").write_text("bench: {overwrite_evidence: true}\n")
    proc = _dry_run(work, "--configfile", "specs/pipeline/default.yaml", "over.yaml")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    (work / "over.yaml").write_text("bench: {overwrite: true}\n")  # a typo is a schema error, not ignored
    proc = _dry_run(work, "--configfile", "specs/pipeline/default.yaml", "over.yaml")
    assert proc.returncode != 0 and "overwrite" in proc.stdout + proc.stderr
