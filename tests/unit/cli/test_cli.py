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


def test_log_level_info_shows_moetune_info_lines(capsys) -> None:
    """moetune's info lines (a rank's CPU pinning, the expert optimizer) never reached the console; the YAML's
    log_level (main process) / log_level_replica (the others) now sets them, warnings only by default."""
    import logging

    from moetune.cli.train import show_logs

    log = logging.getLogger("moetune.dist.affinity")
    root = logging.getLogger("moetune")
    before = (root.level, list(root.handlers))
    try:
        show_logs({}, rank=0)
        log.info("moetune: hidden by default")
        show_logs({"log_level": "info"}, rank=1)  # a replica reads log_level_replica (warning by default)
        log.info("moetune: hidden on a replica")
        show_logs({"log_level": "info"}, rank=0)
        log.info("moetune: pinned to CPUs [0]")
        show_logs({"log_level_replica": "info"}, rank=1)
        log.info("moetune: pinned to CPUs [1]")
        err = capsys.readouterr().err
    finally:
        root.setLevel(before[0])
        root.handlers[:] = before[1]
    assert "pinned to CPUs [0]" in err and "pinned to CPUs [1]" in err and "hidden" not in err
    assert err.count("pinned to CPUs [0]") == 1  # one handler however often it is called
