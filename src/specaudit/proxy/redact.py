"""Log redaction: no credential the proxy sees reaches its log.

Why its own module: both transports, aiohttp's own loggers and asyncio's log through the same
filter (`install_log_redaction`), and aiohttp's parser errors quote request bytes (an
``Authorization`` line included) that the proxy's 400 answers must not echo either (`redact`).
"""

from __future__ import annotations

import logging
import re

# a secret-bearing name, its separator (quoted, as in a dict or JSON), an optional auth
# scheme, and the value; or an auth scheme and its credentials anywhere
_SECRET = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api[-_]?key|access[-_]?token)"
    r"(\\?[\"']?\s*[:=]?\s*\\?[\"']?\s*)"
    r"((?:bearer|basic|token)\s+)?"
    r"([^\s\"'\\]+)"
)
_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+)(?!\[redacted\])([^\s\"'\\]+)")


def redact(text: str) -> str:
    """`text` with anything that looks like a credential replaced by ``[redacted]``."""
    text = _SECRET.sub(lambda m: f"{m[1]}{m[2]}{m[3] or ''}[redacted]", text)
    return _SCHEME.sub(r"\1\2[redacted]", text)


class _Redact(logging.Filter):
    """Belt and braces: the proxy never logs headers, and this masks any that slip through,
    in the message and in the traceback (an exception's text can quote a request's bytes:
    aiohttp's parser errors show the offending header line, ``Authorization`` included).

    The traceback is formatted here, redacted, and kept as ``exc_text`` (which every
    `logging.Formatter` prints); ``exc_info`` is dropped so no handler formats the raw one.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a bad format string must not hide the record, nor leak its args
            msg = f"{record.msg} {record.args!r}"
        clean = redact(msg)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        if record.exc_info:
            text = record.exc_text or _FORMATTER.formatException(record.exc_info)
            record.exc_info = None
            record.exc_text = redact(text)
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FORMATTER = logging.Formatter()
REDACT = _Redact()  # the filter, installed on every logger in `_LOGGERS`
_LOGGERS = (
    "specaudit.proxy",
    "aiohttp.access",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.client",
    "aiohttp.internal",
    "asyncio",
)


def install_log_redaction() -> None:
    for name in _LOGGERS:
        lg = logging.getLogger(name)
        if REDACT not in lg.filters:
            lg.addFilter(REDACT)
