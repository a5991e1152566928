"""Shared memory a CTA, without a GPU: the dispatcher never picks a config that a GPU cannot
launch. The sm80 table may ship tiles of more than 99 KB (d256 128 x 64: 128 KB) for sm_80,
sm_90 and sm_100; sm_86, sm_89 and sm_120 (99 KB a CTA) then run another config."""

from __future__ import annotations

import pytest

from numbaflash import configs
from numbaflash.configs import (
    DEFAULTS,
    FAMILY_HEAD_DIMS,
    MAX_SHARED_BYTES,
    SMALLEST_SHARED_BYTES,
    SUPPORTED_HEAD_DIMS,
    ForwardConfig,
    forward_config,
    max_shared_bytes,
    table_key,
)
from numbaflash.operations import forward
from numbaflash.runtime import device

SMALL = ((8, 6), (8, 9), (12, 0))  # 99 KB a CTA
UNKNOWN = ((11, 0), (12, 1), (13, 0))  # not in MAX_SHARED_BYTES: assumed the smallest
BIG_D256 = ForwardConfig(256, block_m=128, block_n=64)  # 128 KB


def test_known_limits():
    assert SMALLEST_SHARED_BYTES == 99 * 1024 == min(MAX_SHARED_BYTES.values())
    for cap in SMALL:
        assert max_shared_bytes(cap) == 99 * 1024
    assert max_shared_bytes((8, 0)) == 163 * 1024 and max_shared_bytes((9, 0)) == 227 * 1024
    for cap in UNKNOWN:
        assert max_shared_bytes(cap) == SMALLEST_SHARED_BYTES
    assert BIG_D256.shared_bytes == 128 * 1024


def test_every_default_of_the_sm80_family_fits_every_gpu():
    """What a GPU falls back to when the table's entry does not fit must fit everywhere."""
    for (family, d), config in DEFAULTS.items():
        if family == "sm80":
            assert config.shared_bytes <= SMALLEST_SHARED_BYTES, (d, config)


# One GPU of each (family, shared-memory limit), the others of a class dispatching alike, and
# one the table does not know.
_CLASSES: dict = {}
for _cap in sorted(MAX_SHARED_BYTES):
    _CLASSES.setdefault((configs.dispatch_family(_cap, 64), max_shared_bytes(_cap)), _cap)
LIMIT_CLASSES = [*_CLASSES.values(), UNKNOWN[0]]


