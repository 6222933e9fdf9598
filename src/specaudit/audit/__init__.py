"""`specaudit audit`: every capability on built-in defaults, one report.

The audit sits on top: its sections (`specaudit.audit.sections`, one module per capability)
import the capabilities, never the reverse. `run` provisions llama.cpp, fixtures and Gemma,
starts the servers the sections ask for (once, shared) and runs an explicit list of sections;
a section that raises is reported as an error and the others still run.
"""

from specaudit.audit.context import AuditContext, Section
from specaudit.audit.runner import AuditReport, run, to_json, to_markdown, write

__all__ = ["AuditContext", "AuditReport", "Section", "run", "to_json", "to_markdown", "write"]
