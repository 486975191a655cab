"""The model benchmark end to end on a tiny random checkpoint: its workers, its JSON, its checks of user
input. Nothing here asserts a speed; the fp32 variants must agree on the loss (same weights, same tokens)."""

from __future__ import annotations

import json

import pytest

from moetune.bench.model import QUICK, REQUIRED_KEYS, ModelBenchConfig, main
from moetune.bench.model_worker import VARIANTS
from moetune.bench.timing import TimingPolicy
from moetune.errors import ConfigError
from moetune.testing.wide import WideShape

TINY = ["--hidden", "64", "--intermediate", "32", "--experts", "8", "--top-k", "2", "--vocab", "128"]


def _run(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "model.json"
    argv = ["--quick", *TINY, "--seq", "16", "--workdir", str(tmp_path), "--json", str(out), *args]
    assert main(argv) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["model.json"]  # the checkpoint was removed
    return json.loads(out.read_text())


def _check(records: list[dict], variants: list[str]) -> dict[str, dict]:
    by_name = {r["variant"]: r for r in records}
    assert list(by_name) == variants
    for rec in records:
        assert set(REQUIRED_KEYS) <= set(rec), set(REQUIRED_KEYS) - set(rec)
        assert (rec["layers"], rec["hidden"], rec["experts"], rec["top_k"], rec["seq"]) == (2, 64, 8, 2, 16)
        assert rec["note"] == "" and rec["samples"] >= 1
        assert rec["tokens_per_s"] == pytest.approx(16 / (rec["fwd_ms"] + rec["bwd_ms"]) * 1e3)
        assert rec["peak_rss_mib"] >= rec["rss_after_load_mib"] > 0
        engine = rec["impl"] == "moetune"
        assert rec["experts_impl"].startswith("moetune engine" if engine else "transformers")
        assert (rec["vs_transformers"] is not None) == (engine and f"transformers-{rec['dtype']}" in by_name)
    return by_name


def test_fp32_variants_end_to_end(tmp_path, capsys):
    variants = ["moetune-fp32", "transformers-fp32"]
    by_name = _check(_run(tmp_path, "--variants", *variants, "--reps", "1", "--warmup", "0"), variants)
    assert by_name["moetune-fp32"]["loss"] == pytest.approx(by_name["transformers-fp32"]["loss"], abs=1e-5)
    printed = capsys.readouterr().out
    assert "moetune-fp32" in printed and "vs hf" in printed and "wrote 2 records" in printed


@pytest.mark.slow
def test_every_variant_quick(tmp_path):
    by_name = _check(_run(tmp_path), list(VARIANTS))
    exact = by_name["transformers-fp32"]["loss"]
    assert by_name["moetune-fp32"]["loss"] == pytest.approx(exact, abs=1e-5)
    for name in ("moetune-bf16", "transformers-bf16"):
        assert by_name[name]["loss"] == pytest.approx(exact, abs=0.05)  # bf16 rounding of O(5) losses


def test_config_errors_are_listed_at_once(tmp_path):
    bad = ModelBenchConfig(
        shape=WideShape(layers=0, experts=4, top_k=8),
        variants=("moetune-fp8",),
        timing=TimingPolicy(reps=0),
        checkpoint=tmp_path,
    )
    with pytest.raises(ConfigError) as e:
        bad.validate()
    for needle in (
        "layers must be",
        "top_k must be <= experts (4)",
        "moetune-fp8",
        "reps >= 1",
        "config.json",
    ):
        assert needle in str(e.value)
    QUICK.validate()
    assert main(["--quick", "--json", str(tmp_path / "no" / "such.json")]) == 2
