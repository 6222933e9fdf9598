"""llama.cpp: building the binaries specaudit drives, and running llama-server."""

from specaudit.llama.build import TARGETS, LlamaBinaries, ensure, find
from specaudit.llama.patches import (
    DEFAULT_BUILD,
    Patch,
    available_mutants,
    available_patches,
    describe_patch,
)
from specaudit.llama.server import LlamaServer, free_port

__all__ = [
    "DEFAULT_BUILD",
    "TARGETS",
    "LlamaBinaries",
    "LlamaServer",
    "Patch",
    "available_mutants",
    "available_patches",
    "describe_patch",
    "ensure",
    "find",
    "free_port",
]
