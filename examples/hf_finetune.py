"""Training steps of a Hugging Face model on numbaflash, beside the same run on SDPA.

A small random-init Llama (transformers' own config class), bf16 weights, AdamW on a copy task
(predict the sequence itself); prints each run's losses and median step time. The two models
train side by side, one step of each in turn on the same batch, so that neither gets the GPU's
warm clocks or the allocator's cached blocks first; the first ``--warmup`` steps of each are not
timed. Needs a CUDA GPU, torch and transformers (``pip install ".[cu13,transformers]"``):

    python examples/hf_finetune.py --steps 20 --seqlen 4096
"""

import argparse
import copy
import statistics
import time

import torch
import transformers

from numbaflash.integrations.transformers import register


def step(model, optimizer, ids) -> tuple[float, float]:
    """(loss, seconds) of one AdamW step on ``ids``, the device idle at its start and end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.item()  # waits for the step
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps of each run left out of the timing")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be timed")

    register()
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=args.layers, num_attention_heads=16,
                                      num_key_value_heads=4, max_position_embeddings=2 * args.seqlen)
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}; Llama {args.layers} layers, bf16, batch {args.batch}, "
          f"seqlen {args.seqlen}")
    names = ("numbaflash", "sdpa")
    make = transformers.AutoModelForCausalLM.from_config
    models = {name: make(copy.deepcopy(config), attn_implementation=name, dtype=torch.bfloat16).cuda().train()
              for name in names}
    models["sdpa"].load_state_dict(models["numbaflash"].state_dict())
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=3e-4) for name, model in models.items()}
    generator = torch.Generator(device="cuda").manual_seed(1)
    losses: dict = {name: [] for name in names}
    times: dict = {name: [] for name in names}
    for i in range(args.steps):
        shape = (args.batch, args.seqlen)
        ids = torch.randint(1, config.vocab_size, shape, device="cuda", generator=generator)
        for name in (names if i % 2 == 0 else names[::-1]):
            loss, seconds = step(models[name], optimizers[name], ids)
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(seconds)
    medians = {name: statistics.median(times[name]) for name in names}
    for name in names:
        print(f"{name:>10}: {medians[name] * 1e3:8.1f} ms a step; losses "
              f"{' '.join(f'{x:.3f}' for x in losses[name])}")
    worst = max(abs(x - y) for x, y in zip(losses["numbaflash"], losses["sdpa"], strict=True))
    print(f"largest loss difference {worst:.4f}; step time SDPA / numbaflash "
          f"{medians['sdpa'] / medians['numbaflash']:.3f} (medians of {len(times['sdpa'])} steps each)")


if __name__ == "__main__":
    main()
