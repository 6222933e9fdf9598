"""The engine registry: engine name -> entry, in the spirit of simonw/llm's `register_models`.

An entry says what the engine needs (llama.cpp binaries, running servers' URLs, an optional
extra), which options of its own it takes (they become `specaudit dist` options and
`make_request` keywords), what it checks in a request, how it is built from one, and how the
audit shows its results. The request (`dist.request`), the runner (`dist.runner`), rescore, the
audit and the CLI read only this table.

Every engine comes from a module with one hook, ``register_engines(register)``, which calls
`register` with its entries (docs/dist.md, "Adding an engine"). The built-in modules
(`BUILTIN`) and every entry point of the group ``specaudit.engines`` (a module with that hook,
or the hook itself: an engine shipped as its own package) are loaded the same way, once, on
the first read of the table (`names`, `entries`, `get`, ...): importing the registry imports
no engine, and an engine imports its extra (torch, openvino) only when it runs. A plug-in
that cannot be loaded is one DistError line naming it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from specaudit.distribution.results import DistError, EngineResult

if TYPE_CHECKING:
    from specaudit.distribution.engines import Engine
    from specaudit.distribution.request import DistRequest
    from specaudit.fixtures import FixtureSpec
    from specaudit.llama.build import LlamaBinaries


@dataclass(frozen=True)
class EngineOption:
    """An option of one engine: ``FLAG CHOICE``, repeatable; None in the request when not given.
    No `choices`: any text, which the engine's `check` validates."""

    flag: str  # the CLI spelling, e.g. "--path"
    param: str  # the `make_request` keyword and `DistRequest.options` key, e.g. "paths"
    choices: tuple[str, ...]
    help: str


@dataclass
class Unit:
    """One engine to measure; `path`: the verification path it runs (the server engine);
    `spec`: the fixture whose closed form it is tested against when the engine runs a
    converted copy (OpenVINO's F16 weights), None for the request's own."""

    engine: Engine
    path: str | None = None
    spec: FixtureSpec | None = None


@dataclass
class RunContext:
    """What an engine's `build` gets beside the request: the binaries (built or found on first
    call) and the run's notes and not-covered list, which it may extend."""

    binaries: Callable[[], LlamaBinaries]
    notes: list[str] = field(default_factory=list)
    not_covered: list[tuple[str, str]] = field(default_factory=list)


# A generator: it may hold a server open while the unit it yielded is measured.
BuildFn = Callable[["DistRequest", RunContext], Generator[Unit, None, None]]
CheckFn = Callable[["DistRequest"], None]
# (engine label, generator/path column) of one result in the audit's engines table
RowFn = Callable[[EngineResult], tuple[str, str]]


@dataclass(frozen=True)
class EngineEntry:
    """A registered engine: its name, what it needs, its options, its checks, its `build`."""

    name: str
    build: BuildFn
    help: str = ""
    binaries: bool = False  # runs llama.cpp binaries (--patch applies to it)
    url: bool = False  # samples running servers: needs --url (repeatable)
    extra: str | None = None  # the optional dependency it needs, e.g. "transformers"
    options: tuple[EngineOption, ...] = ()
    check: CheckFn | None = None  # called by `make_request` once the request is complete
    # the audit's engines section runs it on each built-in fixture (it needs nothing else)
    audit: bool = False
    row: RowFn | None = None  # how that section shows a result; None: (its label, "")

    def audit_row(self, result: EngineResult) -> tuple[str, str]:
        """(engine label, generator/path) of `result` in the audit's engines table."""
        return self.row(result) if self.row is not None else (result.engine, "")


Register = Callable[[EngineEntry], EngineEntry]
GROUP = "specaudit.engines"  # the entry-point group of engine plug-ins
HOOK = "register_engines"  # what a plug-in module defines: register_engines(register)
# The built-in engines' modules, loaded like plug-ins (the same hook), before them: they are
# there whatever an install's metadata says (a source checkout on PYTHONPATH, an editable
# install made before an engine was added).
BUILTIN = (
    "specaudit.distribution.llamacpp",  # server, speculative-example, url
    "specaudit.distribution.openai",
    "specaudit.distribution.hf",  # transformers
    "specaudit.distribution.openvino",
    "specaudit.distribution.vllm",
)

_ENTRIES: dict[str, EngineEntry] = {}
_OWNERS: dict[str, str] = {}  # engine name -> the plug-in that registered it
_loaded = False


