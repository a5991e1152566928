"""Issue 57's speed bars: a Hugging Face Llama on numbaflash beside the same weights on SDPA, in one
process (needs a GPU, torch and transformers).

    python benchmarks/hf_speed.py [--layers 8] [--seqlen 4096] [--prompt 512] [--new 128]
                                  [--batches 1,16] [--iters 10] [--rounds 3]

The model is ``examples/hf_generate.py``'s Llama (hidden 2048, 16 query and 4 KV heads, head dim
128, bf16, random init). Three workloads; prefill and the training step are each the median of
``--iters`` x ``--rounds`` CUDA-event-timed calls of each model, the two models taking turns call
by call after a warm-up:

* prefill: one forward of a batch-1 sequence of ``--seqlen`` tokens, no grad;
* training step: forward, loss and backward of the same sequence, then the gradients set to None
  as an optimizer's ``zero_grad`` does (no optimizer step: it is the same for both), each call
  on an idle device; and the same steps back to back, ``--iters`` a block with no wait between
  them, as a training loop issues them (ms a step by wall clock, the median of ``2 x --rounds``
  blocks of each model, taking turns);
* generate: greedy ``generate`` of ``--new`` tokens after a ``--prompt``-token prompt with the
  static cache, which transformers compiles with ``mode="reduce-overhead"`` (CUDA graphs), at each
  batch of ``--batches``; tokens/s counts the new tokens.

It prints a table with our speedup over SDPA (SDPA's time over ours; above 1: ours is faster; the
bar is 1.0 each).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers

from numbaflash.integrations import transformers as integration

NAMES = ("numbaflash", "sdpa")


def models(layers: int, positions: int) -> dict:
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=positions, pad_token_id=0)
    torch.manual_seed(0)
    make = transformers.AutoModelForCausalLM.from_config
    out = {name: make(copy.deepcopy(config), attn_implementation=name, dtype=torch.bfloat16).cuda()
           for name in NAMES}
    out["sdpa"].load_state_dict(out["numbaflash"].state_dict())
    return out


def timed(call, iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls, CUDA events around each."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def alternating(calls: dict, iters: int, rounds: int) -> dict:
    """name: median seconds of ``iters * rounds`` calls each, after two warm-up calls each, the
    names taking turns call by call (the order reversed every other turn). The GPU's clocks drift
    over seconds (a training step measured 38-39 ms in one block of five and 35 ms a few blocks
    later, for both models alike), so blocks of several calls of one model would add that drift
    to the ratio; turns call by call put both models under it alike."""
    for call in calls.values():
        call(), call()
    samples: dict = {name: [] for name in calls}
    names = list(calls)
    for i in range(iters * rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            samples[name] += timed(calls[name], 1)
    return {name: statistics.median(s) for name, s in samples.items()}


def back_to_back(calls: dict, iters: int, rounds: int) -> dict:
    """name: median seconds a call over ``2 * rounds`` blocks of ``iters`` calls issued with no
    wait between them (as a training loop runs: the host queues a step while the device runs the
    last), the device synchronised at each block's ends; the names take turns block by block."""
    samples: dict = {name: [] for name in calls}
    names = list(calls)
    for r in range(2 * rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                calls[name]()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    integration.register()
    pair = models(args.layers, max(args.seqlen, args.prompt + args.new) + 8)
    print(f"GPU: {torch.cuda.get_device_name()}; transformers {transformers.__version__}, torch "
          f"{torch.__version__}; Llama {args.layers} layers, hidden 2048, GQA 16/4, d128, bf16")
    rows = []
    ids = torch.randint(1, 32000, (1, args.seqlen), device="cuda")

    def prefill(model):
        def call():
            with torch.no_grad():
                model(ids, logits_to_keep=1)
        return call

    def step(model):
        def call():
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)  # as an optimizer's: no gradient is accumulated into
        return call

    for model in pair.values():
        model.eval()
    got = alternating({n: prefill(m) for n, m in pair.items()}, args.iters, args.rounds)
    rows.append((f"prefill {args.seqlen}", "ms", got["numbaflash"] * 1e3, got["sdpa"] * 1e3,
                 got["sdpa"] / got["numbaflash"]))
    for model in pair.values():
        model.train()
    got = alternating({n: step(m) for n, m in pair.items()}, args.iters, args.rounds)
    rows.append((f"train step {args.seqlen}", "ms", got["numbaflash"] * 1e3, got["sdpa"] * 1e3,
                 got["sdpa"] / got["numbaflash"]))
    got = back_to_back({n: step(m) for n, m in pair.items()}, args.iters, args.rounds)
    rows.append((f"train steps back to back {args.seqlen}", "ms", got["numbaflash"] * 1e3, got["sdpa"] * 1e3,
                 got["sdpa"] / got["numbaflash"]))
    for model in pair.values():
        model.eval()
        model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()

    for batch in (int(b) for b in args.batches.split(",")):
        prompt = torch.randint(1, 32000, (batch, args.prompt), device="cuda")
        options = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False,
                   "pad_token_id": 0, "cache_implementation": "static"}
        tokens, rates = {}, {name: [] for name in NAMES}
        with torch.no_grad():
            for model in pair.values():  # compile and capture
                model.generate(prompt, **options)
            for r in range(args.rounds):
                for name in (NAMES if r % 2 == 0 else NAMES[::-1]):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    tokens[name] = pair[name].generate(prompt, **options)
                    torch.cuda.synchronize()
                    rates[name].append(batch * args.new / (time.perf_counter() - start))
        ours, sdpa = statistics.median(rates["numbaflash"]), statistics.median(rates["sdpa"])
        same = torch.equal(tokens["numbaflash"], tokens["sdpa"])
        rows.append((f"generate b{batch} (tokens equal: {same})", "tok/s", ours, sdpa, ours / sdpa))

    print(f"{'workload':<36} {'unit':>6} {'numbaflash':>11} {'sdpa':>11} {'speedup':>10}")
    for name, unit, ours, sdpa, ratio in rows:
        print(f"{name:<36} {unit:>6} {ours:11.2f} {sdpa:11.2f} {ratio:10.3f}")


if __name__ == "__main__":
    main()
