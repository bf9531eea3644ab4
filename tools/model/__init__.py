"""What is being trained and how it is cut: the model's dims (from its HF config.json) and a Megatron parallel
layout, shared by tools.launch (preflight, the plan), tools.perf (memory, step time) and tools.weights (the
converters).

Pure data and arithmetic: no torch, no verl, no file formats beyond config.json.
"""
