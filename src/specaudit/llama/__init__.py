"""llama.cpp: building the binaries specaudit drives, and running llama-server."""

from specaudit.llama.build import (
    DEFAULT_BUILD,
    TARGETS,
    LlamaBinaries,
    available_mutants,
    available_patches,
    check_patch,
    describe_patch,
    ensure,
    find,
)
from specaudit.llama.server import LlamaServer, free_port

__all__ = [
    "DEFAULT_BUILD",
    "TARGETS",
    "LlamaBinaries",
    "LlamaServer",
    "available_mutants",
    "available_patches",
    "check_patch",
    "describe_patch",
    "ensure",
    "find",
    "free_port",
]
