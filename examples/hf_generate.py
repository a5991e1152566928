"""Greedy generation with a Hugging Face model on numbaflash, beside the same model on SDPA.

A small random-init Llama (transformers' own config class), bf16, a left-padded batch; prints
tokens/s of each and whether their tokens agree, and for each row where they part, how close the
two choices were there (``partings``). Needs a CUDA GPU, torch and transformers
(``pip install ".[cu13,transformers]"``):

    python examples/hf_generate.py --batch 4 --prompt 512 --new 64
    python examples/hf_generate.py --decode-rows 0   # decode steps on transformers' path instead

``--cache static`` uses transformers' static cache.
"""

import argparse
import copy
import time

import torch
import transformers

from numbaflash.integrations import transformers as integration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--decode-rows", type=int, default=integration.DECODE_ROWS,
                        help="query rows up to which a step runs the KV-cache kernel (0: never)")
    args = parser.parse_args()

    integration.register()
    integration.DECODE_ROWS = args.decode_rows
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=args.layers, num_attention_heads=16,
                                      num_key_value_heads=4, max_position_embeddings=8192, pad_token_id=0)
    torch.manual_seed(0)
    models = {}
    for name in ("numbaflash", "sdpa"):
        models[name] = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=name, dtype=torch.bfloat16).cuda().eval()
    models["sdpa"].load_state_dict(models["numbaflash"].state_dict())

    ids = torch.randint(1, config.vocab_size, (args.batch, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    for row in range(1, args.batch):  # left padding, as a batch of prompts of different lengths
        pad = row * args.prompt // (2 * args.batch)
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    options = {"attention_mask": mask, "max_new_tokens": args.new, "min_new_tokens": args.new,
               "do_sample": False, "pad_token_id": 0, "cache_implementation": args.cache}
    tokens = {}
    print(f"GPU: {torch.cuda.get_device_name()}; Llama {args.layers} layers, bf16, batch {args.batch}, "
          f"prompt {args.prompt}, {args.new} new tokens, {args.cache} cache, decode rows {args.decode_rows}")
    for name, model in models.items():
        with torch.no_grad():
            model.generate(ids, **{**options, "max_new_tokens": 2, "min_new_tokens": 2})  # compile, warm up
            torch.cuda.synchronize()
            start = time.perf_counter()
            tokens[name] = model.generate(ids, **options)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(f"{name:>10}: {args.batch * args.new / seconds:8.1f} tokens/s")
    same = torch.equal(tokens["numbaflash"], tokens["sdpa"])
    print(f"tokens equal to SDPA's: {same}")
    for line in partings(models["numbaflash"], models["sdpa"], tokens["numbaflash"], tokens["sdpa"], mask):
        print(line)


def partings(ours_model, sdpa_model, ours, theirs, mask) -> list[str]:
    """One line for each row where the two generations part: the new token where they do, and,
    after the common prefix, the gap between the two choices' logits beside the largest difference
    between the two models' logits there. A random-init model's greedy choice often meets a
    near-tie that the two attention implementations' roundings decide differently (everything
    after it differs): a gap within twice that difference (each model's own rounding, the
    tolerance ``tests/test_transformers_gpu.py`` allows against float32) is such a tie.
    ``ours`` and ``theirs``: (batch, prompt + new) token ids; ``mask``: the prompt's padding mask."""
    lines = []
    prompt = mask.shape[1]
    for row in range(ours.shape[0]):
        parted = (ours[row] != theirs[row]).nonzero()
        if parted.numel() == 0:
            continue
        at = int(parted[0])
        prefix = {"input_ids": ours[row:row + 1, :at],
                  "attention_mask": torch.cat([mask[row], mask.new_ones(at - prompt)])[None]}
        with torch.no_grad():
            mine, other = (model(**prefix).logits[0, -1].float() for model in (ours_model, sdpa_model))
        chosen, rival = int(ours[row, at]), int(theirs[row, at])
        gap = abs(float(other[chosen] - other[rival]))
        differ = float((mine - other).abs().max())
        verdict = "a near-tie" if gap <= 2 * differ else "wider than twice that: worth a look"
        lines.append(f"  row {row} parts at new token {at - prompt}: the two choices' logits {gap:.4f} "
                     f"apart, the models' logits up to {differ:.4f}: {verdict}")
    return lines


if __name__ == "__main__":
    main()
