"""On-disk formats: Hugging Face checkpoints, safetensors I/O, the qpack INT4 row format and packs."""
