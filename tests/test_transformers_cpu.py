"""numbaflash's transformers integration (issue 57) on the CPU: registration, the load-time
checks, and the whole FlashAttention path transformers runs on our functions (padding to varlen,
packed sequences, windows, softcap, sinks, generate), with numbaflash's two kernel calls replaced
by a float64 reference of their contract. The kernels themselves: tests/test_transformers_gpu.py."""

import copy
import math

import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
transformers = pytest.importorskip("transformers", reason="the transformers integration needs transformers")

import numbaflash.api  # noqa: E402
from numbaflash import torch_route  # noqa: E402
from numbaflash.integrations import transformers as nf_hf  # noqa: E402


def reference(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              learnable_sink=None):
    """``numbaflash.flash_attention``'s contract in float64: q (b, sq, hq, d), k and v (b, sk,
    hkv, d or dv); GQA, bottom-right causal and window, softcap, sink; rows with no key give 0."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qf, kf, vf = (x.double().transpose(1, 2) for x in (q, k, v))
    kf, vf = (x.repeat_interleave(hq // hkv, dim=1) for x in (kf, vf))
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    s = s.masked_fill(~seen, -math.inf)
    if learnable_sink is not None:
        assert learnable_sink.dtype == torch.float32 and learnable_sink.shape == (hq,)
        s = torch.cat([s, learnable_sink.double()[None, :, None, None].expand(b, hq, sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if learnable_sink is not None:
        p = p[..., :-1]
    return (p @ vf).transpose(1, 2).to(q.dtype)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
    outs = []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        outs.append(reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **options)[0])
    return torch.cat(outs)


def reference_kvcache(q, k_cache, v_cache, cache_seqlens, *, causal=True, softmax_scale=None, softcap=0.0,
                      learnable_sink=None, cache_leftpad=None, window_size=(-1, -1)):
    """``flash_attention_with_kvcache``'s contract without new rows: sequence b attends to cache
    rows cache_leftpad[b] (0 without) .. cache_seqlens[b] - 1, causal bottom-right over them."""
    assert cache_seqlens.dtype == torch.int32
    assert cache_leftpad is None or cache_leftpad.dtype == torch.int32
    outs = []
    for b in range(q.shape[0]):
        lo, hi = 0 if cache_leftpad is None else int(cache_leftpad[b]), int(cache_seqlens[b])
        outs.append(reference(q[b:b + 1], k_cache[b:b + 1, lo:hi], v_cache[b:b + 1, lo:hi], causal=causal,
                              softmax_scale=softmax_scale, softcap=softcap, learnable_sink=learnable_sink,
                              window_size=window_size))
    return torch.cat(outs)


@pytest.fixture
def kernels(monkeypatch):
    """numbaflash's three calls replaced by the reference; the calls each made, by path."""
    calls = {"dense": 0, "varlen": 0, "kvcache": 0}

    def dense(*args, **kwargs):
        calls["dense"] += 1
        return reference(*args, **kwargs)

    def varlen(*args, **kwargs):
        calls["varlen"] += 1
        return reference_varlen(*args, **kwargs)

    def kvcache(*args, **kwargs):
        calls["kvcache"] += 1
        return reference_kvcache(*args, **kwargs)

    monkeypatch.setattr(numbaflash.api, "flash_attention", dense)
    monkeypatch.setattr(numbaflash.api, "flash_attention_varlen", varlen)
    monkeypatch.setattr(numbaflash.api, "flash_attention_with_kvcache", kvcache)
    # no scalars checked by an earlier test's route: the training call takes api.flash_attention
    monkeypatch.setattr(torch_route, "_CHECKED", {})
    nf_hf.register()
    return calls


def tiny(config_class, **overrides):
    base = {"vocab_size": 97, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "max_position_embeddings": 256, "pad_token_id": 0}
    return config_class(**{**base, **overrides})


def models(config, seed=0):
    """The same weights on numbaflash and on eager attention, float32, eval mode."""
    torch.manual_seed(seed)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                         attn_implementation="numbaflash").eval()
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    return ours, eager


def assert_close(a, b):
    assert (a - b).norm() <= 1e-5 * b.norm(), float((a - b).norm() / b.norm())


