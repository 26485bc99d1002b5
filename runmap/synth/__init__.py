"""Synthetic stand-ins: Hugging Face checkpoints with the real tensor names and layouts, a tokenizer and
a small corpus, drawn deterministically from a seed."""
