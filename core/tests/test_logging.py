"""Log levels: one ``artifact_ready`` line per stored artifact only at ``--log-level debug`` (issue 13: the line
cost more driver time than encoding a small artifact); warnings and faults still show at the default level."""

from __future__ import annotations

import logging

import pytest
import structlog
from genartifact.cli import build_parser
from genartifact.logging import configure_logging
from genartifact.testing import make_host, model_info, run_session


@pytest.fixture
def restore_structlog():
    yield
    structlog.reset_defaults()


def _events(level: int) -> list[str]:
    configure_logging(level=level)
    with structlog.testing.capture_logs() as logs:
        res = run_session(make_host(contents=["selected_logprobs"]), ["selected_logprobs"], [1, 2, 3], [4, 5],
                          logprobs=[-0.5, -1.5], model=model_info(worker_captures=[]))  # engine-sourced logprobs
    assert res.receipt["state"] == "ready"
    return [e["event"] for e in logs]


def test_artifact_ready_is_a_debug_line(restore_structlog):
    assert "artifact_ready" not in _events(logging.INFO)
    assert "artifact_ready" in _events(logging.DEBUG)


def test_cli_log_level_choices():
    ap = build_parser(["plugins"])
    assert ap.parse_args(["--log-level", "debug", "plugins"]).log_level == "debug"
    assert ap.parse_args(["plugins"]).log_level == "info"
    with pytest.raises(SystemExit):
        ap.parse_args(["--log-level", "chatty", "plugins"])


@pytest.mark.fault("cli", "--log-level: odd case, empty, unknown, repeated")
def test_cli_log_level_odd_values(capsys):
    ap = build_parser(["plugins"])
    assert ap.parse_args(["--log-level", "DEBUG", "plugins"]).log_level == "debug"
    assert ap.parse_args(["--log-level=Warning", "plugins"]).log_level == "warning"
    assert ap.parse_args(["--log-level", "error", "--log-level", "info", "plugins"]).log_level == "info"  # last wins
    for bad in ("", "trace", "10", "critical"):
        with pytest.raises(SystemExit) as e:
            ap.parse_args([f"--log-level={bad}", "plugins"])
        assert e.value.code == 2
        assert "--log-level" in capsys.readouterr().err