def left_padded(pads, length):
    """Token ids (len(pads), length) and their 2-D mask, row r left-padded by pads[r] tokens."""
    ids = torch.randint(1, 97, (len(pads), length))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def packed_and_alone(ours, eager, lengths, **options):
    """Logits of one row packing sequences of ``lengths`` (position_ids restarting; ``options``
    passed along) on ``ours``, and of each sequence alone on ``eager``, side by side."""
    ids = torch.randint(1, 97, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(ids, position_ids=positions, **options).logits
        alone = torch.cat([eager(part).logits for part in ids.split(lengths, dim=1)], dim=1)
    return packed, alone


def assert_same_tokens(ours, eager, ids, mask, new, **options):
    """Greedy generation of ``new`` tokens on both models gives the same tokens."""
    gen = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **options)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **gen), eager.generate(ids, **gen))


def test_register_makes_the_name_loadable_and_is_idempotent(kernels):
    assert nf_hf.register() == "numbaflash" == nf_hf.register()
    ours, _ = models(tiny(transformers.LlamaConfig))
    assert ours.config._attn_implementation == "numbaflash"
    eager = transformers.AutoModelForCausalLM.from_config(tiny(transformers.LlamaConfig),
                                                          attn_implementation="eager")
    eager.set_attn_implementation("numbaflash")
    assert eager.config._attn_implementation == "numbaflash"
    with pytest.raises(ValueError, match="must contain 'flash'"):
        nf_hf.register("numba")


def test_prefill_without_padding_runs_the_dense_call(kernels):
    ours, eager = models(tiny(transformers.LlamaConfig))
    ids = torch.randint(1, 97, (3, 40))
    with torch.no_grad():
        assert_close(ours(ids).logits, eager(ids).logits)
    assert kernels["dense"] == 2 and kernels["varlen"] == 0  # one call a layer


def test_a_batch_of_one_reads_its_positions_once_a_forward(kernels, monkeypatch):
    """A batch of one: transformers' FlashAttention path tests its position_ids for packing in
    every layer (a host sync each); ours tests them once a forward (every layer gets the same
    tensor) and runs the dense call, bypassing that path."""
    import transformers.modeling_flash_attention_utils as fa_utils

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' FlashAttention path ran")

    monkeypatch.setattr(fa_utils, "_flash_attention_forward", refuse)
    tests = []
    monkeypatch.setattr(nf_hf, "_LAST_POSITIONS", Recorded(tests))
    ours, eager = models(tiny(transformers.LlamaConfig, num_hidden_layers=3))
    ids = torch.randint(1, 97, (1, 40))
    with torch.no_grad():
        assert_close(ours(ids).logits, eager(ids).logits)
    assert kernels["dense"] == 3 and len(tests) == 1


def test_a_model_that_makes_its_position_ids_is_not_read(kernels, monkeypatch):
    """Given no position_ids, transformers' decoders make consecutive ones (``arange`` from the
    cache's length): a batch of one runs the dense call without reading them (no host sync).
    position_ids given (by keyword or position, packed or not) are read once a forward; the count
    of forwards that make their own returns to zero after each, one that raises too."""
    reads = []
    real = nf_hf.restarts
    monkeypatch.setattr(nf_hf, "restarts", lambda positions: reads.append(positions) or real(positions))
    ours, eager = models(tiny(transformers.LlamaConfig, num_hidden_layers=3))
    ids = torch.randint(1, 97, (1, 40))
    with torch.no_grad():
        want = eager(ids).logits
        assert_close(ours(ids).logits, want)
        assert reads == [] and kernels["dense"] == 3 and not nf_hf.made_positions()
        assert_close(ours(ids, position_ids=torch.arange(40)[None]).logits, want)
        assert len(reads) == 1 and kernels["dense"] == 6
        assert_close(ours(ids, None, torch.arange(40)[None]).logits, want)  # (input_ids, mask, positions)
        assert len(reads) == 2
        assert_close(*packed_and_alone(ours, eager, (7, 20, 13)))
        assert len(reads) == 3 and kernels["varlen"] == 3
        with pytest.raises(Exception):  # noqa: B017 (any error: the count must come back to zero)
            ours(ids.float())
        assert not nf_hf.made_positions() and not nf_hf._MADE.modules
        ours(ids, position_ids=torch.arange(40)[None])  # given after the error: read
        assert len(reads) == 4
    ours.train()
    ours(ids).logits.sum().backward()  # training: the dense call, no read
    assert len(reads) == 4


