"""Tokenizer and chat template from a checkpoint / pack directory, strictly offline.

The directory must hold ``tokenizer.json`` (and normally ``tokenizer_config.json`` with the chat template).
transformers' AutoTokenizer is called with ``local_files_only=True`` on the directory path, so nothing is
ever fetched from a hub; a missing file is an error naming the directory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class TokenizerError(ValueError):
    """The tokenizer files are missing or unusable (e.g. --chat without a chat template)."""


def _generation_config_eos(d: Path) -> list[int]:
    """Every end-of-sequence id of generation_config.json (chat models often list several, e.g. an
    end-of-turn token besides the end-of-text one); [] when the file is absent."""
    path = d / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
    ids = eos if isinstance(eos, list) else [eos]
    if any(t is not None and not isinstance(t, int) for t in ids):
        raise TokenizerError(f"{path}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    return [t for t in ids if t is not None]


class Tokenizer:
    """Thin wrapper: encode / decode / chat-format, plus the set of end-of-sequence ids."""

    def __init__(self, directory: str | Path, eos_token_id: int | None = None):
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise TokenizerError(f"{d}: no tokenizer.json (the pack / checkpoint directory must ship its tokenizer)")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except Exception as e:  # surface which directory failed, keep the cause
            raise TokenizerError(f"{d}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
        self.directory = d
        self._backend_decode = _direct_decode(self.hf)
        eos = {eos_token_id, self.hf.eos_token_id, *_generation_config_eos(d)}
        self.eos_ids = frozenset(int(t) for t in eos if t is not None)
        self.pad_id = self.hf.pad_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, with the tokenizer's own special-token rules (e.g. a BOS if it adds one)."""
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, user_text: str | list[dict]) -> list[int]:
        """One user message (or a list of {role, content} messages) -> ids of the chat-formatted prompt
        with the generation prompt appended."""
        if not self.has_chat_template:
            raise TokenizerError(f"{self.directory}: tokenizer_config.json has no chat_template; --chat needs one")
        messages = [{"role": "user", "content": user_text}] if isinstance(user_text, str) else user_text
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # the template already contains any BOS / special tokens it wants: do not add more
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """ids -> text, special tokens left out, spaces as decoded. Called for every generated token of every row
        (runmap.engine.generation), so it goes straight to the Rust tokenizer where that is exactly what
        transformers' decode would do."""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=True)
        return self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _direct_decode(hf):
    """The tokenizers-library decode that ``hf.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    reduces to, or None when ``hf`` is not a plain tokenizers-backed tokenizer. transformers' decode first walks the
    ids in Python (to_py_obj: an isinstance per id, ~0.2 ms per call at a few hundred ids) and its _decode then calls
    exactly the backend's decode; a class that overrides either keeps the full path."""
    backend = getattr(hf, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None

    def defined_in(name):
        owner = next((c for c in type(hf).__mro__ if name in c.__dict__), None)
        return owner.__module__ if owner is not None else None
    if (defined_in("decode") != "transformers.tokenization_utils_base"
            or defined_in("_decode") != "transformers.tokenization_utils_tokenizers"):
        return None
    return backend.decode
