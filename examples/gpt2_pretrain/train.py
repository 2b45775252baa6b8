"""Pretrain a small GPT-2-style language model on a synthetic token stream.

    python train.py --steps 20            # cuda when available, else cpu
    python train.py --steps 3 --device cpu --seed 1

The data is a fixed random Markov chain over the vocabulary, sampled with a seeded
torch.Generator: nothing is downloaded, and a batch is a pure function of (seed, step).
"""

import argparse
import time

import torch

from model import GPT, GPTConfig

BATCH_SIZE = 8
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.1
CORPUS_SEED = 4321  # fixes the synthetic "language"; the run seed only picks which text is drawn
SUCCESSORS = 4  # allowed next tokens per token: the best achievable loss is ln(4)


def make_corpus(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(CORPUS_SEED)
    return torch.randint(0, vocab_size, (vocab_size, SUCCESSORS), generator=g)


def make_get_batch(seed: int, device: str, cfg: GPTConfig):
    transitions = make_corpus(cfg.vocab_size)
    seq_len = cfg.block_size

    def get_batch(step: int):
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**62)
        data = torch.empty(BATCH_SIZE, seq_len + 1, dtype=torch.long)
        data[:, 0] = torch.randint(0, cfg.vocab_size, (BATCH_SIZE,), generator=g)
        picks = torch.randint(0, SUCCESSORS, (BATCH_SIZE, seq_len), generator=g)
        for t in range(seq_len):
            data[:, t + 1] = transitions[data[:, t], picks[:, t]]
        x = data[:, :-1].to(device)
        y = data[:, 1:].to(device)
        return x, y

    return get_batch


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    logits = logits.view(-1, logits.size(-1))
    targets = y.reshape(-1)
    lse = torch.logsumexp(logits, dim=-1)
    target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    loss = (lse - target_logits).mean()
    return loss


def train_step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def configure_optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=(0.9, 0.95), foreach=False)


def trainbridge_entry(device: str, seed: int) -> dict:
    """Build everything for one training step; deterministic given seed."""
    torch.manual_seed(seed)
    cfg = GPTConfig()
    model = GPT(cfg).to(device)
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