class Recorded(list):
    """A list whose slice assignments (``packed`` storing a new answer) are recorded."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __setitem__(self, index, value):
        self.record.append(value)
        super().__setitem__(index, value)


def test_packed_tests_position_ids_again_after_an_in_place_change():
    positions = torch.arange(30)[None]
    assert nf_hf.packed(positions, 1) is False
    assert nf_hf.packed(positions, 2) is False and nf_hf.packed(positions[:, :1], 1) is False
    positions[0, 10:] = torch.arange(20)  # a second sequence starts at row 10: a new version
    assert nf_hf.packed(positions, 1) is True
    assert nf_hf.packed(None, 1) is False


def test_a_left_padded_batch_runs_varlen_and_generates_eager_s_tokens(kernels):
    """The 2-D padding mask becomes cu_seqlens (transformers' unpad) for the prefill, and each
    sequence's first and last cache row for the decode steps (the KV-cache call, 2 a step);
    greedy tokens equal eager's."""
    ours, eager = models(tiny(transformers.LlamaConfig))
    ids, mask = left_padded((0, 5, 11, 23), 24)
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
        assert_close(got[mask.bool()], want[mask.bool()])
        assert kernels["varlen"] == 2
    assert_same_tokens(ours, eager, ids, mask, 12)
    assert kernels["kvcache"] == 2 * 11 and kernels["varlen"] == 2 + 2  # the prefills: forward and generate


def test_packed_sequences_by_position_ids_run_varlen(kernels):
    """One row holding three sequences (position_ids restart): each attends to its own keys."""
    ours, eager = models(tiny(transformers.LlamaConfig))
    assert_close(*packed_and_alone(ours, eager, (7, 20, 13)))
    assert kernels["varlen"] == 2 and kernels["dense"] == 0


def test_a_sliding_window_reaches_the_kernel(kernels, monkeypatch):
    """Mistral's sliding window of 8 over 40 tokens: FlashAttention's (w - 1, w - 1) with causal."""
    seen = []
    dense = numbaflash.api.flash_attention
    monkeypatch.setattr(numbaflash.api, "flash_attention",
                        lambda *a, **kw: seen.append(kw["window_size"]) or dense(*a, **kw))
    ours, eager = models(tiny(transformers.MistralConfig, sliding_window=8))
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        assert_close(ours(ids).logits, eager(ids).logits)
    assert seen == [(7, 7), (7, 7)]


def test_gemma2_softcap_and_alternating_windows(kernels):
    ours, eager = models(tiny(transformers.Gemma2Config, sliding_window=6, attn_logit_softcapping=5.0,
                              query_pre_attn_scalar=32))
    ids = torch.randint(1, 97, (2, 30))
    with torch.no_grad():
        assert_close(ours(ids).logits, eager(ids).logits)


def test_gpt_oss_sinks(kernels):
    """gpt-oss's per-head sink logits reach the kernel as float32 (heads_q,)."""
    config = tiny(transformers.GptOssConfig, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])
    ours, eager = models(config)
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.normal_()
        eager.load_state_dict(ours.state_dict())
        ids = torch.randint(1, 97, (2, 30))
        assert_close(ours(ids).logits, eager(ids).logits)


def test_training_flows_gradients_to_the_weights(kernels):
    ours, eager = models(tiny(transformers.LlamaConfig))
    ours.train()
    eager.train()
    ids = torch.randint(1, 97, (2, 16))
    for model in (ours, eager):
        model(ids, labels=ids).loss.backward()
    for (name, a), b in zip(ours.named_parameters(), eager.parameters(), strict=True):
        assert_close(a.grad, b.grad), name


