"""Generation: batching vs unbatched, sampling, stop rules, streaming, tokenizer, CLI, telemetry schema.

Fast properties run against a fake StepModel (logits scripted per step); end-to-end checks use the
tiny packed checkpoints with the reference executor.
"""
import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runmap.engine.engine import Engine
from runmap.engine.generation import GenerationError, generate_batch, sample
from test_model_support import build_packs

V = 16


@pytest.fixture(scope="session")
def packs(tmp_path_factory):
    return build_packs(tmp_path_factory)


@pytest.fixture(scope="module")
def olmoe(packs):
    return Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", max_batch=4, max_seq_len=48)


class Scripted:
    """A StepModel whose row b emits script[b][s] at step s (one-hot logits)."""

    device = torch.device("cpu")
    max_seq_len = 64

    def __init__(self, script):
        self.script, self.calls = script, []

    def _logits(self, s):
        out = torch.full((len(self.script), V), -10.0)
        for b, seq in enumerate(self.script):
            out[b, seq[min(s, len(seq) - 1)]] = 10.0
        return out

    def prefill(self, tokens, pad):
        self.calls.append(("prefill", tokens.clone(), pad.clone()))
        return self._logits(0)

    def decode(self, tokens, slot, pad):
        self.calls.append(("decode", tokens.clone(), slot))
        return self._logits(slot - self.calls[0][1].shape[1] + 1)


def letters(ids):
    return "".join("abcdefghijklmnop"[i] for i in ids)


def test_eos_stops_a_row_and_is_not_kept():
    m = Scripted([[3, 4, 1, 5, 6], [7, 7, 7, 7, 7]])
    res, timing = generate_batch(m, [[2, 2], [2]], max_new_tokens=5, pad_id=0, eos_ids={1}, decode=letters)
    assert res[0].token_ids == [3, 4] and res[0].finish_reason == "eos" and res[0].text == "de"
    assert res[1].token_ids == [7] * 5 and res[1].finish_reason == "length"
    prefill = m.calls[0]
    assert prefill[1].tolist() == [[2, 2], [0, 2]] and prefill[2].tolist() == [0, 1]  # left padding
    assert timing.new_tokens == 7 and timing.prompt_tokens == 3


@given(st.lists(st.lists(st.integers(2, V - 1), min_size=1, max_size=8), min_size=1, max_size=3),
       st.sampled_from(["", "c", "de", "ffg"]))
def test_streamed_deltas_concatenate_to_the_final_text(script, stop):
    m = Scripted(script)
    got = {}
    res, _ = generate_batch(m, [[2]] * len(script), max_new_tokens=8, pad_id=0, decode=letters,
                            stop=(stop,) if stop else (), on_token=lambda r, t, d: got.setdefault(r, []).append(d))
    for b, r in enumerate(res):
        assert "".join(got.get(b, [])) == r.text
        full = letters((script[b] + [script[b][-1]] * 8)[:8])
        if stop and stop in full:
            assert r.finish_reason == "stop" and r.text == full[:full.index(stop)]
        else:
            assert r.finish_reason == "length" and r.text == full


def test_sampling_greedy_topp_and_seed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    assert torch.equal(sample(logits, 0.0, 1.0, None), logits.argmax(-1))
    assert torch.equal(sample(logits, 1.0, 1e-6, torch.Generator().manual_seed(1)), logits.argmax(-1))
    a = sample(logits.repeat(50, 1), 1.0, 0.9, torch.Generator().manual_seed(5))
    b = sample(logits.repeat(50, 1), 1.0, 0.9, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    # top-p 0.5 only ever draws from the smallest prefix of sorted tokens reaching 0.5
    probs = torch.softmax(logits[0], -1)
    sp, si = probs.sort(descending=True)
    allowed = set(si[: int((sp.cumsum(0) < 0.5).sum()) + 1].tolist())
    draws = sample(logits[:1].repeat(400, 1), 1.0, 0.5, torch.Generator().manual_seed(2))
    assert set(draws.tolist()) <= allowed and len(set(draws.tolist())) == len(allowed)


def test_bad_arguments_are_errors():
    m = Scripted([[3]])
    with pytest.raises(GenerationError, match="exceeds the KV cache"):
        generate_batch(m, [[2] * 60], max_new_tokens=10, pad_id=0, decode=letters)
    with pytest.raises(GenerationError, match="top_p"):
        generate_batch(m, [[2]], max_new_tokens=2, pad_id=0, decode=letters, temperature=1.0, top_p=0.0)


def test_empty_stop_string_is_refused():
    with pytest.raises(GenerationError, match="empty stop string"):
        generate_batch(Scripted([[3, 4]]), [[2]], max_new_tokens=2, pad_id=0, decode=letters, stop=("",))


def test_ttft_excludes_the_first_decode_step():
    import time

    class Slow(Scripted):
        def prefill(self, tokens, pad):
            time.sleep(0.05)
            return super().prefill(tokens, pad)

        def decode(self, tokens, slot, pad):
            time.sleep(0.5)
            return super().decode(tokens, slot, pad)

    _, timing = generate_batch(Slow([[3, 4, 5]]), [[2]], max_new_tokens=2, pad_id=0, decode=letters)
    assert 0.05 <= timing.ttft_s < 0.4  # the prefill, not the prefill plus the 0.5 s decode queued after it
    assert timing.decode_s >= 0.5


def test_seeded_groups_do_not_repeat_each_other(packs):
    eng = Engine.from_pack(packs["tiny-olmoe"], executor="reference", device="cpu", max_batch=2, max_seq_len=48)
    out = eng.generate([[5, 6, 7]] * 4, max_new_tokens=12, temperature=1.0, seed=3)
    assert out[0].token_ids != out[2].token_ids  # group 2 starts from its own seed, not group 1's again
    again = eng.generate([[5, 6, 7]] * 4, max_new_tokens=12, temperature=1.0, seed=3)
    assert [r.token_ids for r in again] == [r.token_ids for r in out]  # still reproducible


def test_batched_prompts_of_different_lengths_match_unbatched(olmoe):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 2], [40, 41, 42, 43]]
    batched = olmoe.generate(prompts, max_new_tokens=4, ignore_eos=True)
    assert olmoe.last_timing["batch"] == 3 and olmoe.last_timing["new_tokens"] == 12
    for p, r in zip(prompts, batched):
        single = olmoe.generate([p], max_new_tokens=4, ignore_eos=True)[0]
        assert single.token_ids == r.token_ids and single.prompt_tokens == len(p)


