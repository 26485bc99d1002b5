"""Build a small byte-level BPE tokenizer offline whose vocabulary matches a model's vocab_size exactly.

The synthetic checkpoints need a tokenizer so that the generate / IFEval paths run end to end:
every id the model can emit (0 .. vocab_size-1) must decode, and the special ids in config.json
(eos, pad, bos) must be the tokenizer's special tokens. The BPE merges are learned from the
embedded ``synth_corpus.CORPUS``; ids left over after the specials, the 256 byte tokens and the
learned merges are filled with ``<|filler_N|>`` tokens (decodable, never produced by encoding).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from runmap.arch.config import ModelConfig
from runmap.synth.corpus import CORPUS

PAD, EOS, BOS = "<pad>", "<|endoftext|>", "<|startoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MAX_MERGES = 4000  # the corpus supports far fewer; bounds training time for big vocabularies

# ChatML, the format of OLMoE-Instruct's and Qwen-Chat's templates.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _learn_bpe(max_tokens: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Train byte-level BPE on the embedded corpus. Returns (tokens in id order, merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=max_tokens, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return tokens, merges


def build_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """A tokenizers.Tokenizer with exactly cfg.vocab_size ids; specials at cfg's pad/eos/bos ids."""
    v = cfg.vocab_size
    fixed: dict[int, str] = {}
    for tid, tok in ((cfg.pad_token_id, PAD), (cfg.eos_token_id, EOS), (cfg.bos_token_id, BOS)):
        if tid is None or tid in fixed:
            continue
        if not 0 <= tid < v:
            raise ValueError(f"special token id {tid} ({tok}) outside vocab_size {v}")
        fixed[tid] = tok
    specials = list(dict.fromkeys([*fixed.values(), IM_START, IM_END]))
    n_free = v - len(fixed) - 2  # ids for the chat tokens, bytes, merges and fillers
    if n_free < 256 + 2:
        raise ValueError(f"vocab_size {v} too small for 256 byte tokens plus {len(specials)} specials")
    learned, merges = _learn_bpe(min(n_free - 2, 256 + MAX_MERGES))
    fill = [IM_START, IM_END] + learned
    fill += [f"<|filler_{j}|>" for j in range(v - len(fixed) - len(fill))]
    it = iter(fill)
    vocab = {}
    for tid in range(v):
        vocab[fixed[tid] if tid in fixed else next(it)] = tid
    assert len(vocab) == v
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def write_tokenizer(cfg: ModelConfig, out_dir: str | Path) -> list[str]:
    """Write tokenizer.json + tokenizer_config.json into out_dir. Returns the file names written."""
    out = Path(out_dir)
    tok = build_tokenizer(cfg)
    tok.save(str(out / "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS if cfg.eos_token_id is not None else None,
        "pad_token": PAD if cfg.pad_token_id is not None else None,
        "bos_token": BOS if cfg.bos_token_id is not None and cfg.bos_token_id != cfg.eos_token_id else
        (EOS if cfg.bos_token_id is not None else None),
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]
