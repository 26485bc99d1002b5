"""Packing and the pack reader: round trip against quantize() of the original BF16 weights, both
layouts and architectures, manifest schema, atomic output, reader counters and corruption errors."""
import hashlib
import json
import os
import shutil

import pytest
import torch

from runmap.format import pack as pack_mod
from runmap.format.checkpoint import CheckpointReader
from runmap.cli.main import main as cli_main
from runmap.arch.config import load_preset
from runmap.format.pack import pack_checkpoint, quantize_layer
from runmap.format.packfile import PackClosedError, PackError, PackReader
from runmap.format.safetensors_io import read_header
from runmap.format.qpack import PROJECTIONS, RowLayout, dequantize, quantize
from runmap.synth.checkpoint import write_synthetic

PRESETS = ["tiny-olmoe", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral"]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """{(preset, layout): (checkpoint dir, pack dir)}."""
    base = tmp_path_factory.mktemp("packs")
    out = {}
    for preset in PRESETS:
        cfg, _ = load_preset(preset)
        for layout in ("per-expert", "fused"):
            ck = write_synthetic(cfg, base / f"{preset}-{layout}-ck", seed=11, expert_layout=layout,
                                 shard_bytes=2_000_000)
            out[preset, layout] = ck, pack_checkpoint(ck, base / f"{preset}-{layout}-pack", device="cpu")
    return out


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_round_trip_equals_quantize_of_source(packs, preset, layout):
    ck, pk = packs[preset, layout]
    src = CheckpointReader(ck)
    with PackReader(pk) as r:
        assert r.config == src.config and r.num_layers == src.config.num_layers
        assert r.layout == RowLayout.build(src.config.hidden_size, src.config.moe_intermediate_size, 256)
        for layer in range(r.num_layers):
            rows = r.read_expert_rows(layer)
            assert rows.dtype == torch.uint8 and rows.is_contiguous()
            assert tuple(rows.shape) == (r.num_experts, r.layout.row_bytes)
            r.verify_expert_hashes(layer, rows)
            for e in range(r.num_experts):
                w = src.expert_weights(layer, e)  # BF16 as stored
                assert torch.equal(rows[e], r.layout.pack_expert(w))  # byte-identical to the reference packer
                deq = r.layout.dequantize_expert(rows[e])
                for proj in PROJECTIONS:
                    n, k = r.layout.proj_dims(proj)
                    ref = dequantize(*quantize(w[proj], 256), k, 256)
                    assert torch.equal(deq[proj], ref)
                    s = r.layout.view(rows[e], f"{proj}.scale").float().repeat_interleave(256, 1)[:, :k]
                    assert ((deq[proj] - w[proj].float()).abs() <= s / 2 * (1 + 1e-6)).all()
        assert r.nonrouted_names() == src.nonrouted_names()
        for name in r.nonrouted_names():
            t = r.nonrouted(name)
            assert t.dtype == torch.float16 and torch.equal(t, src.tensor(name).to(torch.float16))


def test_partial_last_block_is_exercised(packs):
    for preset in PRESETS:
        with PackReader(packs[preset, "per-expert"][1]) as r:
            assert r.layout.intermediate_size % 256 != 0  # down projection K: partial last block


def test_layouts_pack_to_identical_rows(packs):
    for preset in PRESETS:
        a, b = PackReader(packs[preset, "per-expert"][1]), PackReader(packs[preset, "fused"][1])
        for layer in range(a.num_layers):
            assert torch.equal(a.read_expert_rows(layer), b.read_expert_rows(layer))
            assert a.expert_sha256(layer) == b.expert_sha256(layer)


def test_manifest_contents_and_schema(packs):
    from runmap.conformance.schemas import validate_file

    ck, pk = packs["tiny-qwen2-moe", "fused"]
    m = json.loads((pk / "manifest.json").read_text())
    assert validate_file(pk / "manifest.json", "manifest") == []
    files = {f["file"]: f for f in m["source"]["files"]}
    for name, f in files.items():
        assert f["bytes"] == (ck / name).stat().st_size
        assert f["sha256"] == hashlib.sha256((ck / name).read_bytes()).hexdigest()
    assert "model.safetensors.index.json" in files and len(files) > 3
    assert m["block_size"] == 256 and m["quant_rule"]["int_range"] == [-7, 7]
    with PackReader(pk) as r:
        for layer, entry in enumerate(m["layers"]):
            rows = r.read_expert_rows(layer)
            assert entry["expert_sha256"] == [hashlib.sha256(rows[e].numpy().tobytes()).hexdigest() for e in range(len(rows))]
            assert entry["offset"] % 4096 == 0
            for proj in PROJECTIONS:
                assert len(entry["quant_error"][proj]["rel_fro"]) == r.num_experts
                assert all(0 < x < 0.2 for x in entry["quant_error"][proj]["rel_fro"])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (pk / name).read_bytes() == (ck / name).read_bytes()
    bad = dict(m, layers=[dict(m["layers"][0], offset=-1)])
    from runmap.conformance.schemas import validate_document
    assert validate_document(bad, "manifest")  # the schema can fail


@pytest.mark.parametrize("chunk_values", [1 << 24, 96 * 64, 1])  # all experts / one per chunk / minimum
def test_quant_error_matches_definition(monkeypatch, chunk_values):
    monkeypatch.setattr(pack_mod, "CHUNK_VALUES", chunk_values)
    torch.manual_seed(0)
    layout = RowLayout.build(64, 96, 32)
    g, u, d = torch.randn(3, 96, 64), torch.randn(3, 96, 64), torch.randn(3, 64, 96)
    d[1] = 0  # an all-zero expert projection: error 0, not NaN
    rows, err = quantize_layer(g, u, d, layout)
    for e in range(3):
        assert torch.equal(rows[e], layout.pack_expert({"gate": g[e], "up": u[e], "down": d[e]}))
        w_hat = layout.dequantize_expert(rows[e])["gate"]
        rel = ((g[e] - w_hat).norm() / g[e].norm()).item()
        assert err["gate"]["rel_fro"][e] == pytest.approx(rel, rel=1e-5)
        assert err["gate"]["max_abs"][e] == pytest.approx((g[e] - w_hat).abs().max().item(), rel=1e-6)
    assert err["down"]["rel_fro"][1] == 0.0 and err["down"]["max_abs"][1] == 0.0


def test_block_size_parameter_and_determinism(packs, tmp_path):
    ck, pk = packs["tiny-olmoe", "per-expert"]
    a = pack_checkpoint(ck, tmp_path / "b64a", block_size=64, device="cpu")
    b = pack_checkpoint(ck, tmp_path / "b64b", block_size=64, device="cpu")
    with PackReader(a) as ra, PackReader(b) as rb, PackReader(pk) as r256:
        assert ra.layout.block_size == 64 and ra.layout.section("down.scale").shape == (256, 5)
        for layer in range(ra.num_layers):
            assert torch.equal(ra.read_expert_rows(layer), rb.read_expert_rows(layer))
        assert not torch.equal(ra.read_expert_rows(0)[:, :100], r256.read_expert_rows(0)[:, :100]) or \
            ra.layout.row_bytes != r256.layout.row_bytes
    for f in sorted(p.name for p in a.iterdir() if p.suffix == ".safetensors"):
        assert (a / f).read_bytes() == (b / f).read_bytes()


# ---- reader ---------------------------------------------------------------------------------------
def test_reader_counts_bytes_and_refuses_reads_after_close(packs):
    _, pk = packs["tiny-olmoe", "per-expert"]
    verified = PackReader(pk)
    small = sum(e["bytes"] for n, e in verified.files.items() if not n.startswith("experts-layer-"))
    assert verified.bytes_verified == small  # hashing on open is a read, counted (and the tensor index checked)
    assert verified.bytes_read == small + read_header(pk / "nonrouted.safetensors")[1]
    r = PackReader(pk, verify=False)
    assert r.bytes_read == 0
    rows = r.read_expert_rows(1)
    header = r.manifest["layers"][1]["offset"]  # the safetensors header before the rows is read too
    assert r.bytes_read == header + rows.numel()
    emb = r.nonrouted("model.embed_tokens.weight")
    nr_header = read_header(pk / "nonrouted.safetensors")[1]
    assert r.bytes_read == header + rows.numel() + nr_header + emb.numel() * 2
    r.nonrouted("model.norm.weight")
    assert r.bytes_read == header + rows.numel() + nr_header + emb.numel() * 2 + 2 * r.config.hidden_size
    assert r.tokenizer_dir == pk and (r.tokenizer_dir / "tokenizer.json").is_file()
    assert len(r.identity) == 64
    r.close()
    before = r.bytes_read
    with pytest.raises(PackClosedError):
        r.read_expert_rows(0)
    with pytest.raises(PackClosedError):
        r.nonrouted("model.norm.weight")
    assert r.reads_after_close == 2 and r.bytes_read == before
    assert r.expert_sha256(0) and r.num_experts == 8  # in-memory metadata stays available


def test_rows_are_a_private_copy(packs):
    _, pk = packs["tiny-olmoe", "per-expert"]
    with PackReader(pk) as r:
        a = r.read_expert_rows(0)
        a.zero_()
        b = r.read_expert_rows(0)
        r.verify_expert_hashes(0, b)
        assert b.data_ptr() != a.data_ptr()


def _copy_pack(packs, tmp_path):
    d = tmp_path / "pack"
    shutil.copytree(packs["tiny-olmoe", "per-expert"][1], d)
    return d


def test_offset_overrun_names_file_and_layer(packs, tmp_path):
    d = _copy_pack(packs, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["layers"][1]["offset"] += 4096
    (d / "manifest.json").write_text(json.dumps(m))
    with PackReader(d) as r:
        r.read_expert_rows(0)
        with pytest.raises(PackError, match=r"experts-layer-001\.safetensors: layer 1: expert bytes .* overrun"):
            r.read_expert_rows(1)


def test_offset_disagreeing_with_file_header(packs, tmp_path):
    d = _copy_pack(packs, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["layers"][0]["offset"] -= 128  # still inside the file: only the header cross-check can tell
    (d / "manifest.json").write_text(json.dumps(m))
    with PackReader(d) as r, pytest.raises(PackError, match=r"experts-layer-000\.safetensors: layer 0: manifest says"):
        r.read_expert_rows(0)


def test_truncated_expert_file_is_an_overrun(packs, tmp_path):
    d = _copy_pack(packs, tmp_path)
    f = d / "experts-layer-000.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with PackReader(d) as r, pytest.raises(PackError, match=r"experts-layer-000.*layer 0.*overrun"):
        r.read_expert_rows(0)


def test_corrupt_expert_bytes_fail_hash_check(packs, tmp_path):
    d = _copy_pack(packs, tmp_path)
    with PackReader(d) as r:
        off = r.manifest["layers"][1]["offset"] + 5 * r.layout.row_bytes + 77  # inside expert 5
    f = d / "experts-layer-001.safetensors"
    data = bytearray(f.read_bytes())
    data[off] ^= 0x10
    f.write_bytes(bytes(data))
    with PackReader(d) as r:
        r.verify_expert_hashes(0, r.read_expert_rows(0))
        with pytest.raises(PackError, match=r"layer 1 expert 5: sha256"):
            r.verify_expert_hashes(1, r.read_expert_rows(1))


def test_incomplete_pack_dir_is_rejected(packs, tmp_path):
    d = _copy_pack(packs, tmp_path)
    (d / "manifest.json").unlink()
    with pytest.raises(PackError, match="not a complete pack"):
        PackReader(d)


def test_manifest_layout_mismatch_is_rejected(packs, tmp_path):
    d = _copy_pack(packs, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["row_layout"]["row_bytes"] += 128
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackError, match="malformed manifest"):
        PackReader(d)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["quant_rule"].update(int_range=[-8, 7]), r"quant_rule.int_range is \[-8, 7\]"),
    (lambda m: m["quant_rule"].update(nibble_order="high-first"), "quant_rule.nibble_order"),
    (lambda m: m["layers"][1].update(row_bytes=m["layers"][1]["row_bytes"] + 128), "layer 1 records row_bytes"),
    (lambda m: m.update(block_size=128), "block_size 128 differs"),
])
def test_manifest_format_the_reader_cannot_decode_is_rejected(packs, tmp_path, edit, message):
    d = _copy_pack(packs, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackError, match=message):
        PackReader(d)


# ---- atomicity and CLI ----------------------------------------------------------------------------
def test_interrupted_pack_leaves_nothing(packs, tmp_path, monkeypatch):
    ck, _ = packs["tiny-qwen2-moe", "per-expert"]
    calls = []
    real = pack_mod.pack_layer

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(pack_mod, "pack_layer", boom)
    with pytest.raises(KeyboardInterrupt):
        pack_checkpoint(ck, tmp_path / "out", device="cpu")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force_and_is_replaced_atomically(packs, tmp_path):
    ck, _ = packs["tiny-olmoe", "per-expert"]
    out = tmp_path / "p"
    assert cli_main(["pack", str(ck), str(out), "--device", "cpu", "--no-progress"]) == 0
    first = json.loads((out / "manifest.json").read_text())["created_utc"]
    assert cli_main(["pack", str(ck), str(out), "--device", "cpu", "--no-progress"]) == 1
    assert cli_main(["pack", str(ck), str(out), "--device", "cpu", "--no-progress", "--force",
                     "--block-size", "128"]) == 0
    assert json.loads((out / "manifest.json").read_text())["block_size"] == 128 and first
    assert sorted(os.listdir(tmp_path)) == ["p"]


def test_cli_errors_are_reported_not_raised(tmp_path, capsys):
    assert cli_main(["pack", str(tmp_path / "nope"), str(tmp_path / "o"), "--device", "cpu"]) == 1
    assert "not a directory" in capsys.readouterr().err
    if not torch.cuda.is_available():
        ck = write_synthetic(load_preset("tiny-olmoe")[0], tmp_path / "ck")
        assert cli_main(["pack", str(ck), str(tmp_path / "o"), "--device", "cuda"]) == 1
        assert "cuda" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_synth(tmp_path):
    assert cli_main(["synth", "--preset", "tiny-qwen2-moe", "--seed", "5", "--expert-layout", "fused",
                     "--no-progress", str(tmp_path / "s")]) == 0
    r = CheckpointReader(tmp_path / "s")
    assert set(r.expert_layout.values()) == {"fused"} and r.config == load_preset("tiny-qwen2-moe")[0]
    assert cli_main(["synth", "--preset", "tiny-qwen2-moe", str(tmp_path / "s")]) == 1
    with pytest.raises(SystemExit) as e:  # a usage error, before anything is written
        cli_main(["synth", "--preset", "no-such-model", str(tmp_path / "t")])
    assert e.value.code == 2 and not (tmp_path / "t").exists()


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_cli_synth_pack_validate_new_families(tmp_path, preset, capsys):
    """runmap synth -> runmap pack -> runmap validate for the families added after the seed models, in
    the layout transformers keeps in memory (fused; Mixtral's router then sits at mlp.gate)."""
    from runmap.conformance.schemas import validate_file

    ck, pk = tmp_path / "ck", tmp_path / "pk"
    assert cli_main(["synth", "--preset", preset, "--seed", "2", "--expert-layout", "fused", "--no-progress", str(ck)]) == 0
    assert cli_main(["pack", str(ck), str(pk), "--device", "cpu"]) == 0
    assert validate_file(pk / "manifest.json", "manifest") == []
    capsys.readouterr()
    assert cli_main(["validate", str(pk)]) == 0, capsys.readouterr()
    cfg = load_preset(preset)[0]
    with PackReader(pk) as r:
        assert r.config == cfg and r.nonrouted_names() == list(cfg.adapter.nonrouted_tensors(cfg))
        router = cfg.adapter.router_tensors(cfg, 0)["router"][0]  # runmap's name in the pack, whatever the source
        assert torch.equal(r.nonrouted(router), CheckpointReader(ck).tensor(router).to(torch.float16))


@pytest.mark.parametrize("kind", ["file", "empty-dir", "other-dir", "half-written-pack"])
def test_force_replaces_only_a_pack(packs, tmp_path, capsys, kind):
    ck, pk = packs["tiny-olmoe", "per-expert"]
    out = tmp_path / "target"
    if kind == "file":
        out.write_text("precious")
    else:
        out.mkdir()
        if kind == "other-dir":
            (out / "notes.txt").write_text("precious")
        if kind == "half-written-pack":
            shutil.copy(pk / "nonrouted.safetensors", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else out.read_bytes()
    rc = cli_main(["pack", str(ck), str(out), "--device", "cpu", "--no-progress", "--force"])
    err = capsys.readouterr().err
    assert rc == 1 and "--force replaces only a pack directory" in err and "Traceback" not in err
    after = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else out.read_bytes()
    assert after == before
    assert sorted(os.listdir(tmp_path)) == ["target"]  # no temporary directory left behind


def test_stale_temporary_of_a_killed_pack_is_removed(packs, tmp_path):
    ck, _ = packs["tiny-olmoe", "per-expert"]
    dead = tmp_path / ".p.tmp-999999999-abcd"  # no such PID
    dead.mkdir()
    (dead / "nonrouted.safetensors").write_bytes(b"partial")
    alive = tmp_path / f".p.tmp-{os.getppid()}-abcd"  # a live process: another pack still writing
    alive.mkdir()
    pack_checkpoint(ck, tmp_path / "p", device="cpu")
    assert sorted(os.listdir(tmp_path)) == sorted([".p.tmp-%d-abcd" % os.getppid(), "p"])