def test_seeded_sampling_is_reproducible(olmoe):
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, ignore_eos=True)
    a = olmoe.generate(["hello world"], seed=3, **kw)[0].token_ids
    b = olmoe.generate(["hello world"], seed=3, **kw)[0].token_ids
    c = olmoe.generate(["hello world"], seed=4, **kw)[0].token_ids
    assert a == b and a != c


def test_stop_string_and_streaming_end_to_end(olmoe):
    full = olmoe.generate(["the"], max_new_tokens=10, ignore_eos=True)[0]
    assert len(full.text) >= 4, full.text
    stop = full.text[2:4]
    pieces = []
    r = olmoe.generate(["the"], max_new_tokens=10, stop=[stop], ignore_eos=True,
                       on_token=lambda row, tid, d: pieces.append(d))[0]
    assert r.finish_reason == "stop" and r.text == full.text[:full.text.index(stop)]
    assert "".join(pieces) == r.text


def test_chat_template_comes_from_the_pack(olmoe):
    ids = olmoe.tokenizer.encode_chat("hi")
    text = olmoe.tokenizer.hf.decode(ids)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_telemetry_validates_against_its_schema(olmoe, tmp_path):
    from runmap.engine import telemetry
    from runmap.conformance.schemas import validate_file

    olmoe.generate(["a"], max_new_tokens=2)
    path = telemetry.write(tmp_path / "telemetry-run.json", olmoe.telemetry())
    assert validate_file(path) == []
    doc = json.loads(path.read_text())
    doc["executor"] = "magic"
    bad = tmp_path / "telemetry-bad.json"
    bad.write_text(json.dumps(doc))
    assert validate_file(bad) != []


