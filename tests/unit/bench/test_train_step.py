"""The training-step benchmark end to end on a tiny random checkpoint, and ``moetune bench all``'s JSON and
Markdown. Nothing here asserts a speed."""

from __future__ import annotations

import json

import pytest

from moetune.bench import suite
from moetune.bench.model import REQUIRED_KEYS
from moetune.bench.train_step import default_variants, main, native_dtype
from moetune.cli.main import main as cli
from moetune.sysinfo import cpu_info

TINY = [
    "--hidden",
    "64",
    "--intermediate",
    "32",
    "--experts",
    "8",
    "--top-k",
    "2",
    "--vocab",
    "128",
    "--seq",
    "16",
]


def test_train_step_fp32_end_to_end(tmp_path, capsys):
    out = tmp_path / "ts.json"
    argv = [
        "--quick",
        *TINY,
        "--variants",
        "moetune-fp32",
        "transformers-fp32",
        "--reps",
        "1",
        "--warmup",
        "0",
    ]
    assert main([*argv, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    records = {r["variant"]: r for r in json.loads(out.read_text())}
    assert list(records) == ["moetune-fp32", "transformers-fp32"]
    for rec in records.values():
        assert set(REQUIRED_KEYS) <= set(rec)
        assert (rec["lora_rank"], rec["accumulation"], rec["seq"], rec["note"]) == (8, 4, 16, "")
        assert rec["opt_ms"] > 0  # an AdamW step ran
        assert rec["step_ms"] == pytest.approx(rec["fwd_ms"] + rec["bwd_ms"] + rec["opt_ms"])
        assert rec["tokens_per_s"] == pytest.approx(4 * 16 / rec["step_ms"] * 1e3)
        assert rec["peak_rss_mib"] >= rec["rss_after_load_mib"] > 0
    moe, hf = records["moetune-fp32"], records["transformers-fp32"]
    assert moe["experts_impl"].startswith("moetune engine")
    assert hf["experts_impl"] == "transformers grouped_mm"
    # the same LoRA on both sides: stock PEFT's targets hold as many parameters as moetune's attach_lora
    assert moe["trainable_params"] == hf["trainable_params"] > 0
    # LoRA B starts at zero, so the first step's loss is the base model's on the same tokens: equal in fp32
    assert moe["loss"] == pytest.approx(hf["loss"], abs=1e-5)
    printed = capsys.readouterr().out
    assert "LoRA r=8" in printed and "4 x batch 1 x 16 tokens" in printed and "vs hf" in printed


def test_the_dtype_follows_the_cpu():
    assert native_dtype().is_floating_point
    expected = "bf16" if cpu_info().native_bf16_gemm else "fp32"
    assert default_variants() == (f"moetune-{expected}", f"transformers-{expected}")


def _check_report(out_dir, names):
    result = json.loads((out_dir / suite.JSON_NAME).read_text())
    assert set(result) == {"runtime", "size", "command", "benchmarks"}
    rt = result["runtime"]
    for key in ("cpu", "isa", "physical_cores", "threads", "torch", "onednn", "transformers", "commit"):
        assert rt[key] not in (None, ""), key
    assert [b["name"] for b in result["benchmarks"]] == names
    for b in result["benchmarks"]:
        assert set(b) >= {"name", "status", "seconds", "shapes", "headline", "records", "output", "error"}
        assert b["shapes"], b["name"]
    md = (out_dir / suite.MARKDOWN_NAME).read_text()
    assert md.startswith("# moetune bench all (tiny)")
    assert f"| torch | {rt['torch']} |" in md and f"| commit | {rt['commit']} |" in md
    for b in result["benchmarks"]:
        assert f"| {b['name']} | {b['status']} |" in md and f"## {b['name']}" in md
    return result


def test_bench_all_tiny_subset(tmp_path, monkeypatch):
    """Two benchmarks (one in-process, one script), the script made to fail: it is recorded with its error,
    the other still runs, and the command exits 1."""
    monkeypatch.setitem(suite.SCRIPT_ARGS["formats"], "tiny", "--no-such-option")
    code = cli(
        [
            "bench",
            "all",
            "--size",
            "tiny",
            "--out",
            str(tmp_path),
            "--only",
            "formats",
            "pipeline",
            "--threads",
            "1",
        ]
    )
    assert code == 1
    result = _check_report(tmp_path, ["pipeline", "formats"])
    pipeline, formats = result["benchmarks"]
    assert pipeline["status"] == "ok" and len(pipeline["records"]) == 3 and "hides" in pipeline["headline"]
    assert formats["status"] == "failed" and "formats.py --no-such-option" in formats["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [suite.JSON_NAME, suite.MARKDOWN_NAME]


def test_bench_all_refuses_bad_arguments_before_running(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    code = cli(["bench", "all", "--size", "tiny", "--out", str(tmp_path / "a_file"), "--only", "nope"])
    assert code == 2
    err = capsys.readouterr().err
    assert "a_file is a file" in err and "'nope'" in err and "train_step" in err
    # a missing folder is not a problem; it is made only once the arguments are good
    assert (
        cli(["bench", "all", "--size", "tiny", "--out", str(tmp_path / "new" / "out"), "--only", "nope"]) == 2
    )
    assert not (tmp_path / "new").exists()


def test_bench_all_makes_its_output_folder(tmp_path):
    out = tmp_path / "new" / "out"
    assert (
        cli(["bench", "all", "--size", "tiny", "--out", str(out), "--only", "pipeline", "--threads", "1"])
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == [suite.JSON_NAME, suite.MARKDOWN_NAME]


@pytest.mark.slow
def test_bench_all_tiny_every_benchmark(tmp_path):
    assert cli(["bench", "all", "--size", "tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
    result = _check_report(tmp_path, suite.ORDER)
    assert all(b["status"] == "ok" for b in result["benchmarks"])
