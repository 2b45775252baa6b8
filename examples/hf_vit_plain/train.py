"""Train a tiny Hugging Face ViT image classifier in a plain PyTorch loop: the model's code lives in transformers.

Random weights from a config and random images and labels: nothing is downloaded, and no torchvision is needed.
Eager attention, as scripts written for accelerators without a fused SDPA ask for it. `cuda` when available, else
`cpu` (`trainbridge run --target npu` ports the device lines first).
"""
import argparse

import torch
from transformers import ViTConfig, ViTForImageClassification


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_iters", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--image_size", type=int, default=64)  # 16x16 patches of 4 pixels: 257 tokens, as a 224-pixel ViT-B/16 has 197
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1234)
    config = ViTConfig(image_size=args.image_size, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, num_labels=10, attn_implementation="eager")
    model = ViTForImageClassification(config).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.max_iters):
        images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
        labels = torch.randint(0, config.num_labels, (args.batch_size,), device=device)
        loss = model(pixel_values=images, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
