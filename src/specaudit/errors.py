"""Exceptions and exit codes shared by the library and the CLI.

Every error a user can cause or meet is a `SpecauditError` whose message is one line: the CLI
prints it after ``error:`` and exits with the error's `exit_code`, never with a traceback.
"""

from __future__ import annotations

# Exit codes documented in every command's --help.
EXIT_OK = 0
EXIT_FINDING = 1  # the audit found what it looks for (placeholders, a broken distribution...)
EXIT_ERROR = 2  # no decision: bad input, unreachable server, failed build...


class SpecauditError(Exception):
    """Base class: a one-line, user-facing message and an exit code."""

    exit_code: int = EXIT_ERROR

    def __str__(self) -> str:
        # Keep it one line whatever the cause carried (server logs, nested errors).
        return " ".join(super().__str__().split())


class BuildError(SpecauditError):
    """llama.cpp could not be fetched, configured or built."""


class ServerError(SpecauditError):
    """A llama-server process could not be started or answered badly.

    `log_tail` carries the last lines of the server log so a failure explains itself; it is
    kept apart from the one-line message.
    """

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class ModelError(SpecauditError):
    """A model file is missing or does not match its SHA-256."""
