"""``inspect``/``verify`` with hostile object references: one ``error:`` line, exit 2, no credentials or
presigned signatures echoed, whatever exception the storage backend raises."""

from __future__ import annotations

import fsspec
import pytest
from genartifact.cli import main


class BackendError(Exception):
    """Stands in for a storage SDK's own exception type (botocore NoCredentialsError, ClientError, ...)."""


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_backend_exception_of_any_type_is_a_clean_error(cmd, capsys, monkeypatch):
    def boom(*a, **k):
        raise BackendError("Unable to locate credentials for https://k:SECRETPW@h/x?X-Amz-Signature=SIG")

    monkeypatch.setattr(fsspec, "open", boom)
    assert main([cmd, "s3://bucket/runs/a.gart?X-Amz-Signature=SIG"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "cannot be read: BackendError" in err
    assert "SIG" not in err and "SECRETPW" not in err


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
@pytest.mark.parametrize("ref, secret", [("http://user:SECRETPW@127.0.0.1:9/x.gart", "SECRETPW"),
                                         ("memory://b/x.gart?X-Amz-Signature=SECRETSIG", "SECRETSIG")])
def test_credentials_in_a_reference_never_reach_the_error(cmd, ref, secret, capsys):
    assert main([cmd, ref]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and secret not in err and "<redacted>" in err


def test_empty_and_very_long_references(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # '' must not be taken as the current directory
    assert main(["inspect", ""]) == 2
    assert "object reference is empty" in capsys.readouterr().err
    assert main(["inspect", "managed_fsspec:" + "a/" * 3000 + "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err) < 1000


def test_a_fifo_is_refused_not_waited_on(tmp_path, capsys):
    import os

    fifo = tmp_path / "a.gart"
    os.mkfifo(fifo)
    assert main(["inspect", str(fifo)]) == 2  # used to block forever in open() waiting for a writer
    assert "FIFO" in capsys.readouterr().err
