"""Benchmarks that print ratios measured side by side (no timed assertions live in tests).

``engine``: the CPU expert engine against a plain autograd loop and transformers' own experts module, with
this machine's roofline (``machine``) and the FLOP model (``flops``). Run it as ``moetune bench engine``.
``model``: training steps and peak host memory of a whole MoE model, moetune against transformers, each
variant in its own process (``model_worker``). Run it as ``python bench/model.py``.
"""
