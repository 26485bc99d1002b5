"""Packs synthesized directly (runmap/synth/direct_pack.py): valid packs, labelled, loadable, deterministic."""
from __future__ import annotations

import json

import pytest
import torch

from runmap.arch.config import load_preset
from runmap.format.packfile import PackReader, check_pack
from runmap.format.qpack import PROJECTIONS, unpack_nibbles
from runmap.synth.direct_pack import DIRECT_KIND, DIRECT_LAYOUT, EXPERT_STD, synthesized_label, write_direct_pack


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen3-moe"])
def direct(request, tmp_path_factory):
    cfg, _ = load_preset(request.param)
    out = write_direct_pack(cfg, tmp_path_factory.mktemp("direct") / "pack", seed=3, preset=request.param, workers=2)
    return request.param, out


def _schema_errors(manifest: dict) -> list:
    from runmap.conformance.schemas import validate_document

    return validate_document(manifest, "manifest", file="manifest.json")


def test_direct_pack_passes_the_packs_own_checks_and_is_labelled(direct):
    preset, out = direct
    assert check_pack(out) == []  # every file's size and sha256, every expert row's sha256
    m = json.loads((out / "manifest.json").read_text())
    assert _schema_errors(m) == []
    assert m["synthesized"]["kind"] == DIRECT_KIND and m["synthesized"]["preset"] == preset
    assert m["source"]["files"] == [] and m["source"]["expert_layouts"] == [DIRECT_LAYOUT]
    assert {l["source_layout"] for l in m["layers"]} == {DIRECT_LAYOUT}
    assert all("quant_error" not in l for l in m["layers"])
    assert synthesized_label(out)["kind"] == DIRECT_KIND
    with PackReader(out) as r:  # hashes the non-routed and small files, checks config.json against the manifest
        assert r.config == load_preset(preset)[0]


def test_schema_refuses_a_direct_pack_without_its_label_or_with_invented_errors(direct):
    _, out = direct
    m = json.loads((out / "manifest.json").read_text())
    unlabelled = {k: v for k, v in m.items() if k != "synthesized"}
    assert _schema_errors(unlabelled)  # no source files and synthesized layers: only a labelled pack has those
    invented = json.loads(json.dumps(m))
    invented["layers"][0]["quant_error"] = {p: {"rel_fro": [0.0], "max_abs": [0.0]} for p in PROJECTIONS}
    assert _schema_errors(invented)  # nothing was quantized: no error may be recorded
    relabelled = json.loads(json.dumps(m))
    relabelled["layers"][0]["source_layout"] = "per-expert"
    assert _schema_errors(relabelled)


def test_codes_are_in_range_and_experts_have_the_checkpoints_magnitude(direct):
    _, out = direct
    with PackReader(out) as r:
        rows = r.read_expert_rows(0)
        lay = r.layout
        for proj in PROJECTIONS:
            q = torch.stack([unpack_nibbles(lay.view(rows[e], f"{proj}.weight")) for e in range(rows.shape[0])])
            assert int(q.min()) >= -7 and int(q.max()) <= 7
            w = torch.stack([lay.dequantize_expert(rows[e])[proj] for e in range(rows.shape[0])])
            assert torch.isfinite(w).all()
            assert 0.8 * EXPERT_STD < float(w.std()) < 1.2 * EXPERT_STD


def test_same_seed_same_bytes_whatever_the_thread_count(tmp_path):
    cfg, _ = load_preset("tiny-mixtral")
    a = write_direct_pack(cfg, tmp_path / "a", seed=5, workers=1)
    b = write_direct_pack(cfg, tmp_path / "b", seed=5, workers=3)
    c = write_direct_pack(cfg, tmp_path / "c", seed=6, workers=3)
    files = lambda p: {f["file"]: f["sha256"] for f in json.loads((p / "manifest.json").read_text())["files"]}  # noqa: E731
    assert files(a) == files(b)
    assert files(a)["experts-layer-000.safetensors"] != files(c)["experts-layer-000.safetensors"]


@pytest.mark.parametrize("resident", [None, 2])
def test_direct_pack_decodes_finite_logits_in_the_engine(direct, resident):
    from runmap.engine.engine import Engine

    preset, out = direct
    cfg, _ = load_preset(preset)
    res = None if resident is None else max(cfg.top_k, resident)
    eng = Engine.from_pack(out, device="cpu", resident=res, max_batch=1, max_seq_len=32)
    try:
        logits = eng.logits([5, 6, 7, 8, 9, 10])
        assert logits.shape == (6, cfg.vocab_size) and torch.isfinite(logits).all()
        assert float(logits.std()) > 0  # not a degenerate all-equal output
        run = eng.run([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)
        assert len(run.results[0].token_ids) == 4
    finally:
        eng.close()


def test_cli_direct_pack_refuses_checkpoint_options_and_an_existing_output(tmp_path, capsys):
    from runmap.cli.main import main

    out = tmp_path / "p"
    assert main(["synth", str(out), "--preset", "tiny-mixtral", "--direct-pack", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "--device" in err and "Traceback" not in err and not out.exists()
    assert main(["synth", str(out), "--preset", "tiny-mixtral", "--direct-pack", "--no-progress"]) == 0
    assert "synthesized directly" in capsys.readouterr().out
    assert main(["synth", str(out), "--preset", "tiny-mixtral", "--direct-pack", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "already exists" in err and len(err.strip().splitlines()) == 1
