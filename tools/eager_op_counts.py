"""Count the ATen ops an eager training step dispatches, per phase (runs inside the sandbox child).

Phases: forward_model (inside a trained model's forward), forward_other (the loss and the rest),
backward_model / backward_other (by the autograd node's sequence number: nodes recorded during a
model's forward are the model's), optimizer (inside optimizer.step). View ops (no kernel launched)
are counted apart. The evidence's "N eager ops vs K compiled kernels" comes from these counts.

`OpCounter` works over any window of the program: entry mode counts one `train_step` call
(`count_eager_step_ops`); script mode, which does not own the loop, counts from one step boundary
to the next (sandbox/script/capture.py), with the hooks installed a step earlier so the forward
whose backward it counts was seen. Every torch import is inside a function.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from trainbridge.tools.inductor.parser import EVIDENCE_FORMAT

PHASES = ("forward_model", "forward_other", "backward_model", "backward_other", "optimizer")


class OpCounter:
    """Counts dispatched ATen ops per phase between `start()` and `stop()`; `install()` hooks the models
    and optimizers first (and `remove()` takes the hooks off before anything is compiled)."""

    def __init__(self, models: Iterable[Any], optimizers: Iterable[Any]):
        self.models, self.optimizers = list(models), list(optimizers)
        self.counts: dict[str, Counter] = {p: Counter() for p in PHASES}
        self.views: Counter = Counter()
        self._ranges: list[list[int | None]] = []  # autograd sequence numbers [first, last] of each model forward seen
        self._depth = 0
        self._in_optimizer = False
        self._paused = False
        self._handles: list[Any] = []
        self._mode: Any = None

    def install(self) -> "OpCounter":
        for model in self.models:
            self._handles += [model.register_forward_pre_hook(self._pre_forward), model.register_forward_hook(self._post_forward)]
        for optimizer in self.optimizers:
            self._handles += [optimizer.register_step_pre_hook(lambda *a: setattr(self, "_in_optimizer", True)),
                              optimizer.register_step_post_hook(lambda *a: setattr(self, "_in_optimizer", False))]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter._paused:
                    name = f"aten.{func._overloadpacket.__name__}" if func.namespace == "aten" else str(func)
                    (counter.views if func.is_view else counter.counts[counter._phase()])[name] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Counting()
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def report(self, step: int) -> dict[str, Any]:
        return {
            "format": EVIDENCE_FORMAT,
            "step": step,
            "ops_per_phase": {p: sum(c.values()) for p, c in self.counts.items()},
            "view_ops": sum(self.views.values()),
            "ops": {p: dict(c.most_common()) for p, c in self.counts.items()},
        }

    # --- hooks ---------------------------------------------------------------------------------
    def _probe_seq(self) -> int:
        import torch

        self._paused = True
        try:
            with torch.enable_grad():
                return (torch.zeros(1, requires_grad=True) * 1).grad_fn._sequence_nr()
        finally:
            self._paused = False

    def _pre_forward(self, _module, _args) -> None:
        if self._depth == 0:
            self._ranges.append([self._probe_seq(), None])
        self._depth += 1

    def _post_forward(self, _module, _args, _out) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._ranges:
            self._ranges[-1][1] = self._probe_seq()

    def _phase(self) -> str:
        import torch

        if self._in_optimizer:
            return "optimizer"
        node = torch._C._current_autograd_node()
        if node is not None:
            seq = node._sequence_nr()
            inside = any(lo is not None and hi is not None and lo < seq < hi for lo, hi in self._ranges)
            return "backward_model" if inside or node.name().endswith("AccumulateGrad") else "backward_other"
        return "forward_model" if self._depth > 0 else "forward_other"


def count_eager_step_ops(parts: dict, step: int) -> dict[str, Any]:
    """The counts of one eager `train_step(model, optimizer, batch(step))` (entry mode's parts). Runs one real
    step: parameters change."""
    counter = OpCounter([parts["model"]], [parts["optimizer"]]).install()
    try:
        b = parts["batch"](step)
        counter.start()
        try:
            parts["train_step"](parts["model"], parts["optimizer"], b)
        finally:
            counter.stop()
    finally:
        counter.remove()
    return counter.report(step)