def test_training_layers_after_the_first_take_the_checked_fast_path(monkeypatch):
    """In training the first layer's call goes through ``api.flash_attention`` (``route`` checks
    the scalars and keeps them); every later layer enters ``EagerAttention`` directly
    (``torch_route.attention_autograd``). The weights' gradients equal eager attention's. The
    kernels here are the float64 references behind ``torch_ops.run_forward`` / ``run_backward``."""
    from numbaflash import torch_ops
    from tests._torch_attention import reference_backward, reference_forward

    monkeypatch.setattr(torch_ops, "run_forward", reference_forward)
    monkeypatch.setattr(torch_ops, "run_backward", reference_backward)
    monkeypatch.setattr(torch_route, "_CHECKED", {})
    routed = []
    route = torch_route.route
    monkeypatch.setattr(numbaflash.api, "_TORCH_ROUTE", [lambda *a: routed.append(1) or route(*a)])
    nf_hf.register()
    ours, eager = models(tiny(transformers.LlamaConfig, num_hidden_layers=3))
    ours.train()
    eager.train()
    ids = torch.randint(1, 97, (1, 24))
    for model in (ours, eager):
        model(ids, labels=ids).loss.backward()
    assert routed == [1]  # the first layer only
    for (name, a), b in zip(ours.named_parameters(), eager.parameters(), strict=True):
        assert_close(a.grad, b.grad), name


def test_what_no_kernel_runs_is_refused(kernels):
    with pytest.raises(ValueError, match="q/k head dim 264 and v head dim 264.*pads other head dims to 256"):
        transformers.AutoModelForCausalLM.from_config(tiny(transformers.LlamaConfig, head_dim=264),
                                                      attn_implementation="numbaflash")
    ours, _ = models(tiny(transformers.LlamaConfig, attention_dropout=0.1))
    ours.train()
    with pytest.raises(ValueError, match="no attention dropout"):
        ours(torch.randint(1, 97, (1, 8)))
    ours.eval()
    with pytest.raises(ValueError, match="output_attentions"):
        ours(torch.randint(1, 97, (1, 8)), output_attentions=True)
    attention = ours.model.layers[0].self_attn
    q, kv = torch.zeros(1, 4, 1, 32), torch.zeros(1, 2, 8, 32)
    with pytest.raises(NotImplementedError, match="paged cache"):
        nf_hf.attention_forward(attention, q, kv, kv, None, block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_a_head_dim_that_runs_padded_loads_and_decodes_without_the_kvcache_call(kernels):
    """Head dim 80 (Phi-2's) runs padded to 96 in numbaflash's calls (``operations.head_dims``,
    tested on its own in test_padded_head_dims_cpu); its decode steps take transformers'
    FlashAttention path, since the KV-cache call would have to copy the cache to pad it."""
    ours, eager = models(tiny(transformers.LlamaConfig, head_dim=80))
    ids, mask = left_padded((0, 3), 12)
    assert_same_tokens(ours, eager, ids, mask, 5)
    assert kernels["kvcache"] == 0 and kernels["varlen"] > 0


def test_head_dim_512_loads_and_decodes_without_the_kvcache_call(kernels):
    """Head dim 512 runs in halves of v in numbaflash's calls (``operations.head_dims``); the
    KV-cache call takes no 512, so its decode steps take transformers' FlashAttention path."""
    ours, eager = models(tiny(transformers.LlamaConfig, head_dim=512))
    ids, mask = left_padded((0, 3), 12)
    assert_same_tokens(ours, eager, ids, mask, 3)
    assert kernels["kvcache"] == 0 and kernels["varlen"] > 0


def test_head_dims_of_configs():
    class C:
        pass

    mla = C()
    mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim = 128, 64, 128
    assert nf_hf.head_dims(mla) == (192, 128)
    plain = C()
    plain.hidden_size, plain.num_attention_heads = 2048, 16
    assert nf_hf.head_dims(plain) == (128, 128)
    assert nf_hf.head_dims(C()) is None


@pytest.mark.parametrize("prompt", [12, 24])
def test_generate_with_the_static_cache(kernels, prompt):
    """transformers' static cache (keys of the cache's full length, a 2-D mask over the tokens so
    far): the same greedy tokens as eager's. A prompt of 12 rows is a decode step too; one of 24
    is a prefill on transformers' path, its mask shorter than the keys."""
    ours, eager = models(tiny(transformers.LlamaConfig, max_position_embeddings=64))
    assert_same_tokens(ours, eager, *left_padded((0, 4), prompt), 8, cache_implementation="static")
    prefill = prompt > nf_hf.DECODE_ROWS
    assert kernels["kvcache"] == 2 * (8 - prefill) and kernels["varlen"] == 2 * prefill


def test_a_decode_step_with_a_hole_in_its_mask_fails_on_the_device(kernels):
    """A sequence whose tokens are not contiguous in the mask cannot be a range of cache rows:
    the device-side assertion fires (here, on the CPU, at once) instead of attending the hole."""
    ours, _ = models(tiny(transformers.LlamaConfig))
    q = torch.randn(2, 4, 1, 32)
    k, v = torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 4] = 0
    attention = ours.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="contiguous"):
        nf_hf.attention_forward(attention, q, k, v, mask, scaling=attention.scaling)
    mask[1, 4] = 1
    mask[1, :3] = 0
    out, _ = nf_hf.attention_forward(attention, q, k, v, mask, scaling=attention.scaling)
    want = reference(q.transpose(1, 2)[1:], k.transpose(1, 2)[1:, 3:], v.transpose(1, 2)[1:, 3:],
                     causal=True, softmax_scale=attention.scaling)
    assert_close(out[1:], want)


