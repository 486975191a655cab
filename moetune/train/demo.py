"""The embedded demo: a tiny random Qwen3-MoE model, generated locally, learns the demo cipher with LoRA.

``make_demo_model(path)`` writes the model deterministically (``moetune.testing.tiny`` with the vocabulary of
``examples/data/demo_tokenizer``); ``run_demo(config)`` measures held-out exact match, trains with the normal
recipe (``examples/demo_lora.yaml``), and measures again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

DEMO_CONFIG = Path("examples/demo_lora.yaml")
DEMO_TOKENIZER = Path("examples/data/demo_tokenizer")


def make_demo_model(
    path: str | Path,
    tokenizer_dir: str | Path = DEMO_TOKENIZER,
    seed: int = 0,
    family: str = "qwen3_moe",
    **overrides: Any,
) -> Path:
    """Write the demo's tiny Qwen3-MoE (or tiny ``family`` model: ``moetune.testing.tiny``; fp32 safetensors) and
    the demo tokenizer to ``path``; same bytes every time. ``overrides``: config fields to change (e.g.
    ``moe_intermediate_size``)."""
    from transformers import AutoTokenizer

    from moetune.testing.tiny import save_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = save_tiny_model(
        family,
        path,
        seed=seed,
        tokenizer=False,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )
    tokenizer.save_pretrained(out)
    return out


def _heldout_rows(cfg: Any) -> list[dict[str, str]]:
    return json.loads(Path(cfg.data.eval_sources[0].path).read_text())


def run_demo(config: str | Path = DEMO_CONFIG) -> dict[str, Any]:
    """Generate the model if missing, score, train, score again; returns the numbers it prints."""
    from moetune.config import load_config
    from moetune.train.generation import exact_match, load_for_inference
    from moetune.train.recipe import run

    start = time.perf_counter()
    cfg = load_config(config, check_model_path=False)
    model_dir = Path(cfg.model.model_name_or_path)
    if not (model_dir / "config.json").is_file():
        make_demo_model(model_dir)
        print(f"demo model written to {model_dir}")
    cfg = load_config(config)
    rows = _heldout_rows(cfg)
    base, tokenizer = load_for_inference(model_dir, progress=False)
    before = exact_match(base, tokenizer, rows)
    print(f"held-out exact match before training: {before:.0%} ({len(rows)} rows)")
    del base
    result = run(cfg, progress=False)
    model = result.model.eval()
    model.config.use_cache = True
    after = exact_match(model, result.tokenizer, rows)
    wall = time.perf_counter() - start
    print(f"held-out exact match after training:  {after:.0%} ({len(rows)} rows); total {wall:.0f} s")
    return {"before": before, "after": after, "wall_seconds": wall, "summary": result.summary}
