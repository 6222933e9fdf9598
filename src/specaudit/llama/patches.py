"""The llama.cpp patches specaudit can build with, and `Patch`: one patch as a value.

Why this module: what a user types after ``--patch`` has three meanings: a bundled name
(``spec-logprobs``), a bundled mutant (``mutants/<name>``: deliberately broken speculative
decoding, for measuring the verifier's power, never listed by `available_patches`), or a path
to a ``.patch`` file. `resolve` classifies it and reads its bytes exactly once; everything
downstream (the build cache, dist, matrix, the audit) passes the resulting `Patch` and never
looks at the file again, so editing the file mid-command cannot change what was built or
reported. The catalogue (what is bundled for which build, the names and labels) lives here too,
apart from the cmake and cache machinery of `specaudit.llama.build`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from specaudit.errors import BuildError

DEFAULT_BUILD = 11434
"""The llama.cpp build specaudit provisions unless told otherwise (its patches are bundled)."""

MUTANTS = "mutants"  # bundled mutants live in <patch dir>/mutants/, addressed "mutants/<name>"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_LABEL = 64

PatchKind = Literal["bundled", "mutant", "file"]


@dataclass(frozen=True)
class Patch:
    """One patch, classified and read once (see `resolve`).

    `name` is what identifies it: a bundled name, ``mutants/<name>``, or a file's absolute
    path. `label` is the part of a variant name it contributes. `data` are the bytes every
    later step uses; `sha256` is their hex digest.
    """

    kind: PatchKind
    name: str
    data: bytes = field(repr=False)
    sha256: str
    label: str

    @property
    def display(self) -> str:
        """The patch as error messages name it: its name, or a file's base name."""
        return Path(self.name).name if self.kind == "file" else self.name

    @property
    def key(self) -> str:
        """What the variant hash is keyed by next to the bytes: a bundled patch's name
        (unchanged since the first cache), a file's label (the same bytes under the same name
        are the same variant, wherever the file lies)."""
        return self.label if self.kind == "file" else self.name

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")

    @property
    def description(self) -> str:
        """The one-line description: the first ``# `` comment line before the diff."""
        for line in self.text.splitlines():
            if line.startswith(("--- ", "diff ", "Index: ")):
                break
            if line.startswith("#"):
                return line.lstrip("#").strip()
        return ""


def resolve(text: str, build: int = DEFAULT_BUILD) -> Patch:
    """The patch `text` names for `build`, its bytes read now; BuildError (one line) if there
    is no such patch or its file cannot be read."""
    path = patch_path(text, build)
    if is_patch_file(text):
        kind: PatchKind = "file"
        name = str(path.resolve())
    else:
        kind = "mutant" if text.startswith(MUTANTS + "/") else "bundled"
        name = text
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BuildError(f"cannot read patch {_shown(text)}: {e.strerror or e}") from e
    return Patch(kind, name, data, hashlib.sha256(data).hexdigest(), patch_label(name))


def resolve_all(texts: Iterable[str], build: int = DEFAULT_BUILD) -> tuple[Patch, ...]:
    """`resolve` each of `texts`, in order."""
    return tuple(resolve(t, build) for t in texts)


def labels(patches: Iterable[Patch]) -> str:
    """Patches as a label shows them: their labels joined by ``+``."""
    return "+".join(p.label for p in patches)


def available_patches(build: int = DEFAULT_BUILD) -> list[str]:
    """Names of the patches specaudit ships for `build` (file stem of ``<name>.patch``).

    Mutants are not among them (see `available_mutants`): everything listed here is meant to
    be built and used (./run builds each one).
    """
    d = bundled_dir(build)
    if d is None:
        return []
    return sorted(p.name[: -len(".patch")] for p in d.iterdir() if p.name.endswith(".patch"))


def available_mutants(build: int = DEFAULT_BUILD) -> list[str]:
    """Addresses (``mutants/<name>``) of the bundled mutants of `build`'s speculative path.

    Each is a small, deliberately wrong change to llama.cpp (docs/mutants.md); build one with
    ``ensure(patches=(resolve("mutants/<name>"),))`` to measure whether `specaudit dist`
    catches it.
    """
    d = bundled_dir(build)
    md = d / MUTANTS if d is not None else None
    if md is None or not md.is_dir():
        return []
    return sorted(
        f"{MUTANTS}/{p.name[: -len('.patch')]}" for p in md.iterdir() if p.name.endswith(".patch")
    )


def is_patch_file(spec: str) -> bool:
    """Whether a patch argument names a file (``*.patch``) rather than a bundled patch."""
    return spec.endswith(".patch")


def bundled_dir(build: int) -> Path | None:
    """The folder of the patches bundled for `build`, or None if there are none."""
    base = resources.files("specaudit").joinpath("patches", "llama.cpp", f"b{build}")
    p = Path(str(base))
    return p if p.is_dir() else None


def patch_path(name: str, build: int = DEFAULT_BUILD) -> Path:
    """The file of a patch: a bundled name, ``mutants/<name>``, or a path to a ``.patch``."""
    if is_patch_file(name):
        p = Path(name).expanduser()
        try:
            ok = p.is_file()
        except (OSError, ValueError):  # e.g. a NUL byte, a name too long
            ok = False
        if not ok:
            raise BuildError(f"patch file {_shown(name)} not found (or not a regular file)")
        return p
    d = bundled_dir(build)
    mutant = name.startswith(MUTANTS + "/")
    stem = name[len(MUTANTS) + 1 :] if mutant else name
    if d is not None and _NAME.fullmatch(stem):
        p = d / MUTANTS / f"{stem}.patch" if mutant else d / f"{stem}.patch"
        if p.is_file():
            return p
    if mutant:
        have = ", ".join(available_mutants(build)) or "none"
        raise BuildError(f"no mutant {_shown(name)} for build b{build} (available: {have})")
    have = ", ".join(available_patches(build)) or "none"
    raise BuildError(
        f"no patch {_shown(name)} for build b{build} (available: {have}; "
        "or a path to a .patch file)"
    )


def _shown(name: str) -> str:
    """`name` for a one-line message: at most ~80 characters (a path keeps its end)."""
    if len(name) <= 80:
        return repr(name)
    return "..." + repr(name[-60:]) if is_patch_file(name) else repr(name[:60]) + "..."


def patch_label(spec: str) -> str:
    """The part of a variant name a patch contributes: its name, ``mutant-<name>``, or a
    file's stem (characters outside ``[A-Za-z0-9._-]`` replaced, at most 64)."""
    if is_patch_file(spec):
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(spec).name[: -len(".patch")])
        return (stem.lstrip(".-") or "patch")[:_MAX_LABEL]
    if spec.startswith(MUTANTS + "/"):
        return "mutant-" + spec[len(MUTANTS) + 1 :]
    return spec


def describe_patch(spec: str, build: int = DEFAULT_BUILD) -> str:
    """The patch's one-line description: its first ``# `` comment line before the diff."""
    return resolve(spec, build).description


def variant_name(patches: tuple[Patch, ...]) -> str:
    """The cache variant of a patch set: ``stock``, or the labels joined by ``+`` and 12 hex
    digits hashing (key, bytes) of each patch in order: editing a patch is a new variant."""
    if not patches:
        return "stock"
    h = hashlib.sha256()
    for p in patches:
        h.update(p.key.encode() + b"\0" + p.data)
    return labels(patches) + "-" + h.hexdigest()[:12]
