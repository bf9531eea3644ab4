"""DeepSeek-V3/R1 checkpoints: FP8 -> BF16, HF <-> Megatron (legacy per-rank files), verify, make-tiny."""
