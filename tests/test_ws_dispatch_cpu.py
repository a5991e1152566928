"""The warp-specialised Hopper kernel behind ``flash_attention``, on CPU: Hopper dispatches it at
the head dims it has, the table round-trips it, its launch ABI matches its Numba signature, the
sm80 family refuses it, and tensor-map strides are what TMA needs."""

from __future__ import annotations

import pytest

from numbaflash import configs
from numbaflash.kernels.shapes import WsConfig
from numbaflash.operands import Operand
from numbaflash.operations import forward
from numbaflash.operations.launch_forward import tma_strides
from numbaflash.runtime import device

HOPPER, AMPERE = (9, 0), (8, 0)


@pytest.mark.parametrize("head_dim", configs.FAMILY_HEAD_DIMS["sm90"])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_dispatches_the_warp_specialised_kernel(head_dim, causal):
    config = configs.forward_config(HOPPER, head_dim, causal)
    assert isinstance(config, WsConfig) and config.head_dim == head_dim
    config.check()
    assert not isinstance(configs.forward_config(AMPERE, head_dim, causal), WsConfig)


def test_hopper_kernel_head_dims():
    """Issue 14: the Hopper kernel runs 96 (64B swizzle) and 256 (O staged in Q) as well."""
    assert configs.FAMILY_HEAD_DIMS["sm90"] == (64, 96, 128, 256)
    assert configs.forward_config(HOPPER, 96, False).row_bytes == 64
    for causal in (False, True):
        assert configs.forward_config(HOPPER, 256, causal).o_in_q


def test_table_round_trips_ws_entries():
    for family, _, _, config in configs.shipped_configs():
        assert configs.config_from_json(configs.config_to_json(config)) == config
        if family == "sm90":
            assert configs.config_to_json(config)["kernel"] == "ws"


def test_ws_candidates_are_valid_and_listed_first():
    for d in configs.FAMILY_HEAD_DIMS["sm90"]:
        cands = configs.CANDIDATES[("sm90", d)]
        ws = [c for c in cands if isinstance(c, WsConfig)]
        assert ws and cands[: len(ws)] == ws
        for c in ws:
            c.check()


def test_sm80_family_refuses_the_hopper_kernel():
    with pytest.raises(ValueError, match="needs Hopper"), configs.force_config(AMPERE, False, WsConfig(64)):
        pass


def op(shape, strides):
    return Operand("q", shape, "float16", True, None, strides, 0)


def test_tma_strides_are_bytes_and_fill_broadcast_size_one_dims():
    assert tma_strides(op((2, 100, 8, 64), (51200, 512, 64, 1))) == [102400, 1024, 128, 2]
    # a size-1 batch with stride 0 (expanded): any stride works, TMA needs a nonzero one
    assert tma_strides(op((1, 100, 8, 64), (0, 512, 64, 1))) == [102400, 1024, 128, 2]
    # a head range of a packed qkv tensor keeps the caller's strides
    assert tma_strides(op((2, 100, 8, 64), (153600, 1536, 64, 1))) == [307200, 3072, 128, 2]



def test_short_sequences_read_the_short_entry_first(table_with, monkeypatch):
    """``<key>/short`` serves problems whose longer sequence is at most SHORT_SEQLEN; longer
    ones, and callers that give no length, get the plain entry; a missing short entry falls
    back to the plain one."""
    long_cfg, short_cfg = WsConfig(64, 128, 2, consumers=3), WsConfig(64, 192, 2)
    table_with({"sm90/d64/causal": long_cfg, "sm90/d64/causal/short": short_cfg,
                              "sm90/d64/full": long_cfg})
    monkeypatch.delitem(configs._table(), "sm90/d64/full/short", raising=False)
    limit = configs.SHORT_SEQLEN
    assert configs.table_key("sm90", 64, True, short=True) == "sm90/d64/causal/short"
    assert configs.forward_config(HOPPER, 64, True, seqlen=limit) == short_cfg
    assert configs.forward_config(HOPPER, 64, True, seqlen=1) == short_cfg
    assert configs.forward_config(HOPPER, 64, True, seqlen=limit + 1) == long_cfg
    assert configs.forward_config(HOPPER, 64, True) == long_cfg
    assert configs.forward_config(HOPPER, 64, False, seqlen=1024) == long_cfg
    with configs.force_config(HOPPER, True, long_cfg):  # a forced config serves every length
        assert configs.forward_config(HOPPER, 64, True, seqlen=1024) == long_cfg


