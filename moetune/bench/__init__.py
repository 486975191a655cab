"""Benchmarks that print ratios measured side by side (no timed assertions live in tests).

``engine``: the CPU expert engine against a plain autograd loop and transformers' own experts module, with
this machine's roofline (``machine``) and the FLOP model (``flops``). Run it as ``moetune bench engine``.
``model``: training steps and peak host memory of a whole MoE model, moetune against transformers, each
variant in its own process (``model_worker``). Run it as ``python bench/model.py``.
``train_step``: full LoRA training steps (gradient accumulation, AdamW) on the same workers, moetune against
transformers + PEFT with ``grouped_mm`` experts. Run it as ``python bench/train_step.py``.
``pipeline``: the CPU/device schedule of MoE layers with a simulated device (``schedule``): the fraction of
device time hidden behind the CPU's. Run it as ``python bench/pipeline.py``.
``suite``: every benchmark at one size into one JSON and one Markdown table with the runtime tuple
(``runtime``). Run it as ``moetune bench all --out DIR``.
"""
