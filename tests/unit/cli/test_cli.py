"""The ``moetune`` command: every subcommand registers, --help works, errors exit 2 with the message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moetune.cli.main import SUBCOMMANDS, build_parser, main


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([name, "--help"] if name != "bench" else ["bench", "engine", "--help"])
        assert exit_info.value.code == 0
        assert "usage: moetune" in capsys.readouterr().out


def test_console_script_starts_fast_and_lists_commands():
    out = subprocess.run(
        [sys.executable, "-m", "moetune.cli.main", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in SUBCOMMANDS:
        assert name in out


def test_user_error_exits_2_with_message(capsys, tmp_path):
    rc = main(["bench", "engine", "--quick", "--json", str(tmp_path / "missing" / "out.json")])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-5", "0", "many"])
def test_max_new_tokens_must_be_positive(capsys, value):
    """Refused by the parser (exit 2, the option named) before any model is read."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "nowhere", "--prompt", "hi", "--max-new-tokens", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens" in err and value in err


def test_trust_remote_code_reaches_the_loader(monkeypatch):
    from moetune.train import generation

    seen = {}

    def fake(model, adapter, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)  # stop before generating

    monkeypatch.setattr(generation, "load_for_inference", fake)
    for argv in (["generate", "--prompt", "hi"], ["chat"]):
        seen.clear()
        with pytest.raises(SystemExit):
            main([*argv, "--model", "m", "--trust-remote-code"])
        assert seen["trust_remote_code"] is True
