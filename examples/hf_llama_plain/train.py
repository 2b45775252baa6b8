"""Train a tiny Hugging Face Llama in a plain PyTorch loop: the model's code lives in transformers, the loop here.

Random weights from a config and random token ids: nothing is downloaded. Eager attention, as many scripts
written for accelerators without a fused SDPA ask for it. `cuda` when available, else `cpu`
(`trainbridge run --target npu` ports the device lines first).
"""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_iters", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seq_len", type=int, default=512)  # a short context for an LM; attention over it is what SDPA fuses
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=args.seq_len, use_cache=False, attn_implementation="eager")
    model = LlamaForCausalLM(config).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.max_iters):
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
