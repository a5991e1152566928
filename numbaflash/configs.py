"""Kernel configurations chosen by ``benchmarks/autotune.py``, per GPU family, head dim and
causality. The table lives in ``tuned_configs.json`` beside this file; entries missing from
it fall back to ``DEFAULTS``."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .kernels.forward_mma import ForwardConfig

SUPPORTED_HEAD_DIMS = (64, 128)
TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
# (block_m, block_n, warp_m_tiles) by head dim, used where the tuned table has no entry.
DEFAULTS = {64: (128, 128, 1), 128: (128, 64, 1)}
# What benchmarks/autotune.py tries: (block_m, block_n, warp_m_tiles) by head dim.
CANDIDATES = {
    64: [(128, 128, 1), (128, 64, 1), (64, 128, 1), (64, 64, 1), (256, 64, 2)],
    128: [(128, 64, 1), (64, 64, 1), (128, 32, 1), (64, 128, 1), (128, 128, 1)],
}
# Set by benchmarks/autotune.py to time a candidate: table key -> (block_m, block_n, warp_m_tiles).
OVERRIDES: dict[str, tuple[int, int, int]] = {}


def arch_family(capability: tuple[int, int]) -> str:
    """'sm90' for Hopper, 'sm80' for every other supported GPU (sm_80 .. sm_89, sm_100+)."""
    return "sm90" if capability[0] == 9 else "sm80"


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    if TABLE_PATH.is_file():
        return json.loads(TABLE_PATH.read_text())
    return {}


def table_key(family: str, head_dim: int, causal: bool) -> str:
    return f"{family}/d{head_dim}/{'causal' if causal else 'full'}"


def forward_config(capability: tuple[int, int], head_dim: int, causal: bool) -> ForwardConfig:
    """The configuration to launch for this GPU and problem."""
    key = table_key(arch_family(capability), head_dim, causal)
    if key in OVERRIDES:
        block_m, block_n, m_tiles = OVERRIDES[key]
    elif key in _table():
        entry = _table()[key]
        block_m, block_n, m_tiles = entry["block_m"], entry["block_n"], entry["warp_m_tiles"]
    else:
        block_m, block_n, m_tiles = DEFAULTS[head_dim]
    return ForwardConfig(head_dim=head_dim, block_m=block_m, block_n=block_n, warp_m_tiles=m_tiles)


def shipped_configs() -> list[tuple[str, int, bool, ForwardConfig]]:
    """Every (family, head dim, causal, config) the dispatcher can launch."""
    capabilities = {"sm80": (8, 0), "sm90": (9, 0)}
    return [
        (family, d, causal, forward_config(cap, d, causal))
        for family, cap in capabilities.items()
        for d in SUPPORTED_HEAD_DIMS
        for causal in (False, True)
    ]


FAMILY_ARCH = {"sm80": "sm_80", "sm90": "sm_90a"}  # the target each family compiles for