def test_packed_sequences_by_cu_seq_lens_run_varlen(kernels):
    """transformers' packing keywords (DataCollatorWithFlattening's): cu_seq_lens_q / _k and
    max_length_q / _k reach flash_attention_varlen as int32 offsets and ints."""
    ours, eager = models(tiny(transformers.LlamaConfig))
    cu = torch.tensor([0, 9, 12, 30], dtype=torch.int64)
    assert_close(*packed_and_alone(ours, eager, (9, 3, 18), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                   max_length_q=18, max_length_k=18))
    assert kernels["varlen"] == 2 and kernels["dense"] == 0


@pytest.mark.parametrize("training", [False, True])
def test_an_unpadded_batch_compiles_with_no_graph_break(kernels, training):
    """torch.compile through our attention function and wrappers, a prefill and a training
    step's forward with its loss (the kernels' own tracing is numbaflash's torch ops':
    tests/test_torch_op_cpu.py). A batch of two: a batch of one with position_ids goes to
    transformers' path under compile, whose packing test reads the values."""
    import torch._dynamo

    ours, _ = models(tiny(transformers.LlamaConfig))
    ours.train(training)
    ids = torch.randint(1, 97, (2, 40))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(ours)(ids, labels=ids if training else None)
    assert not explained.break_reasons and explained.graph_break_count == 0, explained.break_reasons


