"""llama.cpp's own `convert_hf_to_gguf.py` on a runmap synthetic checkpoint, with its pre-tokenizer check answered.

The converter hashes the token ids its checkpoint's tokenizer gives for a fixed text and refuses a hash it does
not know (`BPE pre-tokenizer was not recognized`); the synthetic tokenizer's learned merges are in no list.
This wrapper runs the converter unchanged (its `main()`, the same arguments) with one difference: when the
converter's own lookup fails and the checkpoint is a runmap synthetic one whose tokenizer.json splits text
like GPT-2 (ByteLevel with GPT-2's regex, no prefix space, no normalizer, BPE), the answer is
`tokenizer.ggml.pre = "gpt-2"` (runmap.bench.llama_cpp.synthetic_pre_tokenizer: llama.cpp's pre-tokenizer
type with exactly that regex). Any other checkpoint gets the converter's own refusal. The answer and the
unknown hash are printed. It changes no tensor: weights, router and expert layout are converted as the
converter does for OLMoE.

    PYTHONPATH=LLAMA_CPP_DIR:. python3 benchmarks/llama_cpp_convert.py CKPT --outtype bf16 --outfile OUT.gguf

LLAMA_CPP_DIR is the unpacked source (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`; the converter puts
its `gguf-py` on the path itself). Every argument goes to the converter.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from runmap.bench.llama_cpp import PreTokenizerError, synthetic_pre_tokenizer

log = logging.getLogger("runmap-llama-cpp-convert")


def answer_pre_tokenizer_check(text_model_cls) -> None:
    """Wrap text_model_cls.get_vocab_base_pre: the converter's own lookup first; on its refusal, the synthetic
    checkpoint's answer (or the refusal, re-raised, for any other checkpoint)."""
    original = text_model_cls.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError as refusal:
            try:
                answer = synthetic_pre_tokenizer(self.dir_model)
            except PreTokenizerError as e:
                log.error("pre-tokenizer check: %s", e)
                raise refusal
            log.warning("pre-tokenizer check: the converter does not know this tokenizer's hash (printed above); "
                        "%s is a runmap synthetic checkpoint whose tokenizer.json is ByteLevel with GPT-2's regex, "
                        "no normalizer, BPE: tokenizer.ggml.pre = %r", self.dir_model, answer)
            print(f"pre-tokenizer answer: {answer}", flush=True)
            return answer

    text_model_cls.get_vocab_base_pre = get_vocab_base_pre


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    try:
        import convert_hf_to_gguf
        from conversion.base import TextModel
    except ImportError as e:
        sys.exit(f"llama_cpp_convert: cannot import llama.cpp's converter ({e}); put the unpacked llama.cpp source "
                 "on PYTHONPATH (benchmarks/llama_cpp_h200.sh does)")
    answer_pre_tokenizer_check(TextModel)
    sys.argv[0] = str(Path(convert_hf_to_gguf.__file__))
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