@pytest.mark.parametrize("cap", LIMIT_CLASSES, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dispatched_config_fits_the_gpu(cap, head_dim, causal):
    """With the shipped table: every GPU gets a config within its limit, and an sm_80-family GPU
    with the limit of sm_80 gets what the family's table says."""
    config = forward_config(cap, head_dim, causal)
    assert config.shared_bytes <= max_shared_bytes(cap)
    if configs.dispatch_family(cap, head_dim) == "sm80" and max_shared_bytes(cap) >= max_shared_bytes((8, 0)):
        assert config == forward_config((8, 0), head_dim, causal)



@pytest.mark.parametrize("causal", [False, True])
def test_entry_too_big_for_the_gpu_is_passed_over(table_with, causal):
    table_with({table_key("sm80", 256, causal): BIG_D256})
    assert forward_config((8, 0), 256, causal) == BIG_D256
    assert forward_config((9, 0), 256, causal) != BIG_D256  # Hopper runs its own kernel at d256
    for cap in SMALL + UNKNOWN:
        assert forward_config(cap, 256, causal) == DEFAULTS[("sm80", 256)]
    # The device's own limit (what the API passes) decides over the capability's.
    assert forward_config((8, 0), 256, causal, shared_limit=99 * 1024) == DEFAULTS[("sm80", 256)]
    assert forward_config((8, 9), 256, causal, shared_limit=163 * 1024) == BIG_D256


def test_a_gpu_entry_that_fits_comes_first(table_with):
    small = ForwardConfig(256, block_m=64, block_n=32)
    table_with({"sm80/d256/full": BIG_D256, "sm89/d256/full": small,
                              "sm86/d256/full": BIG_D256})
    assert forward_config((8, 9), 256, False) == small
    assert forward_config((8, 6), 256, False) == DEFAULTS[("sm80", 256)]  # its own entry is too big too


def test_no_config_fits(monkeypatch):
    with pytest.raises(RuntimeError, match="fits in 1024 bytes"):
        forward_config((8, 6), 256, False, shared_limit=1024)


def test_shipped_configs_include_the_small_gpu_fallbacks(table_with):
    table_with({"sm80/d256/full": BIG_D256})
    shipped = configs.shipped_configs()
    assert ("sm80", 256, False, BIG_D256) in shipped
    assert ("sm80", 256, False, DEFAULTS[("sm80", 256)]) in shipped
    assert len(shipped) == len(set(shipped))
    for family in ("sm80", "sm90"):
        assert {d for fam, d, _, _ in shipped if fam == family} == set(FAMILY_HEAD_DIMS[family])


def test_forced_config_too_big_fails_with_a_message(monkeypatch):
    """force_config bypasses the table; the API refuses to launch what the device cannot give."""
    monkeypatch.setattr(device.GPU, "shared_limit", lambda ordinal: 99 * 1024)
    with configs.force_config((8, 6), False, BIG_D256):
        assert forward_config((8, 6), 256, False) == BIG_D256
        with pytest.raises(RuntimeError, match="needs 131072 bytes of shared memory a CTA; device 0 "
                                               r"\(sm_86\) allows 101376"):
            forward.forward_kernel((8, 6), 0, 256, False, False)


def gpu_with_attributes(monkeypatch, values: dict, calls: list):
    """A GpuState over a stand-in driver whose attributes are ``values`` ({name: (id, value)}, the
    name without CU_DEVICE_ATTRIBUTE_); each read is appended to ``calls`` as (id, ordinal)."""
    attr = type("Attr", (), {f"CU_DEVICE_ATTRIBUTE_{name}": id_ for name, (id_, _) in values.items()})
    by_id = {id_: value for id_, value in values.values()}

    class FakeDriver:
        CUdevice_attribute = attr
        CUresult = type("Result", (), {"CUDA_SUCCESS": 0})

        @staticmethod
        def cuDeviceGetAttribute(attr_id, ordinal):
            calls.append((attr_id, ordinal))
            return 0, by_id[attr_id]

    gpu = device.GpuState()
    monkeypatch.setattr(gpu, "driver", lambda: FakeDriver)
    return gpu


def test_device_limit_is_read_once_per_device(monkeypatch):
    calls = []
    gpu = gpu_with_attributes(monkeypatch, {"MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": (97, 101376)}, calls)
    assert gpu.shared_limit(3) == 101376
    assert gpu.shared_limit(3) == 101376
    assert calls == [(97, 3)]


def test_memory_bandwidth_is_read_once_and_zero_where_not_reported(monkeypatch):
    """Peak bandwidth = 2 transfers a memory clock (kHz) x the bus width (bits) / 8; a driver
    without those attributes gives 0.0 (``launch_decode.streaming_ctas`` then keeps the H100's
    counts)."""
    calls = []
    gpu = gpu_with_attributes(monkeypatch, {"MEMORY_CLOCK_RATE": (36, 2619000),
                                            "GLOBAL_MEMORY_BUS_WIDTH": (37, 5120)}, calls)
    assert gpu.memory_bandwidth(1) == pytest.approx(3.352e12, rel=1e-3)  # an H100 SXM
    assert gpu.memory_bandwidth(1) == pytest.approx(3.352e12, rel=1e-3)
    assert calls == [(36, 1), (37, 1)]

    gpu = gpu_with_attributes(monkeypatch, {}, calls)
    assert gpu.memory_bandwidth(0) == 0.0
