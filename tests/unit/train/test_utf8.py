"""``check_utf8``: a dataset file that is not UTF-8 is named with the line of its first bad byte, whatever the
chunk boundaries; valid multi-byte characters split across chunks pass."""

from __future__ import annotations

import pytest

from moetune.errors import DataError
from moetune.train import data


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 1 << 24])
def test_split_characters_pass(tmp_path, monkeypatch, chunk) -> None:
    monkeypatch.setattr(data, "_UTF8_CHUNK", chunk)
    path = tmp_path / "ok.jsonl"
    path.write_text('{"text": "café ☕ 𝄞"}\n{"text": "naïve"}\n', encoding="utf-8")
    data.check_utf8("ok", path)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 24])
def test_the_first_bad_byte_is_named_by_line(tmp_path, monkeypatch, chunk) -> None:
    monkeypatch.setattr(data, "_UTF8_CHUNK", chunk)
    path = tmp_path / "bad.jsonl"
    good = '{"text": "café"}\n'.encode()
    path.write_bytes(good * 3 + b'{"text": "caf\xe9"}\n' + b"\xff\n")
    with pytest.raises(DataError, match=r"bad.jsonl is not UTF-8 text: line 4 \(byte 67\) holds b'\\xe9'"):
        data.check_utf8("bad", path)


def test_a_truncated_character_at_the_end(tmp_path) -> None:
    path = tmp_path / "cut.txt"
    path.write_bytes(b"ok\ncaf" + "é".encode()[:1])
    with pytest.raises(DataError, match="line 2"):
        data.check_utf8("cut", path)
