"""The e4m3 forward's transposed V, written with torch from ``fp8_layout``'s definition: what
``kernels.fp8_prep`` must produce (``test_fp8_forward_cpu.py`` checks this model against the
layout; ``test_fp8_forward_gpu.py`` checks the kernel against this model)."""

from __future__ import annotations

from numbaflash.kernels.fp8_layout import key_index, padded_keys


def reference_vt(torch, v):
    """V (batch, seqlen_k, heads_kv, head_dim) e4m3 -> (batch, heads_kv, head_dim, padded keys)
    uint8, column c of each 32 holding key ``KEY_ORDER[c]`` of its group, zero past seqlen_k."""
    b, s, h, d = v.shape
    keys = padded_keys(s)
    vt = torch.zeros((b, h, d, keys), dtype=torch.uint8, device=v.device)
    vt[..., :s] = v.view(torch.uint8).permute(0, 2, 3, 1)
    order = torch.tensor(key_index(s), dtype=torch.long, device=v.device)
    return vt.index_select(3, order)
