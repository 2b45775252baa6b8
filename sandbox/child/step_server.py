"""The child side of parent-timed steps: runs INSIDE the sandbox child, answering the parent's commands.

The parent (sandbox/child/step_driver.py) decides everything and times everything: which batch index
each step uses (sent one step at a time, so nothing can be computed ahead), when a step starts (it
writes the command) and ends (it reads the reply), with its own clock. What the child measures
itself (`inner_s`) is only reported, so the parent can see a clock that was tampered with.

Commands (one JSON object per line, each answered by exactly one reply):

- ``probe`` {seed, batch_indices, grads_path}: the numerics probe (sandbox/numerics_probe.py) on the
  freshly built parts;
- ``mark``: remember the trainable parameters (bits and values) before the timed steps;
- ``step`` {index}: ``train_step(model, optimizer, batch(index))`` between device synchronisations,
  replies with the loss;
- ``final`` {deltas_path}: which trainable parameters the steps since ``mark`` left bit-identical,
  and their changes since ``mark``, saved with torch.save to the path given;
- ``exit``: stop serving.

A gate child always receives the same sequence (probe, mark, steps, final), whether its round is the
gate's first (the numerics check) or a later one: nothing tells the code under test which it is.
"""

from __future__ import annotations

import time
from pathlib import Path

from trainbridge.sandbox.evidence import save_evidence
from typing import Any

from trainbridge.sandbox.child.channel import Channel
from trainbridge.sandbox.device_kernels import KernelCounter, step_reply_field


class ProtocolError(ValueError):
    """A command the server does not know, or one missing its arguments."""


def loss_value(loss: Any) -> float:
    if hasattr(loss, "detach"):
        return float(loss.detach().float().cpu().item())
    return float(loss)


class StepServer:
    def __init__(self, channel: Channel, parts: dict[str, Any], backend):
        self.channel, self.parts, self.backend = channel, parts, backend
        self.marked: dict[str, Any] | None = None
        self.steps_done = 0
        self.kernels = KernelCounter()  # NPU kernels per step, where the emulated device counts them

    def serve(self) -> None:
        """Answer commands until `exit`; a command's own failure propagates (the harness reports it)."""
        while True:
            command = self.channel.recv()
            op = command.get("op")
            if op == "exit":
                return
            handler = getattr(self, f"_do_{op}", None) if isinstance(op, str) else None
            if handler is None:
                raise ProtocolError(f"unknown command {op!r}")
            self.channel.send({"op": op, **handler(command)})

    def _do_probe(self, command: dict[str, Any]) -> dict[str, Any]:
        from trainbridge.sandbox.numerics_probe import run_numerics

        spec = {key: command[key] for key in ("seed", "batch_indices", "grads_path")}
        return {"report": run_numerics(self.parts, self.backend, {"numerics": spec})}

    def _trainable(self) -> list[tuple[str, Any]]:
        return [(name, p) for name, p in self.parts["model"].named_parameters() if p.requires_grad]

    def _do_mark(self, command: dict[str, Any]) -> dict[str, Any]:
        import torch

        self.marked = {name: p.detach().to("cpu", dtype=torch.float32, copy=True) for name, p in self._trainable()}
        return {"params": len(self.marked)}

    def _do_step(self, command: dict[str, Any]) -> dict[str, Any]:
        index = int(command["index"])
        model, optimizer, batch, train_step = (self.parts[k] for k in ("model", "optimizer", "batch", "train_step"))
        started, kernels_at = time.perf_counter(), self.kernels.mark()
        data = batch(index)
        self.backend.sync()
        loss = train_step(model, optimizer, data)
        self.backend.sync()
        value = loss_value(loss)
        now = time.perf_counter()
        self.steps_done += 1
        # NaN/inf travel as JSON's NaN/Infinity; `clock` is the raw reading, for the parent's rate check
        return {"index": index, "loss": value, "inner_s": now - started, "clock": now,
                **step_reply_field(self.kernels, kernels_at)}

    def _do_final(self, command: dict[str, Any]) -> dict[str, Any]:
        if self.marked is None:
            raise ProtocolError("final before mark")
        return {**save_parameter_deltas(self._trainable(), self.marked, Path(command["deltas_path"])), "steps": self.steps_done}


def save_parameter_deltas(named, marked: dict[str, Any], path: Path) -> dict[str, Any]:
    """Each parameter's change since `marked` (float32 on the CPU), saved with torch.save to `path`,
    and which parameters did not change at all: the reply to `final` (script mode's too)."""
    import torch

    deltas, unchanged = {}, []
    for name, p in named:
        now = p.detach().to("cpu", dtype=torch.float32)
        before = marked.get(name)
        if before is None or before.shape != now.shape:
            continue
        delta = now - before
        if not bool(delta.any()):
            unchanged.append(name)
        deltas[name] = delta
    digest = save_evidence(deltas, path)  # reported over the child's own channel (sandbox/evidence.py)
    return {"unchanged_params": unchanged, "deltas_path": str(path), "deltas_sha256": digest}
