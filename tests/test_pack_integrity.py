"""Every byte of a pack is covered by a digest (pack format v2).

One flipped bit in each kind of pack file (the non-routed weights, config.json, tokenizer.json, an expert
file) makes `runmap validate` fail naming that file, and makes Engine.from_pack / `runmap generate` refuse
with a message naming it, never produce a different answer. Manifests naming files outside the pack, old
format versions, unrecorded files and half-written packs are refused too.
"""
import json
import os
import re
import shutil

import pytest

from runmap.arch.config import load_preset
from runmap.cli.main import main
from runmap.engine.engine import Engine
from runmap.format.pack import pack_checkpoint
from runmap.format.packfile import PackError, PackReader, check_pack
from runmap.synth.checkpoint import write_synthetic


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    base = tmp_path_factory.mktemp("integrity")
    ck = write_synthetic(load_preset("tiny-olmoe")[0], base / "ck", seed=5)
    return pack_checkpoint(ck, base / "pack", device="cpu")


@pytest.fixture
def copy(pack, tmp_path):
    d = tmp_path / "pack"
    shutil.copytree(pack, d)
    return d


def _manifest(d):
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d, m):
    (d / "manifest.json").write_text(json.dumps(m))


def _flip_bit(d, name):
    """Flip one bit of ``name`` where the change is silent to a parser: inside the tensor data of a
    safetensors file (an expert row for a layer file), in a digit or letter of a JSON file that stays JSON."""
    path = d / name
    data = bytearray(path.read_bytes())
    if name.endswith(".safetensors"):
        with PackReader(d, verify=False) as r:
            layer = next((e for e in r.manifest["layers"] if e["file"] == name), None)
        pos = layer["offset"] + 3 * layer["row_bytes"] + 101 if layer else len(data) - 1001
        data[pos] ^= 0x04
    else:
        for pos in range(len(data) // 2, len(data)):
            c = data[pos]
            if not (48 <= c <= 56 or 97 <= c <= 121):
                continue
            trial = bytearray(data)
            trial[pos] ^= 0x01
            try:
                json.loads(bytes(trial))
            except ValueError:
                continue
            data = trial
            break
        else:
            raise AssertionError(f"no silent bit to flip in {name}")
    path.write_bytes(bytes(data))


def _validate(capsys, *paths):
    rc = main(["validate", *map(str, paths)])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


KINDS = ["nonrouted.safetensors", "config.json", "tokenizer.json", "experts-layer-001.safetensors"]


@pytest.mark.parametrize("name", KINDS)
def test_one_flipped_bit_fails_validate_naming_the_file(copy, capsys, name):
    rc, out = _validate(capsys, copy)
    # the manifest, and the pack's config and tokenizer files against their schemas wherever the pack lies
    assert rc == 0 and "CONFORMANT: 5 files checked" in out and "\nunchecked " not in "\n" + out, out
    _flip_bit(copy, name)
    rc, out = _validate(capsys, copy)
    assert rc == 1 and "NOT CONFORMANT" in out
    fails = [l for l in out.splitlines() if l.startswith("FAIL")]
    assert len(fails) == 1 and f"{copy.name}/{name}: $.files: pack integrity: sha256" in fails[0], out
    assert "Traceback" not in out


@pytest.mark.parametrize("name", KINDS)
def test_one_flipped_bit_is_refused_by_the_engine(copy, capsys, name):
    _flip_bit(copy, name)
    if name.startswith("experts-layer-"):
        # rows are checked where they are read from host storage: the host source's startup check
        with pytest.raises(ValueError, match=r"layer 1 expert 3 sha256"):
            Engine.from_pack(copy, executor="reference", device="cpu", max_batch=1, max_seq_len=16)
        with pytest.raises(PackError, match=r"experts-layer-001\.safetensors: layer 1 expert 3"):
            Engine.from_pack(copy, expert_format="fp16", device="cpu", max_batch=1, max_seq_len=16)
        expect = "layer 1 expert 3"
    else:
        with pytest.raises(PackError, match=rf"{name}: sha256 .* does not match the manifest"):
            Engine.from_pack(copy, executor="reference", device="cpu", max_batch=1, max_seq_len=16)
        expect = name
    rc = main(["generate", "--packed", str(copy), "--prompt", "the", "--executor", "reference",
               "--device", "cpu", "--max-new-tokens", "2"])
    cap = capsys.readouterr()
    assert rc == 1 and expect in cap.err and cap.out == "" and "Traceback" not in cap.err


def test_verification_can_be_skipped_explicitly(copy, monkeypatch):
    _flip_bit(copy, "nonrouted.safetensors")
    with pytest.raises(PackError):
        PackReader(copy)
    r = PackReader(copy, verify=False)
    assert not r.verified and r.bytes_verified == 0
    monkeypatch.setenv("RUNMAP_PACK_VERIFY", "0")
    assert not PackReader(copy).verified
    monkeypatch.setenv("RUNMAP_PACK_VERIFY", "1")
    with pytest.raises(PackError, match="nonrouted.safetensors"):
        PackReader(copy)


def test_verified_open_reports_its_cost(pack):
    r = PackReader(pack)
    small = {n: e["bytes"] for n, e in r.files.items() if not n.startswith("experts-layer-")}
    assert set(small) >= {"nonrouted.safetensors", "config.json", "tokenizer.json"}
    assert r.verified and r.bytes_verified == sum(small.values()) and r.verify_s >= 0


def test_manifest_records_every_file(pack):
    m = _manifest(pack)
    names = [e["file"] for e in m["files"]]
    assert names == sorted(names)
    assert set(names) == {p.name for p in pack.iterdir()} - {"manifest.json"}
    assert m["format"] == {"name": "runmap-qpack", "version": 2}


@pytest.mark.parametrize("edit, where", [
    (lambda m: m["nonrouted"].update(file="../elsewhere.safetensors"), "nonrouted.file"),
    (lambda m: m["nonrouted"].update(file="/tmp/elsewhere.safetensors"), "nonrouted.file"),
    (lambda m: m["layers"][0].update(file="sub/experts-layer-000.safetensors"), "layers[0].file"),
    (lambda m: m["copied_files"].append(".."), "copied_files"),
    (lambda m: m["files"][0].update(file="../x"), "files[0].file"),
])
def test_paths_outside_the_pack_are_rejected(copy, capsys, edit, where):
    outside = copy.parent / "elsewhere.safetensors"
    shutil.copy(copy / "nonrouted.safetensors", outside)  # a loadable file outside: must never be read
    m = _manifest(copy)
    edit(m)
    _write_manifest(copy, m)
    with pytest.raises(PackError, match=re.escape(where) + ".*plain file name inside the pack directory"):
        PackReader(copy)
    with pytest.raises(PackError, match="plain file name"):
        Engine.from_pack(copy, executor="reference", device="cpu")
    rc, out = _validate(capsys, copy)
    assert rc == 1 and "plain file name" in out and "Traceback" not in out


def test_old_format_version_says_repack(copy, capsys):
    m = _manifest(copy)
    m["format"]["version"] = 1
    del m["files"]
    _write_manifest(copy, m)
    with pytest.raises(PackError, match=r"pack format v1 .* repack it"):
        PackReader(copy)
    rc, out = _validate(capsys, copy)
    assert rc == 1 and "repack" in out


def test_unrecorded_missing_and_truncated_files_fail_validate(copy, capsys):
    (copy / "extra.bin").write_bytes(b"x")
    rc, out = _validate(capsys, copy)
    assert rc == 1 and "extra.bin: $.files: pack integrity: not recorded in the manifest" in out
    (copy / "extra.bin").unlink()
    t = copy / "tokenizer_config.json"
    t.write_bytes(t.read_bytes()[:-3])
    os.remove(copy / "generation_config.json")
    problems = dict(check_pack(copy))
    assert "truncated" in problems[str(t)] and "missing" in problems[str(copy / "generation_config.json")]


def test_row_hashes_are_recomputed_by_validate(copy, capsys):
    m = _manifest(copy)
    m["layers"][0]["expert_sha256"][2] = "0" * 64  # files intact, a recorded row digest wrong
    _write_manifest(copy, m)
    rc, out = _validate(capsys, copy)
    assert rc == 1 and "layer 0 expert 2: sha256" in out


def test_half_written_pack_fails_validate(pack, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    killed = tmp_path / ".p.tmp-999999-abcd"  # what a SIGKILLed `runmap pack p` leaves
    shutil.copytree(pack, killed)
    (killed / "manifest.json").unlink()
    shutil.copytree(pack, tmp_path / "good")
    rc, out = _validate(capsys, ".")
    assert rc == 1 and ".p.tmp-999999-abcd/manifest.json: $: missing:" in out and "half-written" in out
    rc, out = _validate(capsys, killed)  # the temporary directory itself, named as the PATH
    assert rc == 1 and "half-written" in out
    shutil.rmtree(killed)
    plain = tmp_path / "plain"
    shutil.copytree(pack, plain)
    (plain / "manifest.json").unlink()
    rc, out = _validate(capsys, plain)
    assert rc == 1 and "plain/manifest.json: $: missing" in out
