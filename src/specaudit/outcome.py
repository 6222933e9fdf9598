"""One vocabulary for what every command and audit section concludes, and its exit code.

Why one: a user scripting specaudit reads exit codes, and the audit's summary reads section
statuses. Both must mean the same thing everywhere: OK (nothing found), FINDING (the fault a
command looks for is there: placeholders, a broken distribution, an instrument fault) and
NO_DECISION (bad input, an unreachable or failing server, too little evidence). Each verdict
type (`check`'s, `ab`'s, `dist`'s) maps onto this with its own ``outcome`` property.

Two codes are no verdict at all: `EXIT_INTERNAL` (3), a bug in specaudit (an exception that is
not a `SpecauditError`; the CLI's guard names the file its traceback went to), and
`EXIT_INTERRUPTED` (130). Python's own exit 1 for an uncaught exception would read as a
finding: the guard in `specaudit.cli.run` makes sure a crash never does.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_NO_DECISION = 2
EXIT_INTERNAL = 3  # a bug: never a verdict
EXIT_INTERRUPTED = 130


class Outcome(StrEnum):
    OK = "ok"
    FINDING = "finding"
    NO_DECISION = "no decision"

    @property
    def exit_code(self) -> int:
        return _EXIT[self]

    @classmethod
    def worst(cls, outcomes: Iterable[Outcome]) -> Outcome:
        """NO_DECISION over FINDING over OK; OK for none."""
        seen = set(outcomes)
        for o in (cls.NO_DECISION, cls.FINDING):
            if o in seen:
                return o
        return cls.OK


_EXIT = {Outcome.OK: EXIT_OK, Outcome.FINDING: EXIT_FINDING, Outcome.NO_DECISION: EXIT_NO_DECISION}

# The end of every command's "Exit codes:" epilog: the two codes that are never a verdict.
EXIT_TAIL_HELP = (
    "  3  internal error: a bug in specaudit (stderr names the file with its traceback)\n"
    "  130 interrupted"
)

EXIT_CODES_HELP = (
    "\b\nExit codes:\n"
    "  0  OK: nothing found (every logprob real, distribution preserved, ...)\n"
    "  1  finding: placeholders found, distribution broken, instrument fault, ...\n"
    "  2  no decision: bad input, unreachable or non-LLM server, failed build\n" + EXIT_TAIL_HELP
)

__all__ = [
    "EXIT_CODES_HELP",
    "EXIT_FINDING",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_NO_DECISION",
    "EXIT_OK",
    "EXIT_TAIL_HELP",
    "Outcome",
]
