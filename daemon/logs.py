"""Logging, configured once in the entry point: structlog JSON, one object per line."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stdout),
        cache_logger_on_first_use=True,
    )