def test_the_mask_of_a_static_cache_has_the_keys_length(kernels):
    """FlashAttention's mask function, but a decode step's mask shorter than the keys (a static
    cache's) is padded with 0s to their length, so that every decode step has one mask shape, and
    a decode step keeps an all-1s mask; a prefill as FlashAttention's: None without padding, the
    padding mask as it is (shorter than a static cache's keys too)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from numbaflash.integrations.transformers import DECODE_ROWS

    mask_function = ALL_MASK_ATTENTION_FUNCTIONS["numbaflash"]
    given = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    padded = mask_function(batch_size=2, q_length=1, kv_length=9, attention_mask=given)
    assert padded.shape == (2, 9) and torch.equal(padded[:, :5], given) and not padded[:, 5:].any()
    prefill = mask_function(batch_size=2, q_length=DECODE_ROWS + 1, kv_length=9, attention_mask=given)
    assert torch.equal(prefill, given)  # transformers' FlashAttention path then takes the first 5 keys
    ones = given[:1].expand(2, 5)
    for rows in (1, DECODE_ROWS + 1):
        got = mask_function(batch_size=2, q_length=rows, kv_length=5, attention_mask=given)
        assert torch.equal(got, given)
    assert torch.equal(mask_function(batch_size=2, q_length=1, kv_length=5, attention_mask=ones), ones)
    assert mask_function(batch_size=2, q_length=DECODE_ROWS + 1, kv_length=5, attention_mask=ones) is None


def test_a_compiled_decode_step_does_not_break_at_the_mask(kernels):
    """The mask of a decode step is built without a test of its values in Python
    (FlashAttention's ``mask.all()`` breaks a compiled step's graph there: a host sync a token,
    and a step in pieces for CUDA graphs)."""
    import torch._dynamo
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    ones = torch.ones(2, 5, dtype=torch.bool)
    for name, breaks in (("numbaflash", 0), ("flash_attention_2", 1)):  # the second: the test is live
        torch._dynamo.reset()
        explained = torch._dynamo.explain(ALL_MASK_ATTENTION_FUNCTIONS[name])(
            batch_size=2, q_length=1, kv_length=5, attention_mask=ones)
        assert len(explained.break_reasons) == breaks, (name, explained.break_reasons)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_a_sliding_window_cache(kernels, monkeypatch, cache):
    """Mistral's window of 8, 12 prompt and 12 new tokens: its layers' sliding caches fill and
    then drop (dynamic) or roll (static) their oldest slots; the decode steps run the KV-cache
    call, with transformers' window where the keys outnumber it; eager's tokens."""
    windows = []
    kvcache = numbaflash.api.flash_attention_with_kvcache
    monkeypatch.setattr(numbaflash.api, "flash_attention_with_kvcache",
                        lambda *a, **kw: windows.append(kw["window_size"]) or kvcache(*a, **kw))
    ours, eager = models(tiny(transformers.MistralConfig, sliding_window=8, max_position_embeddings=32))
    assert_same_tokens(ours, eager, *left_padded((0, 4), 12), 12, cache_implementation=cache)
    assert len(windows) == 2 * 12 and windows[:2] == [(7, 7)] * 2  # the 12-row prompt too, windowed
    assert set(windows[2:]) <= {(-1, -1), (7, 7)}


def deepseek_v3(**overrides):
    """A tiny DeepSeek-V3 (MLA: q/k head dim 128 + 64 rotary, v head dim 128; MoE)."""
    options = {"vocab_size": 97, "hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
               "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 256, "pad_token_id": 0}
    return transformers.DeepseekV3Config(**{**options, **overrides})


def test_deepseek_v3_runs_the_pair_of_head_dims(kernels, monkeypatch):
    """MLA's (192, 128) reaches the kernels as it is (v not padded to q's head dim, as
    transformers' own FlashAttention wrapper does), prefill with and without padding and
    generate as eager's; a pair with no kernel is refused at load."""
    widths = []
    dense = numbaflash.api.flash_attention
    def spy(q, k, v, **kw):
        widths.append((q.shape[-1], v.shape[-1]))
        return dense(q, k, v, **kw)

    monkeypatch.setattr(numbaflash.api, "flash_attention", spy)
    ours, eager = models(deepseek_v3())
    ids, mask = left_padded((0, 5), 30)
    with torch.no_grad():
        assert_close(ours(ids).logits, eager(ids).logits)
        assert widths == [(192, 128)] * 2
        got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
        assert_close(got[mask.bool()], want[mask.bool()])
    assert_same_tokens(ours, eager, ids, mask, 6)
    with pytest.raises(ValueError, match="q/k head dim 192 and v head dim 264"):
        transformers.AutoModelForCausalLM.from_config(deepseek_v3(v_head_dim=264),
                                                      attn_implementation="numbaflash")


def test_gradient_checkpointing_and_qwen3(kernels):
    """Qwen3 (q/k norms) trained with gradient checkpointing: the recomputed attention runs our
    path again, and every weight's gradient matches eager's."""
    ours, eager = models(tiny(transformers.Qwen3Config))
    ids = torch.randint(1, 97, (2, 16))
    for model in (ours, eager):
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        model(ids, labels=ids).loss.backward()
    assert kernels["dense"] == 2 * 2  # each layer's forward, then its recomputation
    for a, b in zip(ours.parameters(), eager.parameters(), strict=True):
        assert_close(a.grad, b.grad)


