"""Exceptions and exit codes shared by the library and the CLI.

Every error a user can cause or meet is a `SpecauditError` whose message is one line: the CLI
prints it after ``error:`` and exits with the error's `exit_code`, never with a traceback.
"""

from __future__ import annotations

from specaudit.outcome import EXIT_FINDING, EXIT_NO_DECISION, EXIT_OK

EXIT_ERROR = EXIT_NO_DECISION  # an error is always "no decision"
__all__ = [
    "EXIT_ERROR",
    "EXIT_FINDING",
    "EXIT_OK",
    "BuildError",
    "ModelError",
    "ServerError",
    "SpecauditError",
]


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
