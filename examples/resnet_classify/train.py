"""Train a small ResNet to classify synthetic 32x32 images.

    python train.py --steps 20            # cuda when available, else cpu
    python train.py --steps 3 --device cpu --seed 1

Each class is a fixed colour grating (its own orientation, frequency and colour); an image is its
class's grating, randomly shifted, plus Gaussian noise. Everything comes from seeded
torch.Generators: nothing is downloaded, and a batch is a pure function of (seed, step).
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

from model import ResNet

NUM_CLASSES = 10
BATCH_SIZE = 64
IMAGE_SIZE = 32
LEARNING_RATE = 0.05
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
NOISE_STD = 0.8
DATASET_SEED = 2024  # fixes the class patterns; the run seed only picks which images are drawn


def make_class_params(num_classes: int) -> torch.Tensor:
    """Per class: angle, spatial frequency and an RGB colour, as one row."""
    g = torch.Generator().manual_seed(DATASET_SEED)
    angle = torch.arange(num_classes, dtype=torch.float32) * (math.pi / num_classes)
    freq = 1.0 + 3.0 * torch.rand(num_classes, generator=g)
    colour = torch.rand(num_classes, 3, generator=g) * 2.0 - 1.0
    return torch.cat([angle[:, None], freq[:, None], colour], dim=1)


def make_get_batch(seed: int, device: str):
    params = make_class_params(NUM_CLASSES)
    coords = torch.linspace(0.0, 2.0 * math.pi, IMAGE_SIZE)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")

    def get_batch(step: int):
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**62)
        labels = torch.randint(0, NUM_CLASSES, (BATCH_SIZE,), generator=g)
        phase = torch.rand(BATCH_SIZE, generator=g) * 2.0 * math.pi
        p = params[labels]
        angle, freq, colour = p[:, 0], p[:, 1], p[:, 2:]
        direction = xx[None] * torch.cos(angle)[:, None, None] + yy[None] * torch.sin(angle)[:, None, None]
        grating = torch.sin(freq[:, None, None] * direction + phase[:, None, None])
        images = colour[:, :, None, None] * grating[:, None]
        images = images + NOISE_STD * torch.randn(BATCH_SIZE, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
        return images.to(device), labels.to(device)

    return get_batch


def loss_fn(model, batch):
    images, labels = batch
    logits = model(images)
    return F.cross_entropy(logits, labels)


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def trainbridge_entry(device: str, seed: int) -> dict:
    """Build everything for one training step; deterministic given seed."""
    torch.manual_seed(seed)
    model = ResNet(num_classes=NUM_CLASSES).to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    )
    return {
        "model": model,
        "optimizer": optimizer,
        "batch": make_get_batch(seed, device),
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
