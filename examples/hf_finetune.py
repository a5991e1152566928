"""Training steps of a Hugging Face model on numbaflash, beside the same run on SDPA.

A small random-init Llama (transformers' own config class), bf16 weights, AdamW on a copy task
(predict the sequence itself); prints each run's losses and mean step time. Needs a CUDA GPU,
torch and transformers (``pip install ".[cu13,transformers]"``):

    python examples/hf_finetune.py --steps 20 --seqlen 4096
"""

import argparse
import copy
import time

import torch
import transformers

from numbaflash.integrations.transformers import register


def train(model, args, vocab: int) -> tuple[list[float], float]:
    """(losses, mean seconds a step after the first) of ``args.steps`` AdamW steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    generator = torch.Generator(device="cuda").manual_seed(1)
    losses, times = [], []
    for _ in range(args.steps):
        ids = torch.randint(1, vocab, (args.batch, args.seqlen), device="cuda", generator=generator)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    return losses, sum(times[1:]) / max(1, len(times) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    register()
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=args.layers, num_attention_heads=16,
                                      num_key_value_heads=4, max_position_embeddings=2 * args.seqlen)
    torch.manual_seed(0)
    first = None
    print(f"GPU: {torch.cuda.get_device_name()}; Llama {args.layers} layers, bf16, batch {args.batch}, "
          f"seqlen {args.seqlen}")
    runs = {}
    for name in ("numbaflash", "sdpa"):
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=name, dtype=torch.bfloat16).cuda().train()
        if first is None:
            first = copy.deepcopy(model.state_dict())
        else:
            model.load_state_dict(first)
        runs[name] = train(model, args, config.vocab_size)
        del model
        torch.cuda.empty_cache()
    for name, (losses, step) in runs.items():
        print(f"{name:>10}: {step * 1e3:8.1f} ms a step; losses {' '.join(f'{x:.3f}' for x in losses)}")
    (a, ta), (b, tb) = runs["numbaflash"], runs["sdpa"]
    print(f"largest loss difference {max(abs(x - y) for x, y in zip(a, b, strict=True)):.4f}; "
          f"step time SDPA / numbaflash {tb / ta:.3f}")


if __name__ == "__main__":
    main()
