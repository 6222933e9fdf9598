"""An engine plug-in installed into a folder for a test, as pip would install its package."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def install_engine_package(
    site: Path,
    dist: str,
    entry_points: Mapping[str, str],
    modules: Mapping[str, str] | None = None,
) -> Path:
    """Install a `dist` engine plug-in into `site` the way pip leaves a package: the modules'
    files (name -> source) and ``<dist>-0.1.dist-info`` with METADATA and an entry_points.txt
    declaring `entry_points` (name -> ``module`` or ``module:hook``) in the registry's group.
    The caller puts `site` on sys.path and resets the registry (`registry.reset`). (specaudit
    is imported here, not by conftest, which every test loads.)"""
    from specaudit.distribution import registry

    site.mkdir(parents=True, exist_ok=True)
    for name, source in (modules or {}).items():
        (site / f"{name}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{registry.GROUP}]\n{eps}")
    return site


__all__ = ["install_engine_package"]
