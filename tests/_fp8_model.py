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


def reference_vt_packed(torch, v, cu_seqlens_k):
    """Packed V (total_k, heads_kv, head_dim) e4m3 and its (batch + 1,) offsets -> (1, heads_kv,
    head_dim, ``packed_vt_keys``) uint8: sequence b's ``reference_vt`` from column
    ``sequence_vt_start(cu[b], b)``, zeros up to the next sequence's first column."""
    from numbaflash.kernels.fp8_layout import packed_vt_keys, sequence_vt_start

    cu = [int(x) for x in cu_seqlens_k]
    batch = len(cu) - 1
    _, h, d = v.shape
    vt = torch.zeros((1, h, d, packed_vt_keys(cu[-1], batch)), dtype=torch.uint8, device=v.device)
    for b in range(batch):
        if cu[b + 1] > cu[b]:
            one = reference_vt(torch, v[None, cu[b]:cu[b + 1]])
            start = sequence_vt_start(cu[b], b)
            vt[..., start:start + one.shape[3]] = one
    return vt
