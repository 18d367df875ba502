"""structlog setup: console renderer for humans, JSON lines with ``--log-json``. Logs go to stderr."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(*, json_lines: bool = False, level: int = logging.INFO) -> None:
    """Configure structlog process-wide (idempotent)."""
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # resolve sys.stderr per logger, so a replaced stream (tests, daemons) is honoured
        logger_factory=lambda *args: structlog.PrintLogger(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
