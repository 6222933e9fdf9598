"""llama.cpp: building the binaries specaudit drives, and running llama-server.

`patches` (the bundled patches and mutants; `Patch`, one patch read once), `sdist` (the source
of a build number), `sources` (the bytes a variant compiles, the shared work tree), `build`
(cmake and the cache entries), `process` (the managed-server lifecycle), `server`
(llama-server), `presets` (the named server roles).
"""

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
