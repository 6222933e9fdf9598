"""`LazyModule`: a module imported when one of its attributes is first read (or set).

For test files whose module is expensive to import (LiteLLM: seconds): every pytest-xdist
worker collects every test file, so a top-level import is paid by each worker, not only by
the one that runs the file's tests. Type checkers see the real import (under
`typing.TYPE_CHECKING`); at run time the name is a `LazyModule`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for the module `name`; attribute reads and writes go to it, imported on first
    use."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _module(self) -> ModuleType:
        return importlib.import_module(object.__getattribute__(self, "_name"))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._module(), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._module(), attr, value)

    def __repr__(self) -> str:
        return f"<lazy module {object.__getattribute__(self, '_name')!r}>"
