"""The CPU rehearsal of the llama.cpp peer's conversion (issue 25 item 5): llama.cpp's own converter, from the
trimmed source tarball the device call carries, turns a tiny synthetic OLMoE checkpoint into GGUF.

* benchmarks/llama_cpp_convert.py converts `runmap synth --preset tiny-olmoe --init routing` to an f16 GGUF: the
  converter's pre-tokenizer check is answered "gpt-2" (printed, with the converter's warning about the unknown
  hash), the GGUF says olmoe with the preset's layers, experts and top-k, and its tensors are the checkpoint's
  (token embeddings, a router, and one expert's gate / up / down projections taken from the stacked
  ffn_*_exps tensors at that expert's index), to f16 rounding;
* a checkpoint that is not runmap's synthetic one still gets the converter's own refusal;
* tiny-qwen2-moe converts too (qwen2moe, the shared expert and its gate kept): the first step of a Qwen1.5-MoE row.

Needs .llama-cpp/llama-cpp-src.tar.gz (ignored by git; `python benchmarks/llama_cpp_source.py` writes it from
PyPI); without it the module is skipped, as in CI. About 15-25 s on the 2-core machine (three converter runs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TARBALL = REPO / ".llama-cpp" / "llama-cpp-src.tar.gz"
CONVERTER_PARTS = ("llama.cpp/convert_hf_to_gguf.py", "llama.cpp/conversion/", "llama.cpp/gguf-py/",
                   "llama.cpp/RUNMAP_SOURCE.json")

pytestmark = pytest.mark.skipif(
    not TARBALL.is_file(),
    reason=f"no {TARBALL.relative_to(REPO)} (ignored by git, absent in CI): `python benchmarks/llama_cpp_source.py` "
           "writes it from the pinned llama-cpp-python sdist")

# Dump a GGUF's metadata and some tensors as JSON, with the source's own gguf-py (run with it on PYTHONPATH).
DUMP = r"""
import json, sys
import numpy as np
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
meta = {}
for k, f in r.fields.items():
    if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.pre", "tokenizer.ggml.model"):
        continue
    v = f.contents()
    meta[k] = v if isinstance(v, (str, int, float, list)) else str(v)
want = sys.argv[2].split(",")
tensors = {t.name: {"shape": [int(x) for x in t.shape], "type": t.tensor_type.name,
                    "data": np.asarray(t.data, dtype=np.float32).tolist() if t.name in want else None}
           for t in r.tensors}
print(json.dumps({"meta": meta, "tensors": tensors}))
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """Only the converter's part of the tarball (the C++ tree is not needed to convert)."""
    d = tmp_path_factory.mktemp("llama-cpp")
    with tarfile.open(TARBALL) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(CONVERTER_PARTS)]
        tf.extractall(d, members=members, filter="data")
    return d / "llama.cpp"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from runmap.arch.config import load_preset
    from runmap.synth.checkpoint import write_synthetic

    return write_synthetic(load_preset("tiny-olmoe")[0], tmp_path_factory.mktemp("ck") / "tiny-olmoe", seed=0,
                           init="routing")


def _convert(source: Path, ck: Path, out: Path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source), str(REPO)]), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "llama_cpp_convert.py"), str(ck),
                           "--outtype", "f16", "--outfile", str(out)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def _dump(source: Path, gguf: Path, want: list[str]) -> dict:
    """{"meta": ..., "tensors": ...} of a GGUF, the tensors named in ``want`` with their data (DUMP)."""
    d = subprocess.run([sys.executable, "-c", DUMP, str(gguf), ",".join(want)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(source / "gguf-py")), timeout=120)
    assert d.returncode == 0, d.stderr[-3000:]
    return json.loads(d.stdout)


