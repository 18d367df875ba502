"""Damaged or hostile input files (a journal after a power loss, receipts files with JSON nested past the
recursion limit): a specific error naming the file and line, exit 2 (or the line counted bad), never an
``unexpected RecursionError/AttributeError`` (exit 3)."""

from __future__ import annotations

import pytest
from genartifact.cli import main
from genartifact.errors import ConfigError
from genartifact.journal import DeliveryJournal

DEEP = "[" * 100_000 + "]" * 100_000


def _journal(tmp_path):
    j = DeliveryJournal(tmp_path / "j.jsonl")
    j.intent(kind="managed_fsspec", object_id="managed_fsspec:local:runs/x.gart", ref={}, sha256="a" * 64,
             byte_count=1)
    return j


@pytest.mark.parametrize("line, message", [
    (b"[1]", "record is a JSON list"),
    (b'"intent"', "record is a JSON str"),
    (b'{"event":"intent","t":1,"kind":"k","object_id":"o","sha256":"s","byte_count":1}', "field 'id'"),
    (b'{"event":"outcome","id":"x","t":1}', "field 'state'"),
    (b'{"event":"intent","id":"x","t":"yesterday","kind":"k","object_id":"o","sha256":"s","byte_count":1}', "'t'"),
    (b"\0\0\0\0\0\0", "is not JSON"),             # a zero-filled block after a power loss
    (b"\xff\xfe{}", "is not JSON"),                # not UTF-8
    (DEEP.encode(), "is not JSON"),                # nested past the recursion limit
])
def test_damaged_journal_line_names_the_line(tmp_path, line, message):
    j = _journal(tmp_path)
    good = j.path.read_bytes()
    j.path.write_bytes(good + line + b"\n" + good)
    with pytest.raises(ConfigError, match=rf"j.jsonl:2.*{message}|j.jsonl:2 {message}"):
        j.deliveries()
    j.path.write_bytes(good + line)  # the same damage as the torn last line of a crash mid-append: skipped
    assert len(j.deliveries()) == 1


def test_reconcile_on_a_damaged_journal_is_a_clean_error(tmp_path, capsys):
    j = _journal(tmp_path)
    j.path.write_bytes(b"[1]\n" + j.path.read_bytes())
    assert main(["reconcile", "--journal", str(j.path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: journal ") and "record is a JSON list" in err


def test_receipts_nested_too_deeply(tmp_path, capsys):
    j = _journal(tmp_path)
    deep = tmp_path / "deep.jsonl"
    deep.write_text(DEEP + "\n")
    assert main(["verify", "--receipts", str(deep)]) == 1
    assert "line 1: not a JSON object" in capsys.readouterr().out
    assert main(["reconcile", "--journal", str(j.path), "--receipts", str(deep)]) == 2
    assert "cannot be read: RecursionError" in capsys.readouterr().err
