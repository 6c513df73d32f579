"""Structured JSON logs (structlog), one line per event, for every service."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_configured = False


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    """JSON lines on ``stream`` (stderr by default) with an ISO timestamp and level."""
    global _configured
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get(service: str, **bound: Any) -> Any:
    return structlog.get_logger().bind(service=service, **bound)
