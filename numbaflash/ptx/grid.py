"""Programmatic dependent launch (``ptx/grid.cu``, sm_90+; no-ops below): a kernel's signal that
the stream's next kernel may start, and that kernel's wait for the one before it."""

from __future__ import annotations

from numba import types

from ._declare import declare

grid_launch_dependents = declare("grid", "grid_launch_dependents", types.void())
grid_launch_dependents.__doc__ = (
    "griddepcontrol.launch_dependents: the stream's next kernel, if launched programmatically, may "
    "start once every CTA of this grid has called this or exited (sm_90+; a no-op below).")
grid_dependency_wait = declare("grid", "grid_dependency_wait", types.void())
grid_dependency_wait.__doc__ = (
    "griddepcontrol.wait: wait until the grids this kernel depends on have completed and their "
    "writes are visible; returns at once without a programmatic launch (sm_90+; a no-op below).")
