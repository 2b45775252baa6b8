"""Contrastive image-text pretraining of a small CLIP on synthetic pairs.

    python train.py --steps 20            # cuda when available, else cpu
    python train.py --steps 3 --device cpu --seed 1

An image shows a noisy grating whose orientation is one attribute and whose colour is another;
its caption is the colour word, the shape word, up to four filler words, the end-of-text token,
then padding. Everything comes from seeded torch.Generators: nothing is downloaded, and a batch
is a pure function of (seed, step).
"""

import argparse
import math
import time

import torch

from model import CLIP, CLIPConfig

BATCH_SIZE = 32
LEARNING_RATE = 5e-4
WEIGHT_DECAY = 0.2
NUM_SHAPES = 8  # grating orientations
NUM_COLOURS = 8
NOISE_STD = 0.3
MAX_CAPTION_WORDS = 6  # colour word, shape word, then up to 4 filler words
DATASET_SEED = 77  # fixes colours and the words for each attribute


def make_dataset_tables():
    g = torch.Generator().manual_seed(DATASET_SEED)
    colours = torch.rand(NUM_COLOURS, 3, generator=g) * 2.0 - 1.0
    # token ids: 0 is padding, 1..63 filler words, then attribute words; the end-of-text token is
    # the largest id (vocab_size - 1), which the text tower pools at.
    shape_words = 64 + torch.arange(NUM_SHAPES)
    colour_words = 64 + NUM_SHAPES + torch.arange(NUM_COLOURS)
    return colours, shape_words, colour_words


def make_get_batch(seed: int, device: str, cfg: CLIPConfig):
    colours, shape_words, colour_words = make_dataset_tables()
    coords = torch.linspace(0.0, 2.0 * math.pi, cfg.image_size)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    eot = cfg.vocab_size - 1
    length = cfg.context_length

    def get_batch(step: int):
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**62)
        shape = torch.randint(0, NUM_SHAPES, (BATCH_SIZE,), generator=g)
        colour = torch.randint(0, NUM_COLOURS, (BATCH_SIZE,), generator=g)
        phase = torch.rand(BATCH_SIZE, generator=g) * 2.0 * math.pi
        angle = shape.float() * (math.pi / NUM_SHAPES)
        direction = xx[None] * torch.cos(angle)[:, None, None] + yy[None] * torch.sin(angle)[:, None, None]
        grating = torch.sin(3.0 * direction + phase[:, None, None])
        images = colours[colour][:, :, None, None] * grating[:, None]
        images = images + NOISE_STD * torch.randn(BATCH_SIZE, 3, cfg.image_size, cfg.image_size, generator=g)

        tokens = torch.randint(1, 64, (BATCH_SIZE, length), generator=g)
        tokens[:, 0] = colour_words[colour]
        tokens[:, 1] = shape_words[shape]
        eot_at = torch.randint(2, MAX_CAPTION_WORDS + 1, (BATCH_SIZE,), generator=g)
        positions = torch.arange(length)[None]
        tokens[positions == eot_at[:, None]] = eot
        tokens[positions > eot_at[:, None]] = 0  # padding after the end of text
        return images.to(device), tokens.to(device)

    return get_batch


def clip_loss(logits_per_image):
    loss_img = -torch.log_softmax(logits_per_image, dim=1).diagonal().mean()
    loss_txt = -torch.log_softmax(logits_per_image, dim=0).diagonal().mean()
    return (loss_img + loss_txt) / 2


def loss_fn(model, batch):
    images, tokens = batch
    logits_per_image = model(images, tokens)
    return clip_loss(logits_per_image)


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(100))
    return loss.detach()


def configure_optimizer(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embedding" in n]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=(0.9, 0.98), eps=1e-6, foreach=False)


def trainbridge_entry(device: str, seed: int) -> dict:
    """Build everything for one training step; deterministic given seed."""
    torch.manual_seed(seed)
    cfg = CLIPConfig()
    model = CLIP(cfg).to(device)
    optimizer = configure_optimizer(model)
    return {
        "model": model,
        "optimizer": optimizer,
        "batch": make_get_batch(seed, device, cfg),
        "loss_fn": loss_fn,
        "train_step": train_step,
    }


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps to run")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    parts = trainbridge_entry(device, args.seed)
    model, optimizer, get_batch = parts["model"], parts["optimizer"], parts["batch"]
    model.train()
    for step in range(args.steps):
        batch = get_batch(step)
        synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, batch)
        synchronize(device)
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        print(f"step {step} loss {loss.item():.4f} time_ms {elapsed_ms:.1f}", flush=True)


if __name__ == "__main__":
    main()
