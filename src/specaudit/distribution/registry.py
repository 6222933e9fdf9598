"""The engine registry: engine name -> entry, in the spirit of simonw/llm's `register_models`.

An entry says what the engine needs (llama.cpp binaries, running servers' URLs, an optional
extra), which options of its own it takes (they become `specaudit dist` options and
`make_request` keywords), what it checks in a request, and how it is built from one. The
request (`dist.request`), the runner (`dist.runner`) and the CLI read only this table, so
adding an engine is one module (its `Engine` and a `build` function) plus one `register` call:
see docs/dist.md, "Adding an engine". The built-in entries are in `dist.builtin`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specaudit.distribution.engines import Engine
from specaudit.distribution.results import DistError

if TYPE_CHECKING:
    from specaudit.distribution.request import DistRequest
    from specaudit.fixtures import FixtureSpec
    from specaudit.llama.build import LlamaBinaries


@dataclass(frozen=True)
class EngineOption:
    """An option of one engine: ``FLAG CHOICE``, repeatable; None in the request when not given."""

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


_ENTRIES: dict[str, EngineEntry] = {}


def register(entry: EngineEntry) -> EngineEntry:
    """Add (or replace) an engine under `entry.name`; returns the entry."""
    for opt in entry.options:
        for other in entries():
            if other.name != entry.name and any(o.param == opt.param for o in other.options):
                raise ValueError(f"option {opt.param!r} is already {other.name}'s")
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove an engine (tests register toy engines and take them away again)."""
    _ENTRIES.pop(name, None)


def names() -> tuple[str, ...]:
    """Every registered engine's name, in registration order."""
    return tuple(_ENTRIES)


def entries() -> tuple[EngineEntry, ...]:
    return tuple(_ENTRIES.values())


def get(name: str) -> EngineEntry:
    """The entry of `name`, or a one-line DistError naming the engines there are."""
    try:
        return _ENTRIES[name]
    except KeyError:
        raise DistError(f"unknown engine {name!r} (one of {', '.join(_ENTRIES)})") from None


def options() -> tuple[tuple[EngineEntry, EngineOption], ...]:
    """Every engine's own options, with the engine that owns each."""
    return tuple((e, o) for e in _ENTRIES.values() for o in e.options)


def binary_engines() -> tuple[str, ...]:
    return tuple(e.name for e in _ENTRIES.values() if e.binaries)


def url_engines() -> tuple[str, ...]:
    return tuple(e.name for e in _ENTRIES.values() if e.url)


__all__ = [
    "BuildFn",
    "CheckFn",
    "EngineEntry",
    "EngineOption",
    "RunContext",
    "Unit",
    "binary_engines",
    "entries",
    "get",
    "names",
    "options",
    "register",
    "unregister",
    "url_engines",
]
