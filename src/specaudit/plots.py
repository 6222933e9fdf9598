"""Shared plotting plumbing: a headless matplotlib and one way to save a figure.

Why a module: every command that draws (ab, dist, ...) runs on servers and in CI, where no
display exists. Selecting the Agg backend in one place, before pyplot is imported, keeps a
stray ``import matplotlib.pyplot`` elsewhere from picking an interactive backend and failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Colours used for the two sides of a comparison, so every plot reads the same way.
PLAIN_COLOR = "#1f77b4"  # blue: the reference (no speculation)
SPEC_COLOR = "#ff7f0e"  # orange: the speculating server
MISSING_COLOR = "#d62728"  # red: placeholders / missing values


def pyplot() -> Any:
    """`matplotlib.pyplot` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write `fig` as PNG (creating parent directories) and free it."""
    plt = pyplot()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(p, dpi=dpi, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return p
