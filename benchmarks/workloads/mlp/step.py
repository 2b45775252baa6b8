"""A small MLP classifier step for gate calibration; SLOWDOWN plants a known slowdown.

With SLOWDOWN = f > 0, every train_step spins for f times the time its own real work took, so the
step is (1 + f) times slower whatever the machine's momentary load: a calibrated, proportional
planted slowdown. benchmarks/gate_calibration.py writes variants with other values.
"""
import time

import torch

SLOWDOWN = 0.0


def build(device: str, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    inputs = torch.randn(1024, 256, generator=generator)
    labels = torch.randint(0, 10, (1024,), generator=generator)

    def batch(step: int):
        rows = (torch.arange(128) + step * 128) % 1024
        return inputs[rows].to(device), labels[rows].to(device)

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    def train_step(model, optimizer, batch):
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        if SLOWDOWN:
            until = time.perf_counter() + SLOWDOWN * (time.perf_counter() - started)
            while time.perf_counter() < until:
                pass
        return loss

    return {"model": model, "optimizer": optimizer, "batch": batch, "loss_fn": loss_fn, "train_step": train_step}
