"""Numerics probe: runs INSIDE the sandbox child (harness mode "numerics").

The gate picks a fresh seed and batch indices for every check and passes them in the request, so a
candidate cannot know in advance what it is checked on. With the workload's parts built under that
seed, the probe records:

(a) the gradients of the first step: ``loss_fn(model, batch(i0)).backward()``, one tensor per
    parameter (names from ``model.named_parameters()``), saved with ``torch.save`` to the path the
    request names, for the parent to compare against the baseline's;
(b) the loss trajectory over ``k`` full ``train_step`` calls on ``batch(i0) .. batch(ik-1)``;
(c) facts that expose a candidate gaming the gate: a content hash of every batch (the parent
    compares them with the baseline's: the data pipeline must not change), whether ``batch(i)`` is
    repeatable, which trainable parameters each ``train_step`` left unchanged (an exact fingerprint
    of their bits), and whether ``train_step`` returned the very same loss object twice.

The parent (trainbridge.agents.profiler) judges these facts; the probe only reports them.

Request (``request["numerics"]``): ``seed`` (int), ``batch_indices`` (list of int, at least one),
``grads_path`` (str), optional ``compile`` (bool: ``model.compile()`` first, to measure the
reference's own drift under Inductor).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from pathlib import Path
from typing import Any

from trainbridge.sandbox.evidence import save_evidence
from trainbridge.sandbox.random_alignment import aligned_by

_INT_VIEW_BY_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def run_numerics(parts: dict[str, Any], backend, request: dict[str, Any]) -> dict[str, Any]:
    """Run the probe on the workload's parts; returns a JSON-able report (see module doc)."""
    import torch

    spec = request.get("numerics")
    if not isinstance(spec, dict):
        raise ValueError('numerics mode needs request["numerics"] = {"seed", "batch_indices", "grads_path"}')
    seed = int(spec["seed"])
    indices = [int(i) for i in spec["batch_indices"]]
    if not indices:
        raise ValueError("numerics mode needs at least one batch index")
    grads_path = Path(spec["grads_path"])
    model, optimizer, batch, loss_fn, train_step = (parts[k] for k in ("model", "optimizer", "batch", "loss_fn", "train_step"))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"numerics mode needs parts['model'] to be a torch.nn.Module, got {type(model).__name__}")
    if spec.get("compile"):
        model.compile()
    named = list(model.named_parameters())
    trainable = [(name, p) for name, p in named if p.requires_grad]

    _reseed(seed)  # a batch drawn from the global RNG must not depend on how much RNG the build consumed
    hashes = [content_hash(batch(i)) for i in indices]
    repeatable = content_hash(batch(indices[0])) == hashes[0]

    # (a) gradients of the first step, from loss_fn alone (no optimizer step yet)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}  # e.g. BatchNorm running stats
    _reseed(seed)
    model.zero_grad(set_to_none=True)
    first_batch = batch(indices[0])
    grad_loss = loss_fn(model, first_batch)
    grad_loss.backward()
    backend.sync()
    grads = {name: p.grad.detach().to("cpu", copy=True) for name, p in named if p.grad is not None}
    no_grad = [name for name, p in trainable if p.grad is None]
    grads_sha256 = save_evidence(grads, grads_path)  # its digest goes back over the child's own channel
    model.zero_grad(set_to_none=True)  # no optimizer step has run: the model is as freshly built
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    del grads

    # (b) + (c): the trajectory of full steps, watching what each step changed
    _reseed(seed)
    losses: list[float] = []
    unchanged: list[list[str]] = []
    same_object: list[bool] = []
    mutated: list[bool] = []
    returned: list[Any] = []  # keep every returned loss alive, so identity means "the same object"
    before = _fingerprints(trainable)
    for index in indices:
        data = batch(index)
        digest = content_hash(data)
        loss = train_step(model, optimizer, data)
        backend.sync()
        after = _fingerprints(trainable)
        losses.append(_loss_value(loss))
        unchanged.append([name for name, _ in trainable if after[name] == before[name]])
        same_object.append(any(loss is previous for previous in returned))
        mutated.append(content_hash(data) != digest)
        returned.append(loss)
        before = after
    return {
        "seed": seed,
        "batch_indices": indices,
        "grads_path": str(grads_path),
        "grads_sha256": grads_sha256,
        "param_names": [name for name, _ in named],
        "param_shapes": {name: list(p.shape) for name, p in named},
        "trainable": [name for name, _ in trainable],
        "no_grad_params": no_grad,
        "grad_loss": _loss_value(grad_loss),
        "losses": losses,
        "batch_hashes": hashes,
        "batch_repeatable": repeatable,
        "batch_mutated_by_step": mutated,
        "unchanged_params": unchanged,
        "same_loss_object": same_object,
        "compiled": bool(spec.get("compile")),
        "random_aligned": aligned_by(),
    }


def _reseed(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def _loss_value(loss: Any) -> float:
    if hasattr(loss, "detach"):
        return float(loss.detach().float().cpu().item())
    return float(loss)


def _fingerprints(named: list) -> dict[str, tuple[int, int]]:
    """An exact fingerprint of each parameter's bits: any changed element changes it (barring an
    exact cancellation of two weighted integer sums)."""
    return {name: bits_fingerprint(p) for name, p in named}


def bits_fingerprint(tensor) -> tuple[int, int]:
    """An exact fingerprint of a tensor's bits (any changed element changes it); script mode's probe uses it too."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return (0, 0)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(getattr(torch, _INT_VIEW_BY_SIZE[flat.element_size()])).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return int(bits.sum().item()), int((bits * weights).sum().item())


def content_hash(value: Any) -> str | None:
    """SHA-256 over a batch's content (tensors by dtype, shape and bytes; containers recursively).
    None when some part has no stable content (an object whose repr shows its address)."""
    digest = hashlib.sha256()
    return digest.hexdigest() if _feed(digest, value) else None


def _feed(digest, value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"T{t.dtype}{tuple(value.shape)}".encode())
        if t.is_complex():
            t = torch.view_as_real(t).reshape(-1)
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return True
    if isinstance(value, (bool, int, str, bytes, type(None))):
        digest.update(f"{type(value).__name__}:{value!r}".encode())
        return True
    if isinstance(value, float):
        digest.update(f"float:{value!r}".encode() if not math.isnan(value) else b"float:nan")
        return True
    if isinstance(value, dict):
        digest.update(f"dict{len(value)}".encode())
        return all(_feed(digest, k) and _feed(digest, v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        return all(_feed(digest, item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        digest.update(type(value).__name__.encode())
        return all(_feed(digest, getattr(value, f.name)) for f in dataclasses.fields(value))
    if hasattr(value, "__dict__"):
        digest.update(type(value).__name__.encode())
        return _feed(digest, dict(vars(value)))
    text = repr(value)
    if " at 0x" in text:
        return False
    digest.update(text.encode())
    return True
