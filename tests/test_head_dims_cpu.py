"""Head dims 32, 96 and 256 without a GPU: dispatch (Hopper falls back to the mma.sync kernel
where its own kernel lacks the head dim: 32), the configs, and the bank math of the swizzled layouts.
The SASS checks of the shipped configs (spills, local memory, calls, HMMA) are in
``test_forward_offline.py``, which covers every config ``shipped_configs`` lists."""

from __future__ import annotations

import pytest

from numbaflash import configs
from numbaflash.configs import (
    CANDIDATES,
    FAMILY_HEAD_DIMS,
    SUPPORTED_HEAD_DIMS,
    ForwardConfig,
    WsConfig,
    dispatch_family,
    forward_config,
)
from numbaflash.kernels import smem

HOPPER, AMPERE, ADA = (9, 0), (8, 0), (8, 9)
NEW_DIMS = (32, 96, 256)
HOPPER_FALLBACK_DIMS = (32,)  # the Hopper kernel lacks these: Hopper runs the mma.sync kernel


def test_supported_head_dims():
    assert SUPPORTED_HEAD_DIMS == (32, 64, 96, 128, 256)
    assert FAMILY_HEAD_DIMS["sm80"] == SUPPORTED_HEAD_DIMS
    assert set(FAMILY_HEAD_DIMS["sm90"]) <= set(SUPPORTED_HEAD_DIMS)
    assert set(SUPPORTED_HEAD_DIMS) - set(FAMILY_HEAD_DIMS["sm90"]) == set(HOPPER_FALLBACK_DIMS)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_falls_back_to_the_mma_kernel(head_dim, causal):
    """On Hopper, head dims the Hopper kernel lacks run the sm80 family's config."""
    config = forward_config(HOPPER, head_dim, causal)
    assert config.head_dim == head_dim
    if head_dim in FAMILY_HEAD_DIMS["sm90"]:
        assert dispatch_family(HOPPER, head_dim) == "sm90"
    else:
        assert dispatch_family(HOPPER, head_dim) == "sm80"
        assert isinstance(config, ForwardConfig)
        assert config == forward_config(AMPERE, head_dim, causal)
    for cap in (AMPERE, ADA, (12, 0)):
        assert dispatch_family(cap, head_dim) == "sm80"
        assert isinstance(forward_config(cap, head_dim, causal), ForwardConfig)


@pytest.mark.parametrize("head_dim", HOPPER_FALLBACK_DIMS)
def test_force_config_on_hopper_at_a_fallback_dim(head_dim):
    other = next(c for c in CANDIDATES[("sm80", head_dim)] if c != forward_config(HOPPER, head_dim, True))
    with configs.force_config(HOPPER, True, other):
        assert forward_config(HOPPER, head_dim, True) == other
        assert forward_config(HOPPER, head_dim, False) == forward_config(AMPERE, head_dim, False)
        assert forward_config(AMPERE, head_dim, True) != other  # forcing is per GPU family
    assert forward_config(HOPPER, head_dim, True) != other


def test_shipped_configs_cover_every_dim_once_per_family():
    shipped = configs.shipped_configs()
    for family in ("sm80", "sm90"):
        dims = {d for fam, d, _, _ in shipped if fam == family}
        assert dims == set(FAMILY_HEAD_DIMS[family])
    for family, d, causal, config in shipped:
        assert config.head_dim == d
        config.check()
        if family == "sm80":
            assert isinstance(config, ForwardConfig)
        if d in NEW_DIMS and d in FAMILY_HEAD_DIMS[family]:
            assert configs.table_key(family, d, causal) in configs._table()  # tuned-table entry


@pytest.mark.parametrize("head_dim", NEW_DIMS)
def test_candidates_of_the_new_dims(head_dim):
    if head_dim in HOPPER_FALLBACK_DIMS:
        assert configs.runnable_candidates(HOPPER, head_dim) == CANDIDATES[("sm80", head_dim)]
        assert ("sm90", head_dim) not in CANDIDATES
    else:  # the warp-specialised kernel first, then the mma.sync kernel (no cp.async wgmma kernel)
        hopper = configs.runnable_candidates(HOPPER, head_dim)
        ws = [c for c in hopper if isinstance(c, WsConfig)]
        assert ws and hopper == ws + CANDIDATES[("sm80", head_dim)]
        for cand in ws:
            cand.check()
            assert cand.shared_bytes <= 227 * 1024
    for cand in CANDIDATES[("sm80", head_dim)]:
        cand.check()
        assert isinstance(cand, ForwardConfig)
        assert cand.shared_bytes <= 227 * 1024
    for cap in (AMPERE, ADA, (8, 6), (12, 0)):  # 163 KB (A100) or 99 KB a CTA
        for causal in (False, True):
            shipped = forward_config(cap, head_dim, causal)
            assert shipped in CANDIDATES[("sm80", head_dim)]
            assert shipped.shared_bytes <= configs.max_shared_bytes(cap)


