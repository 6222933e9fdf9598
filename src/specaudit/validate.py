"""One set of input checks for the CLI and the library: URLs, numbers, text, paths.

Why one place: a bad value must fail the same way whether it came from the command line or
from a library call -- before any work starts, as one line (a `SpecauditError`, exit 2),
never as a traceback from deep inside httpx, json or pathlib. The CLI's option types
(`specaudit.cli.common`) wrap these functions, and `check.run`, `ab.run` and
`distribution.make_request` call them again, so library users get the same protection. What
only one command checks stays with that command (dist's: `distribution.request`).

Each check takes the option's name (``--timeout``) for the message and the error class to
raise (the caller's: `CheckError`, `ABError`, `DistError`; `InputError` by default). Light on
purpose: no httpx, numpy or click at import.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from specaudit.errors import SpecauditError

# llama.cpp's seed is a uint32 and 0xFFFFFFFF means "pick a random one": the largest seed
# that is reproducible is one less.
MAX_SEED = 2**32 - 2
# Counts sent to a server (tokens, candidates, the sampler's top-k) are int32 there.
MAX_INT32 = 2**31 - 1
# Seconds: a day is already absurd for one request; much more overflows the socket layer.
MAX_TIMEOUT = 86400.0


class InputError(SpecauditError):
    """A value that cannot be used (bad URL, number out of range, unwritable path...)."""


ErrorType = type[SpecauditError]


def _lead(name: str) -> str:
    return f"{name}: " if name else ""


def url(value: object, name: str = "", error: ErrorType = InputError) -> str:
    """An http(s) base URL with a parseable host and port; returned without a trailing /."""
    if not isinstance(value, str):
        raise error(f"{_lead(name)}{value!r} is not an http(s) URL")
    reason = _url_problem(value)
    if reason:
        shown = repr(value) if len(value) <= 100 else repr(value[:100]) + "..."
        raise error(f"{_lead(name)}{shown} is not an http(s) URL ({reason})")
    return value.rstrip("/")


def _url_problem(value: str) -> str | None:
    if not value:
        return "empty"
    if any(ord(c) < 0x21 or 0xD800 <= ord(c) <= 0xDFFF for c in value):
        return "spaces, control characters or bytes that are not UTF-8"
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as e:
        return f"cannot be parsed: {e}"
    if parts.scheme not in ("http", "https"):
        return "no http:// or https:// scheme"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    if parts.query or parts.fragment or "?" in value or "#" in value:
        return "a query or fragment; a base URL is expected"
    try:  # the parser that will be used to connect must agree
        import httpx

        httpx.URL(value)
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        return f"cannot be parsed: {' '.join(str(e).split())}"
    return None


def number(
    value: float,
    name: str,
    *,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    max_open: bool = False,
    error: ErrorType = InputError,
) -> float:
    """A finite number in the range (bounds inclusive unless `min_open`/`max_open`)."""
    lo = "" if min is None else f"{'>' if min_open else '>='} {min:g}"
    hi = "" if max is None else f"{'<' if max_open else '<='} {max:g}"
    want = " and ".join(x for x in (lo, hi) if x)
    bad = (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (min is not None and (value <= min if min_open else value < min))
        or (max is not None and (value >= max if max_open else value > max))
    )
    if bad:
        subject = name or "the value"
        raise error(
            f"{subject} must be a finite number{' ' + want if want else ''} (got {value!r})"
        )
    return value


def integer(
    value: int,
    name: str,
    *,
    min: int | None = None,
    max: int | None = None,
    error: ErrorType = InputError,
) -> int:
    """An int (not a bool) in [min, max]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name or 'the value'} must be an integer (got {value!r})")
    if (min is not None and value < min) or (max is not None and value > max):
        lo = "" if min is None else f">= {min}"
        hi = "" if max is None else f"<= {max}"
        want = " and ".join(x for x in (lo, hi) if x)
        shown = str(value) if len(str(value)) <= 30 else f"{str(value)[:20]}... ({value:.3g})"
        raise error(f"{name or 'the value'} must be {want} (got {shown})")
    return value


def text(
    value: str, name: str = "", *, allow_empty: bool = True, error: ErrorType = InputError
) -> str:
    """Text that can be sent as UTF-8 JSON: no undecodable bytes from the command line.

    Python hands bytes that are not UTF-8 in argv or the environment over as lone surrogates
    (``surrogateescape``); JSON encoding then fails deep inside httpx.
    """
    subject = name or "the text"
    if not isinstance(value, str):
        raise error(f"{subject} must be text (got {type(value).__name__})")
    if not allow_empty and not value:
        raise error(f"{subject} must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = value[e.start].encode("utf-8", "surrogateescape")
        raise error(
            f"{subject} is not valid UTF-8 (byte 0x{raw.hex()} at character {e.start}); "
            "pass text in the UTF-8 encoding"
        ) from None
    return value


def token(value: str, name: str = "", error: ErrorType = InputError) -> str:
    """A credential sent in an HTTP header: printable ASCII, no spaces. Never echoed."""
    subject = name or "the key"
    if not isinstance(value, str) or not value:
        raise error(f"{subject} must not be empty")
    if not all(0x21 <= ord(c) <= 0x7E for c in value):
        raise error(f"{subject} must be printable ASCII without spaces (the value is not shown)")
    return value


def _os_reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return " ".join(str(e).split()) or type(e).__name__


def _probe_dir(d: Path) -> None:
    """Create and remove a file in `d`: the only test of writability that root cannot fool."""
    fd, tmp = tempfile.mkstemp(prefix=".specaudit-probe-", dir=d)
    os.close(fd)
    os.unlink(tmp)


def writable_dir(
    path: str | os.PathLike[str],
    name: str = "",
    *,
    create: bool = True,
    error: ErrorType = InputError,
) -> Path:
    """A directory we can write into, created (with parents) if missing and `create`."""
    p = Path(path)
    try:
        p = p.expanduser()
        if create:
            p.mkdir(parents=True, exist_ok=True)
        if not p.is_dir():
            raise error(f"{_lead(name)}{str(p)!r} is not a directory")
        _probe_dir(p)
    except SpecauditError:
        raise
    except (OSError, ValueError, RuntimeError) as e:
        raise error(
            f"{_lead(name)}{str(p)!r} is not a writable directory: {_os_reason(e)}"
        ) from None
    return p


def writable_file(
    path: str | os.PathLike[str], name: str = "", error: ErrorType = InputError
) -> Path:
    """A file path we will be able to write at the end: its directory is created now and
    checked writable, so a long measurement never ends in an unwritable plot path."""
    p = Path(path)
    try:
        p = p.expanduser()
        if not p.name or p.is_dir():
            raise error(f"{_lead(name)}{str(p)!r} is a directory, not a file name")
        parent = p.parent
        parent.mkdir(parents=True, exist_ok=True)
        if not parent.is_dir():
            raise error(f"{_lead(name)}{str(p)!r}: {str(parent)!r} is not a directory")
        if p.exists():
            with p.open("r+b"):
                pass
        else:
            _probe_dir(parent)
    except SpecauditError:
        raise
    except (OSError, ValueError, RuntimeError) as e:
        raise error(f"{_lead(name)}{str(p)!r} cannot be written: {_os_reason(e)}") from None
    return p


__all__ = [
    "MAX_INT32",
    "MAX_SEED",
    "MAX_TIMEOUT",
    "InputError",
    "integer",
    "number",
    "text",
    "token",
    "url",
    "writable_dir",
    "writable_file",
]