def register(entry: EngineEntry) -> EngineEntry:
    """Add (or replace) an engine under `entry.name`; returns the entry. A plug-in's hook gets
    this function (with its name attached: `_registrar`); code in a running process may call
    it directly."""
    if not isinstance(entry, EngineEntry):
        raise TypeError(f"register() takes an EngineEntry, not {type(entry).__name__}")
    for opt in entry.options:
        for other in entries():
            if other.name != entry.name and any(o.param == opt.param for o in other.options):
                raise ValueError(f"option {opt.param!r} is already {other.name}'s")
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove an engine (tests register toy engines and take them away again)."""
    _ENTRIES.pop(name, None)
    _OWNERS.pop(name, None)


def reset() -> None:
    """Forget every entry and loaded plug-in: the next read loads the built-ins and the
    installed plug-ins again (a package installed since is found then)."""
    global _loaded
    _ENTRIES.clear()
    _OWNERS.clear()
    _loaded = False
    importlib.invalidate_caches()


def _load() -> None:
    """The built-in modules' hooks, then every installed plug-in's, once. A failure leaves
    nothing half-registered: the table is empty again and the next read tries again."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:
        for module in BUILTIN:
            _run_hook(module, functools.partial(importlib.import_module, module))
        for ep in importlib.metadata.entry_points(group=GROUP):
            _run_hook(_describe(ep), ep.load)
    except BaseException:
        reset()
        raise


def _describe(ep: importlib.metadata.EntryPoint) -> str:
    """How an error names a plug-in: its entry point, its target and its distribution."""
    dist = getattr(ep, "dist", None)
    origin = f", from {dist.name} {dist.version}" if dist is not None else ""
    return f"{ep.name!r} ({ep.value}{origin})"


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _run_hook(plugin: str, load: Callable[[], object]) -> None:
    """Load one plug-in (a module with `HOOK`, or the hook itself) and call its hook with a
    `register` that names it; anything it raises becomes one DistError line naming it."""
    try:
        target = load()
    except Exception as e:
        raise DistError(f"engine plug-in {plugin} could not be loaded: {_one_line(e)}") from None
    hook = getattr(target, HOOK, None) if isinstance(target, ModuleType) else target
    if not callable(hook):
        raise DistError(
            f"engine plug-in {plugin} has no {HOOK}(register) hook: an entry point of "
            f"{GROUP!r} names a module that defines it, or the hook itself"
        )
    try:
        hook(_registrar(plugin))
    except DistError as e:
        raise DistError(f"engine plug-in {plugin}: {e}") from None
    except Exception as e:
        raise DistError(f"engine plug-in {plugin}: {HOOK} failed: {_one_line(e)}") from None


def _registrar(plugin: str) -> Register:
    """`register` for one plug-in's hook: it may not take an engine another one registered."""

    def register_for(entry: EngineEntry) -> EngineEntry:
        owner = _OWNERS.get(getattr(entry, "name", ""))
        if owner is not None and owner != plugin:
            raise DistError(f"registers engine {entry.name!r}, which {owner} registered")
        register(entry)
        _OWNERS[entry.name] = plugin
        return entry

    return register_for


def names() -> tuple[str, ...]:
    """Every registered engine's name, in registration order (the built-ins first)."""
    _load()
    return tuple(_ENTRIES)


def entries() -> tuple[EngineEntry, ...]:
    _load()
    return tuple(_ENTRIES.values())


def get(name: str) -> EngineEntry:
    """The entry of `name`, or a one-line DistError naming the engines there are."""
    _load()
    try:
        return _ENTRIES[name]
    except KeyError:
        raise DistError(f"unknown engine {name!r} (one of {', '.join(_ENTRIES)})") from None


def options() -> tuple[tuple[EngineEntry, EngineOption], ...]:
    """Every engine's own options, with the engine that owns each."""
    return tuple((e, o) for e in entries() for o in e.options)


def binary_engines() -> tuple[str, ...]:
    return tuple(e.name for e in entries() if e.binaries)


def url_engines() -> tuple[str, ...]:
    return tuple(e.name for e in entries() if e.url)


__all__ = [
    "BUILTIN",
    "GROUP",
    "HOOK",
    "BuildFn",
    "CheckFn",
    "EngineEntry",
    "EngineOption",
    "Register",
    "RowFn",
    "RunContext",
    "Unit",
    "binary_engines",
    "entries",
    "get",
    "names",
    "options",
    "register",
    "reset",
    "unregister",
    "url_engines",
]