@pytest.mark.parametrize("config, message", [
    (ForwardConfig(48), "multiple of 32"), (ForwardConfig(288), "multiple of 32"),
    (ForwardConfig(256, block_m=16, block_n=16), "8-row swizzle groups"),
    (ForwardConfig(64, warp_m_tiles=2, interleave_pv=True, early_k=True), "early_k must be False"),
])
def test_forward_config_check_rejects(config, message):
    with pytest.raises(ValueError, match=message):
        config.check()


# --------------------------------------------------------------------------- swizzle bank math


@pytest.fixture
def offset(monkeypatch):
    """``smem.swizzled_offset`` run as plain Python."""
    monkeypatch.setattr(smem, "swizzle_phase", smem.swizzle_phase.py_func)
    return smem.swizzled_offset.py_func


def bank_group(byte_offset: int) -> int:
    """Which of the 8 16-byte groups of the 32 four-byte banks a 16-byte access falls in."""
    return byte_offset // 16 % 8


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("rows", [16, 64, 128])
def test_layout_is_a_permutation_of_the_tile(offset, head_dim, rows):
    row_bytes = 128 if head_dim % 64 == 0 else 64
    chunks = head_dim // 8
    seen = {offset(r, c, rows, row_bytes) for r in range(rows) for c in range(chunks)}
    assert seen == set(range(0, rows * head_dim * 2, 16))


@pytest.mark.parametrize("row_bytes", [64, 128])
def test_eight_rows_of_one_chunk_hit_eight_bank_groups(offset, row_bytes):
    """One 8x8 ldmatrix matrix (or one epilogue store of 8 rows): 8 consecutive rows from a
    multiple of 8 at the same logical chunk are conflict free, in every column block."""
    for first in range(0, 64, 8):
        for chunk in range(3 * row_bytes // 16):
            groups = {bank_group(offset(first + i, chunk, 64, row_bytes)) for i in range(8)}
            assert len(groups) == 8, (first, chunk)


@pytest.mark.parametrize("head_dim", NEW_DIMS)
def test_copy_of_one_warp_is_conflict_free(offset, head_dim):
    """cp.async of one column block, 8 threads a phase (128 bytes): thread t of the block
    copy writes chunk t % per_row of row t // per_row; each phase hits 8 bank groups."""
    row_bytes = 128 if head_dim % 64 == 0 else 64
    per_row = row_bytes // 16
    for block in range(head_dim // 8 // per_row):
        for phase in range(4):
            threads = range(8 * phase, 8 * phase + 8)
            groups = {bank_group(offset(t // per_row, block * per_row + t % per_row, 64, row_bytes))
                      for t in threads}
            assert len(groups) == 8


@pytest.mark.parametrize("row_bytes", [64, 128])
def test_ldmatrix_offsets_match_the_layout(monkeypatch, offset, row_bytes):
    """``ldmatrix_offsets`` + ``block_offset`` address the same byte as ``swizzled_offset``."""
    monkeypatch.setattr(smem, "swizzled_offset", offset)
    tile_rows = 64
    for row in range(16):
        for half in (0, 1):
            offsets = [0, 0, 0, 0]
            smem.ldmatrix_offsets.py_func(offsets, row, half, row_bytes)
            for kb in range(16 if row_bytes == 128 else 6):
                got = smem.block_offset.py_func(offsets, kb, tile_rows, row_bytes)
                assert got == offset(row, 2 * kb + half, tile_rows, row_bytes)
                # rows 16 further down: the same pattern, 16 rows of bytes later
                assert got + 16 * row_bytes == offset(row + 16, 2 * kb + half, tile_rows, row_bytes)


def test_interleave_pv_is_named_and_kept_by_the_table():
    """The knob shows in the kernel name and survives the JSON table round trip."""
    cfg = ForwardConfig(64, block_m=128, block_n=128, warp_m_tiles=2, q_in_regs=False, double_buffer=True,
                        interleave_pv=True)
    assert cfg.tag == "_qs_db_ip"
    assert configs.config_from_json(configs.config_to_json(cfg)) == cfg
    # entries written before the knob existed read as interleave_pv=False
    old = {k: v for k, v in configs.config_to_json(cfg).items() if k != "interleave_pv"}
    assert configs.config_from_json(old).interleave_pv is False
