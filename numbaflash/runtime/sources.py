"""Locate the inline-PTX helper sources (``ptx/*.cu``).

In a source checkout they live in ``<repo>/ptx``; in an installed wheel they are
shipped inside the package as ``numbaflash/ptx_sources``.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # numbaflash/
_CANDIDATES = (_PACKAGE_DIR / "ptx_sources", _PACKAGE_DIR.parent / "ptx")


def ptx_directory() -> Path:
    """Return the directory holding the ``*.cu`` helper files."""
    for candidate in _CANDIDATES:
        if (candidate / "mma.cu").is_file():
            return candidate
    raise FileNotFoundError(
        "numbaflash: PTX helper sources not found; looked in "
        + ", ".join(str(c) for c in _CANDIDATES)
    )


def ptx_source(family: str) -> str:
    """Path of one helper family's source file, e.g. ``ptx_source("mma")``."""
    path = ptx_directory() / f"{family}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"numbaflash: no PTX helper family {family!r} at {path}")
    return str(path)


def ptx_families() -> list[str]:
    """Names of every helper family shipped (one ``.cu`` file each)."""
    return sorted(p.stem for p in ptx_directory().glob("*.cu"))