def test_cli_logits_and_generate(packs, olmoe, tmp_path, capsys):
    from safetensors.torch import load_file

    from runmap.cli.main import main

    out = tmp_path / "l.safetensors"
    cmd = ["logits", "--packed", str(packs["tiny-olmoe"]), "--tokens", "5,6,7",
           "--device", "cpu", "--out", str(out)]
    assert main(cmd) == 0
    got = load_file(out)
    assert got["tokens"].tolist() == [5, 6, 7]
    assert torch.allclose(got["logits"], olmoe.logits([5, 6, 7]), atol=1e-5)
    assert (tmp_path / "telemetry-l.json").is_file()

    tel = tmp_path / "telemetry-gen.json"
    capsys.readouterr()
    cmd = ["generate", "--packed", str(packs["tiny-olmoe"]), "--prompt", "the",
           "--executor", "reference", "--device", "cpu", "--max-new-tokens", "5", "--telemetry", str(tel)]
    assert main(cmd) == 0
    want = olmoe.generate(["the"], max_new_tokens=5)[0]
    assert capsys.readouterr().out == want.text + "\n"
    assert json.loads(tel.read_text())["executor"] == "reference"
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    cwd = os.getcwd()
    os.chdir(run_dir)
    try:  # without --telemetry nothing is written (not into the current directory either)
        assert main(cmd[:-2]) == 0
    finally:
        os.chdir(cwd)
    assert list(run_dir.iterdir()) == []
    with pytest.raises(SystemExit) as exit_info:  # argparse: a usage error, exit status 2
        main(cmd[:-2] + ["--executor", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    # --prefill-chunk: the prompt in passes of 1 token gives the same text; 0 is a usage error naming the option
    assert main(cmd[:-2] + ["--prompt", "the cat sat on", "--prefill-chunk", "1"]) == 0
    assert capsys.readouterr().out == olmoe.generate(["the cat sat on"], max_new_tokens=5)[0].text + "\n"
    with pytest.raises(SystemExit) as exit_info:
        main(cmd[:-2] + ["--prefill-chunk", "0"])
    assert exit_info.value.code == 2 and "--prefill-chunk: must be at least 1, got 0" in capsys.readouterr().err
    out2 = tmp_path / "l2.safetensors"
    assert main(["logits", "--packed", str(packs["tiny-olmoe"]), "--tokens", "5,6,7", "--device", "cpu",
                 "--prefill-chunk", "2", "--out", str(out2)]) == 0
    assert torch.allclose(load_file(out2)["logits"], got["logits"], atol=1e-4)


def test_every_eos_id_of_generation_config_stops(packs, tmp_path):
    import shutil

    from runmap.engine.tokenization import Tokenizer

    d = tmp_path / "pack"
    shutil.copytree(packs["tiny-olmoe"], d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert {2, 7} <= Tokenizer(d).eos_ids
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match="eos_token_id must be an integer"):
        Tokenizer(d)


# ---- a row's text from a window of its last tokens (runmap.engine.generation._Row) -----------------------------

def _sentencepiece_style_tokenizer():
    """A tokenizers-library tokenizer decoded as Llama / Mistral ones are: Metaspace pieces ("▁" = space),
    byte-fallback tokens <0x..> fused into UTF-8, the leading space of every decode call stripped."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["▁the", "▁sea", "▁sky", "▁", "a", "b", "é", "▁über", "世", "界", "▁x", "y"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok, len(pieces)


def _synthetic_tokenizer(preset):
    import tempfile

    from runmap.arch.config import load_preset
    from runmap.engine.tokenization import Tokenizer
    from runmap.synth.tokenizer import write_tokenizer

    d = tempfile.mkdtemp(prefix="tok-")
    cfg, _ = load_preset(preset)
    write_tokenizer(cfg, d)
    return Tokenizer(d), cfg.vocab_size


_TOKENIZERS = {}


def _decoder(kind):
    if kind not in _TOKENIZERS:
        if kind == "sentencepiece-style":
            tok, n = _sentencepiece_style_tokenizer()
            _TOKENIZERS[kind] = (lambda ids: tok.decode(ids, skip_special_tokens=True), n)
        else:
            tok, n = _synthetic_tokenizer(kind)
            _TOKENIZERS[kind] = (tok.decode, n)
    return _TOKENIZERS[kind]


@given(kind=st.sampled_from(["tiny-olmoe", "tiny-qwen2-moe", "tiny-mixtral", "sentencepiece-style"]),
       draws=st.lists(st.integers(0, 10**9), min_size=1, max_size=60), low=st.booleans())
def test_a_rows_text_is_the_decode_of_all_its_ids_after_every_token(kind, draws, low):
    """Whatever the ids (specials, lone UTF-8 bytes that leave a character unfinished for several tokens, pieces
    whose leading space a decode call strips), the text after each token equals decoding every id from the
    start, and the streamed deltas concatenate to it."""
    from runmap.engine.generation import _Row

    decode, n = _decoder(kind)
    # low: ids among the first 300 (the byte alphabet and specials of the byte-level vocabularies: unfinished
    # characters); otherwise anywhere in the vocabulary
    ids = [d % min(n, 300) if low else d % n for d in draws]
    deltas = []
    row = _Row(0, 1, decode, (), frozenset(), lambda _i, _t, delta: deltas.append(delta))
    for k, t in enumerate(ids, 1):
        row.push(t, 10**6)
        assert row.text == decode(ids[:k]), (kind, ids[:k])
    row._finish("length")
    assert row.text == decode(ids)
    if kind.startswith("tiny-"):
        # streaming needs a text that only grows: byte-level BPE's does; byte fallback can turn an emitted valid
        # byte into U+FFFD once the run of byte tokens goes on (<0x00> alone is "\x00", <0x00><0x80> is two U+FFFD),
        # with or without the window
        assert "".join(deltas) == row.text


@given(kind=st.sampled_from(["tiny-olmoe", "tiny-qwen2-moe", "tiny-mixtral"]),
       draws=st.lists(st.integers(0, 10**9), max_size=40))
def test_the_tokenizers_direct_decode_is_transformers_decode(kind, draws):
    """Tokenizer.decode skips transformers' per-id Python walk by calling the Rust tokenizer, which must give what
    transformers' decode gives (special tokens left out, no space clean-up), for any ids."""
    tok, n = _synthetic_tokenizer_cached(kind)
    ids = [d % n for d in draws]
    assert tok._backend_decode is not None
    assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_a_tokenizer_class_that_overrides_decoding_keeps_transformers_path():
    from runmap.engine.tokenization import _direct_decode

    tok, _ = _synthetic_tokenizer_cached("tiny-olmoe")
    base = type(tok.hf)
    for name in ("decode", "_decode"):
        custom = type("Custom", (base,), {name: lambda self, *a, **k: "custom"})
        hf = object.__new__(custom)
        hf.__dict__.update(tok.hf.__dict__)
        assert _direct_decode(hf) is None, name
    assert _direct_decode(tok.hf) is not None


def _synthetic_tokenizer_cached(kind):
    key = ("tokenizer", kind)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _synthetic_tokenizer(kind)
    return _TOKENIZERS[key]
