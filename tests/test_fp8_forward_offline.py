"""Offline SASS of the e4m3 Hopper forward (issue 60), compiled for sm_90a with no GPU: every
product an 8-bit wgmma (``QGMMA``, none of the 16-bit ``HGMMA``), P packed by the e4m3 conversion,
every helper inlined, no local memory and no spill. Per head dim the full build, dense and packed
(bf16 output; the fp16 builds differ only in the output's conversion), and the causal build: at
head dim 256 its consumers' 240 registers (O 128, S 64, P 16) leave too few for the causal mask,
and it spills a few words (pinned below; 64-key tiles spill nothing but lose 13% at 16k,
docs/PERFORMANCE.md [FP8V])."""

from __future__ import annotations

import pytest
from _sass import assert_fully_inlined

from numbaflash import configs
from numbaflash.kernels.families import kernel_argtypes, make_kernel, spec_of
from numbaflash.tools import inspect as nfi


@pytest.mark.parametrize("build", ["full", "varlen", "causal"])
@pytest.mark.parametrize("head_dim", configs.FP8_HEAD_DIMS)
def test_fp8_forward_sass(head_dim, build):
    config = configs.FP8_DEFAULTS[head_dim]
    spec = spec_of(config, "forward", True, causal=build == "causal", varlen=build == "varlen")
    kernel = make_kernel(spec)
    report = nfi.inspect_kernel(kernel, kernel_argtypes(spec), "sm_90a", kernel.__name__)
    if build == "causal" and head_dim == 256:  # the known spill (module docstring): bounded
        assert report.stack_bytes <= 32 and report.count("LDL") + report.count("STL") <= 16, report.opcodes
        assert report.count("CALL") == 0
    else:
        assert_fully_inlined(report)
    s_steps = head_dim // 32  # k-steps of S = Q Kᵀ (32 bytes each)
    pv_steps = config.block_n // 32  # k-steps of O += P V
    # S: a tile's first alone and each paired issue; PV: each paired issue and a tile's last.
    assert report.count("QGMMA") == 2 * s_steps + 2 * pv_steps, report.opcodes
    assert report.count("HGMMA") == 0
    assert report.count("F2FP") >= 2 * 2 * pv_steps * 4  # two P packings (4 registers, 2 cvt each)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("head_dim", configs.FP8_HEAD_DIMS)
def test_fp8_v_prep_sass(head_dim, varlen):
    """The V prep (``kernels.fp8_prep``): every load of a thread issued before its first shared store
    (as many global loads as words it reads; packed: and the sequence's two offsets); then, for
    each head-dim word a lane transposes, four shared loads, eight byte permutes and four
    whole-word stores; no local memory or spill within its launch bounds' registers."""
    from numbaflash.kernels.fp8_prep import KEYS_PER_CTA, THREADS

    spec = spec_of(configs.FP8_DEFAULTS[head_dim], "fp8_v", True, varlen=varlen)
    kernel = make_kernel(spec)
    report = nfi.inspect_kernel(kernel, kernel_argtypes(spec), "sm_90a", kernel.__name__)
    assert_fully_inlined(report)
    reads = KEYS_PER_CTA * head_dim // 4 // THREADS
    assert report.count("LDG") == reads + 2 * varlen and report.count("STS") == reads, report.opcodes
    words = head_dim // 4 // (THREADS // 32)  # head-dim words a lane transposes
    assert report.count("STG") == 4 * words and report.count("LDS") == 4 * words, report.opcodes
    assert report.count("PRMT") == 8 * words, report.opcodes
    assert report.registers <= 65536 // (THREADS * kernel.launch_bounds[1])


@pytest.mark.parametrize("head_dim", configs.FP8_HEAD_DIMS)
def test_fp8_mma_forward_sass(head_dim):
    """The e4m3 mma.sync forward (``configs.FP8_MMA_DEFAULTS``) for sm_89, causal: every product an
    8-bit mma.sync (``QMMA``: S's D / 32 k-steps and PV's block_n / 32 over their n-tiles), none of
    the 16-bit ``HMMA``, every helper inlined, no local memory and no spill."""
    config = configs.FP8_MMA_DEFAULTS[head_dim]
    spec = spec_of(config, "forward", True, "sm_89", causal=True)
    kernel = make_kernel(spec)
    report = nfi.inspect_kernel(kernel, kernel_argtypes(spec), "sm_89", kernel.__name__,
                                launch_bounds=kernel.launch_bounds)
    assert_fully_inlined(report)
    s_mma = head_dim // 32 * config.block_n // 8
    pv_mma = config.block_n // 32 * head_dim // 8
    assert report.count("QMMA") == config.warp_m_tiles * (s_mma + pv_mma), report.opcodes
    assert report.count("HMMA") == 0
