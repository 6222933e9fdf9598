"""The CLI's last line of defence: an exception that is not a `SpecauditError` is a bug.

Python's default for an uncaught exception is a traceback and exit 1, and 1 in specaudit
means "finding": a crash would read as a result. `specaudit.cli.run` sends every such
exception here instead: the traceback goes to a file (the cache's ``crashes/``, else the
temp dir), with secrets redacted; stderr gets one ``error:`` line naming the bug and that
file; the exit code is `EXIT_INTERNAL` (3), which no verdict uses.

Redaction (`redact`): the values of ``--api-key``-like options in argv and of secret-looking
environment variables (``SPECAUDIT_*_API_KEY``, ``*TOKEN*``...) wherever they appear, then
anything shaped like a credential: ``Authorization: ...``, ``Bearer ...``, ``api_key=...``,
``X-Api-Key``, a password in a URL.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

REDACTED = "[redacted]"

# options whose value is a secret (--api-key, --token, --password, ...; not --tokens)
_SECRET_OPTION = re.compile(
    r"(?i)^--?[a-z-]*(api[-_]?key|token|secret|passw(or)?d|authorization|credentials?)(=|$)"
)
# environment variables holding one (SPECAUDIT_PLAIN_API_KEY, GITHUB_TOKEN, ...)
_SECRET_ENV = re.compile(r"(?i)(api_?key|(^|_)token$|secret|passw(or)?d|credentials?$)")
# a secret-bearing name, its separator (":" or "=", quoted as in a dict, JSON or repr), an
# optional auth scheme, and the value
_SECRET_FIELD = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api[-_]?key|access[-_]?token|secret|passw(?:or)?d)"
    r"(\\?[\"']?\s*[:=]\s*\\?[\"']?\s*)"
    r"((?:bearer|basic|token)\s+)?"
    r"(?!\[redacted\])([^\s\"'\\,)}\]]+)"
)
# an auth scheme and its credentials anywhere (Basic: base64, so "basic checks" stays)
_SCHEME = re.compile(
    r"(?i)\b(bearer(?=\s)|basic(?=\s+[A-Za-z0-9+/]{8,}=*))(\s+)(?!\[redacted\])([^\s\"'\\,)}\]]+)"
)
# user:password@ in a URL
_URL_PASSWORD = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)([^@\s/]+)(@)")
_MIN_SECRET = 4  # shorter values are not replaced literally (they would hit ordinary text)


def secret_values(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> list[str]:
    """Secrets known by name: values of secret options in `argv` and of secret env vars."""
    env = os.environ if environ is None else environ
    found: list[str] = []
    found += [v for name, v in env.items() if _SECRET_ENV.search(name)]
    args = list(argv)
    for i, a in enumerate(args):
        if not _SECRET_OPTION.match(a):
            continue
        if "=" in a:
            found.append(a.split("=", 1)[1])
        elif i + 1 < len(args):
            found.append(args[i + 1])
    # longest first, so a secret containing another is replaced whole
    return sorted({v for v in found if len(v) >= _MIN_SECRET}, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every known secret and anything shaped like a credential replaced."""
    for s in secrets:
        text = text.replace(s, REDACTED)
    text = _SECRET_FIELD.sub(lambda m: f"{m[1]}{m[2]}{m[3] or ''}{REDACTED}", text)
    text = _SCHEME.sub(rf"\1\2{REDACTED}", text)
    return _URL_PASSWORD.sub(rf"\1{REDACTED}\3", text)


def _crash_dirs() -> list[Path]:
    dirs: list[Path] = []
    try:
        from specaudit.paths import cache_root

        dirs.append(cache_root() / "crashes")
    except Exception:  # noqa: BLE001 - a broken cache must not hide the bug being reported
        pass
    dirs.append(Path(tempfile.gettempdir()) / "specaudit-crashes")
    return dirs


def _write(text: str) -> tuple[Path | None, str]:
    """Write `text` to a new private file; (path, "") or (None, why it could not be)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    why = "no directory to write to"
    for d in _crash_dirs():
        path = d / f"crash-{stamp}-{os.getpid()}.txt"
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
                fh.write(text)
            return path, ""
        except Exception as e:  # noqa: BLE001 - try the next place, then say why
            why = f"{d}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
    return None, why


def report(exc: BaseException, argv: Sequence[str] | None = None) -> str:
    """Write `exc`'s traceback (redacted) to a file; return the one ``error:`` line."""
    from specaudit import __version__

    args = list(sys.argv[1:] if argv is None else argv)
    secrets = secret_values(args)
    detail = " ".join(str(exc).split())
    what = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    what = redact(what, secrets)
    if len(what) > 200:
        what = what[:197] + "..."
    try:
        tb = "".join(traceback.format_exception(exc))
    except Exception:  # noqa: BLE001 - a broken exception still gets its line
        tb = f"{what}\n(the traceback could not be formatted)\n"
    body = (
        f"specaudit {__version__}: internal error (a bug)\n"
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
        f"python: {sys.version.split()[0]} on {platform.platform()}\n"
        f"argv: specaudit {' '.join(args)}\n\n{tb}"
    )
    path, why = _write(redact(body, secrets))
    where = f"traceback: {path}" if path else f"the traceback could not be written ({why})"
    line = f"error: internal error (a bug in specaudit {__version__}, please report it): {what}"
    return redact(f"{line}; {where}", secrets)


__all__ = ["REDACTED", "redact", "report", "secret_values"]