def test_a_decode_step_compiles_whole_and_finds_each_sequence_s_keys(monkeypatch):
    """decode_step under torch.compile(fullgraph=True): no host sync, no graph break; sequence
    b's keys are slots cache_leftpad[b] .. cache_seqlens[b] - 1 of its mask (left padding, and
    slots past the last token: a static cache's)."""
    found = {}

    def kvcache(q, k_cache, v_cache, cache_seqlens, **options):
        found.update(seqlens=cache_seqlens, leftpad=options["cache_leftpad"], options=options)
        return q * 1

    monkeypatch.setattr(numbaflash.api, "flash_attention_with_kvcache", kvcache)
    q, k, v = torch.randn(3, 1, 4, 32), torch.randn(3, 10, 2, 32), torch.randn(3, 10, 2, 32)
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :8], mask[1, 3:8], mask[2, 7:10] = True, True, True
    sink = torch.randn(4, dtype=torch.bfloat16)
    step = torch.compile(nf_hf.decode_step, fullgraph=True, backend="eager")
    assert torch.equal(step(q, k, v, mask, True, 0.25, 30.0, sink), q)
    assert found["seqlens"].tolist() == [8, 8, 10] and found["leftpad"].tolist() == [0, 3, 7]
    assert found["seqlens"].dtype == found["leftpad"].dtype == torch.int32
    options = found["options"]
    assert (options["causal"], options["softmax_scale"], options["softcap"]) == (True, 0.25, 30.0)
    assert options["learnable_sink"].dtype == torch.float32


def test_an_unpadded_batch_decodes_on_the_kv_cache_kernel(kernels):
    """No padding mask: the prompt (40 rows) runs the dense call, each decode step the KV-cache
    call over every cached key; tokens as eager's. A packed row of several tokens (batch 1,
    position_ids given) stays on transformers' path."""
    ours, eager = models(tiny(transformers.LlamaConfig))
    ids = torch.randint(1, 97, (3, 40))
    assert_same_tokens(ours, eager, ids, None, 6)
    assert kernels["dense"] == 2 and kernels["kvcache"] == 2 * 5
    assert_close(*packed_and_alone(ours, eager, (3, 5)))
    assert kernels["varlen"] == 2


def test_the_layers_of_a_step_share_its_cache_rows():
    """An eager step computes each sequence's cache rows once for all its layers (the same mask
    tensor), and again for a changed mask: in place (its version) or another tensor, equal or
    not."""
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    first = nf_hf.cache_rows(2, 5, "cpu", mask)
    assert first[0].tolist() == [4, 5] and first[1].tolist() == [1, 0]
    again = nf_hf.cache_rows(2, 5, "cpu", mask)
    assert again[0] is first[0] and again[1] is first[1]
    mask[0, 4] = 1  # in place: the cached entry's version is stale
    changed = nf_hf.cache_rows(2, 5, "cpu", mask)
    assert changed[0].tolist() == [5, 5]
    copy_ = nf_hf.cache_rows(2, 5, "cpu", mask.clone())
    assert copy_[0] is not changed[0] and torch.equal(copy_[0], changed[0])
    seqlens, leftpad = nf_hf.cache_rows(2, 7, "cpu", None)
    assert seqlens.tolist() == [7, 7] and seqlens.dtype == torch.int32 and leftpad is None
    with torch.inference_mode():  # no version counter: computed each call
        frozen = torch.tensor([[0, 1, 1]])
        assert nf_hf.cache_rows(1, 3, "cpu", frozen)[1].tolist() == [1]
        frozen[0, 0] = 1
        assert nf_hf.cache_rows(1, 3, "cpu", frozen)[1].tolist() == [0]


@pytest.mark.parametrize("seed", range(6))
def test_decode_steps_of_random_shapes_match_the_reference(kernels, seed):
    """decode_step on random shapes (1-16 query rows, GQA, a (192, 128) pair, left padding and a
    static cache's empty tail, softcap, sink) against the reference on each sequence's own rows."""
    rng = torch.Generator().manual_seed(seed)
    batch, rows, slots = 1 + seed % 3, int(torch.randint(1, 17, (1,), generator=rng)), 40
    heads_kv = (1, 2)[seed % 2]
    heads_q = heads_kv * (1, 2, 4)[seed % 3]
    d, dv = ((32, 32), (192, 128), (64, 64))[seed % 3]
    q = torch.randn(batch, rows, heads_q, d, generator=rng)
    k = torch.randn(batch, slots, heads_kv, d, generator=rng)
    v = torch.randn(batch, slots, heads_kv, dv, generator=rng)
    mask = torch.zeros(batch, slots, dtype=torch.bool)
    spans = []
    for b in range(batch):
        end = int(torch.randint(rows, slots + 1, (1,), generator=rng))
        start = int(torch.randint(0, end - rows + 1, (1,), generator=rng))
        mask[b, start:end] = True
        spans.append((start, end))
    softcap = (0.0, 20.0)[seed % 2]
    sink = torch.randn(heads_q, generator=rng) if seed % 3 == 0 else None
    out = nf_hf.decode_step(q, k, v, mask, True, 0.3, softcap, sink)
    for b, (start, end) in enumerate(spans):
        want = reference(q[b:b + 1], k[b:b + 1, start:end], v[b:b + 1, start:end], causal=True,
                         softmax_scale=0.3, softcap=softcap,
                         learnable_sink=None if sink is None else sink.float())
        assert_close(out[b:b + 1], want)