@pytest.fixture(scope="module")
def converted(source, checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny-olmoe-f16.gguf"
    r = _convert(source, checkpoint, out)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    want = ["token_embd.weight", "blk.1.ffn_gate_inp.weight", "blk.1.ffn_gate_exps.weight",
            "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"]
    return {"proc": r, "out": out, **_dump(source, out, want)}


def test_the_source_is_the_pinned_one(source):
    src = json.loads((source / "RUNMAP_SOURCE.json").read_text())
    meta = json.loads((TARBALL.parent / "llama-cpp-src.json").read_text())
    assert src["package"] == "llama-cpp-python" and src["version"] == meta["version"]
    assert src["llama_cpp_commit"] == meta["llama_cpp_commit"]


def test_the_pre_tokenizer_check_is_answered_gpt2(converted):
    log = converted["proc"].stdout + converted["proc"].stderr
    assert "BPE pre-tokenizer was not recognized" in log  # the converter's own lookup ran and failed
    assert "pre-tokenizer answer: gpt-2" in log
    assert converted["meta"]["tokenizer.ggml.pre"] == "gpt-2"
    assert converted["meta"]["tokenizer.ggml.model"] == "gpt2"


def test_the_gguf_has_the_presets_olmoe(converted):
    from runmap.arch.config import load_preset

    cfg = load_preset("tiny-olmoe")[0]
    m = converted["meta"]
    assert m["general.architecture"] == "olmoe"
    assert m["olmoe.block_count"] == cfg.num_layers
    assert m["olmoe.expert_count"] == cfg.num_experts and m["olmoe.expert_used_count"] == cfg.top_k
    assert m["olmoe.embedding_length"] == cfg.hidden_size
    t = converted["tensors"]
    # ggml lists dimensions fastest first: (in, out, experts)
    assert t["blk.0.ffn_gate_exps.weight"]["shape"] == [cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts]
    assert t["blk.0.ffn_down_exps.weight"]["shape"] == [cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts]
    assert t["blk.0.ffn_gate_exps.weight"]["type"] == "F16"


def test_the_gguf_tensors_are_the_checkpoints(converted, checkpoint):
    import numpy as np
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(checkpoint / "model.safetensors"))
    t = converted["tensors"]

    def same(gguf_name, tensor):  # the checkpoint's bf16 values in the GGUF tensor's type (F16, or F32: exact)
        got = np.asarray(t[gguf_name]["data"], dtype=np.float32)
        dtype = {"F16": torch.float16, "F32": torch.float32}[t[gguf_name]["type"]]
        want = tensor.to(dtype).to(torch.float32).numpy()
        assert got.shape == want.shape, (gguf_name, got.shape, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=gguf_name)

    same("token_embd.weight", sd["model.embed_tokens.weight"])
    same("blk.1.ffn_gate_inp.weight", sd["model.layers.1.mlp.gate.weight"])
    assert t["blk.1.ffn_gate_inp.weight"]["type"] == "F32"  # the converter keeps routers in F32
    e = 5  # one expert, from the middle of the stack: the stacking order is the experts' index
    for proj in ("gate", "up", "down"):
        stacked = np.asarray(t[f"blk.1.ffn_{proj}_exps.weight"]["data"], dtype=np.float32)
        got = torch.from_numpy(stacked[e])
        want = sd[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"].to(torch.float16).to(torch.float32)
        assert torch.equal(got, want), proj


def test_a_checkpoint_that_is_not_synthetic_keeps_the_converters_refusal(source, checkpoint, tmp_path):
    ck = tmp_path / "not-synthetic"
    ck.mkdir()
    for f in checkpoint.iterdir():
        (ck / f.name).symlink_to(f)
    (ck / "config.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("runmap_synthetic")
    (ck / "config.json").write_text(json.dumps(config))
    r = _convert(source, ck, tmp_path / "x.gguf")
    assert r.returncode != 0
    log = r.stdout + r.stderr
    assert "not a runmap synthetic checkpoint" in log
    assert "NotImplementedError: BPE pre-tokenizer was not recognized" in log
    assert not (tmp_path / "x.gguf").exists()


def test_a_qwen2_moe_checkpoint_converts_with_its_shared_expert(source, tmp_path):
    """The same converter on tiny-qwen2-moe (Qwen1.5-MoE's layout: a shared expert with its own gate): the GGUF says
    qwen2moe with the preset's layers, experts and top-k, keeps the shared expert, and one routed expert's gate
    projection is the checkpoint's. What a Qwen1.5-MoE row beside llama.cpp (issue 25 item 6) converts first."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from runmap.arch.config import load_preset
    from runmap.synth.checkpoint import write_synthetic

    cfg = load_preset("tiny-qwen2-moe")[0]
    ck = write_synthetic(cfg, tmp_path / "tiny-qwen2-moe", seed=0, init="routing")
    out = tmp_path / "tiny-qwen2-moe-f16.gguf"
    r = _convert(source, ck, out)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "pre-tokenizer answer: gpt-2" in r.stdout + r.stderr
    g = _dump(source, out, ["blk.1.ffn_gate_exps.weight", "blk.1.ffn_gate_inp_shexp.weight"])
    m, t = g["meta"], g["tensors"]
    assert m["general.architecture"] == "qwen2moe" and m["qwen2moe.block_count"] == cfg.num_layers
    assert m["qwen2moe.expert_count"] == cfg.num_experts and m["qwen2moe.expert_used_count"] == cfg.top_k
    assert m["qwen2moe.expert_shared_feed_forward_length"] == cfg.shared_expert_intermediate_size
    assert t["blk.1.ffn_gate_shexp.weight"]["shape"] == [cfg.hidden_size, cfg.shared_expert_intermediate_size]
    assert t["blk.1.ffn_gate_inp_shexp.weight"]["shape"] == [cfg.hidden_size, 1]
    sd = load_file(str(ck / "model.safetensors"))
    e = cfg.num_experts - 2
    got = torch.from_numpy(np.asarray(t["blk.1.ffn_gate_exps.weight"]["data"], dtype=np.float32)[e])
    assert torch.equal(got, sd[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].to(torch.float16).float())
    shared_gate = np.asarray(t["blk.1.ffn_gate_inp_shexp.weight"]["data"], dtype=np.float32).reshape(-1)
    assert torch.equal(torch.from_numpy(shared_gate), sd["model.layers.1.mlp.shared_expert_gate.weight"].float()
                       .reshape(-1))