def test_long_sequences_read_the_long_entry_first(table_with, monkeypatch):
    """``<key>/long`` serves problems whose longer sequence is at least LONG_SEQLEN; shorter
    ones, and callers that give no length, get the plain entry; a missing long entry falls
    back to the plain one."""
    plain, long_cfg = WsConfig(128, 128, 2), WsConfig(128, 176, 2, q_stages=1,
                                                                     o_in_v=True)
    table_with({"sm90/d128/full": plain, "sm90/d128/full/long": long_cfg, "sm90/d128/causal": plain})
    monkeypatch.delitem(configs._table(), "sm90/d128/causal/long", raising=False)
    limit = configs.LONG_SEQLEN
    assert configs.table_key("sm90", 128, False, long=True) == "sm90/d128/full/long"
    assert configs.forward_config(HOPPER, 128, False, seqlen=limit) == long_cfg
    assert configs.forward_config(HOPPER, 128, False, seqlen=16 * limit) == long_cfg
    assert configs.forward_config(HOPPER, 128, False, seqlen=limit - 1) == plain
    assert configs.forward_config(HOPPER, 128, False) == plain
    assert configs.forward_config(HOPPER, 128, True, seqlen=limit) == plain
    with configs.force_config(HOPPER, False, plain):  # a forced config serves every length
        assert configs.forward_config(HOPPER, 128, False, seqlen=limit) == plain


def test_d128_long_sequences_run_flashattention3s_tile():
    """The shipped table: d128 non-causal from LONG_SEQLEN keys on runs 128 x 176 with O staged
    in the V ring (1% padding at 8k and 16k keys; it loses at 4k, where 4096 = 23.3 x 176)."""
    cfg = configs.forward_config(HOPPER, 128, False, seqlen=configs.LONG_SEQLEN)
    assert (cfg.block_n, cfg.q_stages, cfg.o_in_v) == (176, 1, True)
    assert configs.forward_config(HOPPER, 128, False, seqlen=4096).block_n == 128


def test_shipped_configs_include_the_short_and_long_entries():
    shipped = configs.shipped_configs()
    for family, cap in configs.FAMILY_CAPABILITY.items():
        for d in configs.FAMILY_HEAD_DIMS[family]:
            for causal in (False, True):
                for span in (configs.SHORT_SEQLEN, configs.LONG_SEQLEN):
                    config = configs.forward_config(cap, d, causal, seqlen=span)
                    assert (family, d, causal, config) in shipped
    assert len(set(shipped)) == len(shipped)


def test_short_and_long_table_entries_are_valid():
    """Every ``/short`` or ``/long`` key names a plain key that exists, and its config checks out."""
    for key, entry in configs._table().items():
        for span in ("/short", "/long"):
            if key.endswith(span):
                assert key.removesuffix(span) in configs._table(), key
                configs.config_from_json(entry).check()


@pytest.mark.parametrize("sq, sk", [(3000, 100), (100, 2049), (1024, 1024)])
def test_api_dispatch_passes_the_longer_sequence(monkeypatch, sq, sk):
    """flash_attention asks for the config of max(seqlen_q, seqlen_k) (no GPU: the dispatch is
    stubbed and stops the call)."""
    import numpy as np

    import numbaflash

    seen = []

    class Stop(Exception):
        pass

    def fake_kernel(capability, device, head_dim, causal, bf16, seqlen=None, **variant):
        seen.append(seqlen)
        raise Stop

    monkeypatch.setattr(device.GPU, "current", lambda: (HOPPER, 0))
    monkeypatch.setattr(forward, "forward_kernel", fake_kernel)
    q = np.zeros((1, sq, 2, 64), np.float16)
    k = np.zeros((1, sk, 2, 64), np.float16)
    with pytest.raises(Stop):
        numbaflash.flash_attention(q, k, k, causal=True)
    assert seen == [max(sq, sk)]


def test_window_and_varlen_calls_read_their_variant_entries_first():
    """``<key>/window`` and ``<key>/varlen`` entries serve calls with a window or packed sequences:
    at d256 the non-causal 128 x 80 tile spills with either (2 words of local memory), so those
    calls run the causal 128 x 64 tile; the softcap alone keeps 128 x 80."""
    full, causal = configs.forward_config(HOPPER, 256, False), configs.forward_config(HOPPER, 256, True)
    assert (full.block_n, causal.block_n) == (80, 64)
    for variant in ({"window": True}, {"varlen": True}, {"window": True, "varlen": True}):
        for seqlen in (None, 1024, 16384):
            assert configs.forward_config(HOPPER, 256, False, seqlen=seqlen, **variant) == causal, variant
    assert configs.forward_config(HOPPER, 256, False) == full  # (the softcap picks no config)
    for d in (64, 96, 128):  # no variant entries: the plain call's config
        for variant in ({"window": True}, {"varlen": True}):
            plain = configs.forward_config(HOPPER, d, False)
            assert configs.forward_config(HOPPER, d, False, **variant) == plain