@pytest.mark.parametrize("model", ["gemma2", "gpt_oss"])
def test_generate_with_alternating_windows_softcap_and_sinks(kernels, model):
    """Gemma 2 (softcap, sliding and full layers) and gpt-oss (sinks, sliding and full layers):
    left-padded greedy generation past the window, on the KV-cache call, as eager's."""
    if model == "gemma2":
        config = tiny(transformers.Gemma2Config, sliding_window=6, attn_logit_softcapping=5.0,
                      query_pre_attn_scalar=32)
    else:
        config = tiny(transformers.GptOssConfig, num_local_experts=2, num_experts_per_tok=1, sliding_window=6,
                      layer_types=["sliding_attention", "full_attention"])
    ours, eager = models(config)
    if model == "gpt_oss":
        with torch.no_grad():
            for layer in ours.model.layers:
                layer.self_attn.sinks.normal_()
        eager.load_state_dict(ours.state_dict())
    assert_same_tokens(ours, eager, *left_padded((0, 3), 10), 10)
    assert kernels["kvcache"] == 2 * 10


def test_other_requests_pass_through_the_wrapped_checks(kernels):
    """After register(): a model on SDPA, one with no request, and a per-sub-config dict of
    names load as transformers loads them."""
    config = tiny(transformers.LlamaConfig)
    for request in ("sdpa", None, {"": "eager"}):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                              attn_implementation=request)
        assert model.config._attn_implementation in ("sdpa", "eager")


def test_hf_generate_example_says_where_and_how_close_each_row_parts():
    """``examples/hf_generate.py``'s ``partings``: no line where the rows agree; for a row that
    parts, the new token where it does, the gap between the two choices' logits (the second
    model's, after the common prefix) and the models' largest logit difference there, called a
    near-tie only within twice that difference."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_generate.py"
    spec = importlib.util.spec_from_file_location("hf_generate_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config = tiny(transformers.LlamaConfig)
    torch.manual_seed(0)
    first, second = (transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                                   attn_implementation=name).eval()
                     for name in ("eager", "sdpa"))
    second.load_state_dict(first.state_dict())
    ids, mask = left_padded((0, 2), 5)
    ours = torch.cat([ids, torch.randint(1, 97, (2, 4))], dim=1)
    assert example.partings(first, second, ours, ours.clone(), mask) == []
    theirs = ours.clone()
    theirs[1, 7] = ours[1, 7] % 96 + 1  # row 1 parts at its third new token
    prefix = {"input_ids": ours[1:2, :7], "attention_mask": torch.cat([mask[1], mask.new_ones(2)])[None]}
    with torch.no_grad():
        logits = second(**prefix).logits[0, -1]
    gap = abs(float(logits[int(ours[1, 7])] - logits[int(theirs[1, 7])]))
    (line,) = example.partings(first, second, ours, theirs, mask)
    assert line.startswith("  row 1 parts at new token 2:") and f"{gap:.4f} apart" in line
    assert line.endswith("worth a look")  # float32 twins differ far less than two random logits
    with torch.no_grad():  # make the two choices a tie in the second model, near one in the first
        second.lm_head.weight[int(theirs[1, 7])] = second.lm_head.weight[int(ours[1, 7])]
        first.lm_head.weight[int(theirs[1, 7])] = first.lm_head.weight[int(ours[1, 7])] * 1.01
    (line,) = example.partings(first, second, ours, theirs, mask)
    assert line.endswith("a near-tie")
