"""Script mode's hooks: seeds, the loss from `backward()`, step boundaries from optimizer steps (runs INSIDE the child).

The user's script runs unmodified; these hooks find its training step:

- **Seeds** (sandbox/script/seeds.py): every seeding call the script makes gets a seed derived
  from the gate's.
- **Loss.** `torch.Tensor.backward` / `torch.autograd.backward` are wrapped: the scalars that
  backward is called on between two step boundaries are summed (gradient accumulation). A backward on
  leaves alone (no graph: `torch.empty(1, requires_grad=True).backward()`) is neither a step nor a loss.
- **Step boundaries.** PyTorch's global optimizer-step hooks see every optimizer the script makes.
  A step ends when its last optimizer has stepped, which shows as the next backward beginning or
  an optimizer that already stepped stepping again (several optimizers per step included); the
  script's end closes the last step. Library loops (sandbox/script/library_steps.py): an optimizer
  wrapper that never ran `Optimizer.__init__` (accelerate's, under transformers' Trainer) is left out
  of the optimizers listed; an `optimizer.step(closure)` (Lightning) has its closure run in the
  step's pre-hook, so its backward is the step's loss and its gradients are there for the probe.

At each boundary the `StepController` answers the parent's pending command (sandbox/child/step_server.py's
protocol: the `step` reply carries the loss and the child's own time) and blocks reading the next
one, so the parent's clock times exactly one optimizer step per command. The first boundary is the
first backward: the model is built by then, and the child says `ready` (asked for the torch.compile
arm, it first compiles the forward of the modules whose parameters the optimizers hold: `compile_trained_modules`). `probe` runs as many
untimed steps as it has batch indices, capturing the first step's gradients in the optimizer
pre-hook (sandbox/numerics_probe.py's file and report format); `mark` / `final` cover every
parameter of every optimizer. `exit` sends the closing result and ends the process at once
(os._exit): nothing of the script runs after the last step, so it leaves no half-written checkpoint.
The batch index of a `step` command cannot choose a script's data: the seed does.
"""

from __future__ import annotations

import gc
import types
import warnings
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainbridge.sandbox.evidence import save_evidence
from trainbridge.sandbox.numerics_probe import bits_fingerprint
from trainbridge.sandbox.random_alignment import aligned_by
from trainbridge.sandbox.child.step_server import save_parameter_deltas
from trainbridge.sandbox.device_kernels import KernelCounter, step_reply_field
from trainbridge.sandbox.script.library_steps import (find_closure, forward_owners, real_optimizers, replay,
                                                     run_longer_override, with_closure)



class ScriptFailure(BaseException):
    """A failure the launcher reports (BaseException: a script's `except Exception` must not swallow it)."""

    def __init__(self, kind: str, message: str, *, step: int | None = None):
        super().__init__(message)
        self.kind, self.message, self.step = kind, message, step


def live_objects() -> list[Any]:
    """Every object the garbage collector tracks (isinstance checks on some raise deprecation warnings: silenced)."""
    return gc.get_objects()


def _instances(objects: list[Any], cls: type) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [o for o in objects if _is_instance(o, cls)]


def _is_instance(obj: Any, cls: type) -> bool:
    """isinstance, False for a weakref proxy whose object is gone (isinstance on it raises ReferenceError:
    torch.compile's caches and DDP keep such proxies alive)."""
    try:
        return isinstance(obj, cls)
    except ReferenceError:
        return False


def tracked_params() -> list[tuple[str, Any]]:
    """Every parameter of every live optimizer's param_groups, named after the module that holds it
    (`<RootModuleClass>.<name>`; a torch.compile wrapper is named after the module it wraps), else
    `optimizer<i>.group<g>.<j>`. Optimizers and parameters in their order of creation / appearance."""
    import torch

    objects = live_objects()
    optimizers, modules = real_optimizers(_instances(objects, torch.optim.Optimizer)), _instances(objects, torch.nn.Module)
    children = {id(child) for module in modules for child in module.children()}
    names: dict[int, str] = {}
    used: set[str] = set()
    for root in (m for m in modules if id(m) not in children):
        inner = getattr(root, "_orig_mod", root)
        for name, param in root.named_parameters():
            qualified = f"{type(inner).__name__}.{name.replace('_orig_mod.', '')}"
            while qualified in used:
                qualified += "'"
            if id(param) not in names:
                names[id(param)] = qualified
                used.add(qualified)
    out, seen = [], set()
    for o_index, optimizer in enumerate(optimizers):
        for g_index, group in enumerate(optimizer.param_groups):
            for p_index, param in enumerate(group["params"]):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                out.append((names.get(id(param), f"optimizer{o_index}.group{g_index}.{p_index}"), param))
    return out


def live_optimizers() -> list[Any]:
    """Every live optimizer, in order of creation; a wrapper that never ran `Optimizer.__init__` (accelerate's) is left
    out, the optimizer it wraps is listed (sandbox/script/library_steps.py)."""
    import torch

    return real_optimizers(_instances(live_objects(), torch.optim.Optimizer))


def trained_root_modules() -> list[Any]:
    """Every root module (no live module holds it as a child) that holds a parameter of a live optimizer."""
    import torch

    objects = live_objects()
    held = {id(p) for o in real_optimizers(_instances(objects, torch.optim.Optimizer)) for g in o.param_groups for p in g["params"]}
    modules = _instances(objects, torch.nn.Module)
    children = {id(child) for module in modules for child in module.children()}
    return [root for root in modules if id(root) not in children and any(id(p) in held for p in root.parameters())]


def compile_trained_modules() -> list[str]:
    """torch.compile the `forward` of every root module that holds an optimizer's parameters, in place (a script that
    compiles its model itself keeps its own torch.compile wrapper); the class names of what was compiled.
    Not `module.compile()`: under torch 2.13, `torch.compile(module._call_impl)` hands `_call_impl` back unwrapped, so
    `module.compile()` compiles nothing (Dynamo never sees a frame)."""
    import torch

    compiled = []
    for root in (owner for module in trained_root_modules() for owner in forward_owners(module)):  # a LightningModule's model
        if hasattr(root, "_orig_mod") or "forward" in vars(root):  # compiled by the script, or by us already
            continue
        # the class's function, bound again: a compiled bound method would be wrapped in Dynamo's shared `inner`
        # frame, so a second module's compile would show as a recompile of the first
        root.forward = types.MethodType(torch.compile(type(root).forward), root)
        compiled.append(type(root).__name__)
    return compiled


@dataclass
class _Probe:
    """The numerics probe over the script's next `len(batch_indices)` steps."""

    seed: int
    batch_indices: list[int]
    grads_path: Path
    params: list[tuple[str, Any]]
    grads: dict[str, Any] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    unchanged: list[list[str]] = field(default_factory=list)
    same_object: list[bool] = field(default_factory=list)
    loss_objects: list[Any] = field(default_factory=list)
    before: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def steps_left(self) -> int:
        return len(self.batch_indices) - len(self.losses)

    def capture(self, optimizer) -> None:
        """Pre-hook of an optimizer in the probe's first step: the gradients it is about to apply."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, param in self.params:
            if id(param) in ids and param.grad is not None and name not in self.grads:
                self.grads[name] = param.grad.detach().to("cpu", copy=True)

    def after_step(self, loss: float, loss_objects: list[Any]) -> None:
        after = {name: bits_fingerprint(p) for name, p in self.params}
        self.unchanged.append([name for name, _ in self.params if after[name] == self.before.get(name)])
        self.same_object.append(any(obj is old for obj in loss_objects for old in self.loss_objects))
        self.loss_objects.extend(loss_objects)
        self.losses.append(loss)
        self.before = after

    def report(self) -> dict[str, Any]:
        import torch

        grads_sha256 = save_evidence(self.grads, self.grads_path)  # reported over the child's own channel
        names = [name for name, _ in self.params]
        steps = len(self.losses)
        return {"seed": self.seed, "batch_indices": self.batch_indices, "grads_path": str(self.grads_path),
                "grads_sha256": grads_sha256, "param_names": names,
                "param_shapes": {name: list(p.shape) for name, p in self.params},
                "trainable": [name for name, p in self.params if p.requires_grad],
                "no_grad_params": [name for name, p in self.params if p.requires_grad and name not in self.grads],
                "grad_loss": self.losses[0], "losses": self.losses, "batch_hashes": [None] * steps, "batch_repeatable": False,
                "batch_mutated_by_step": [False] * steps, "unchanged_params": self.unchanged, "same_loss_object": self.same_object,
                "compiled": False, "random_aligned": aligned_by()}


@dataclass
class _Pending:
    index: int
    started: float
    kernels_at: int | None = None  # the emulated NPU's kernel count at the command (sandbox/device_kernels.py)


class StepController:
    """Answers the parent's commands at the script's step boundaries (see the module doc).
    `check_ready()` returns problems that stop the run at the first boundary (unmatched overrides);
    `close(failure)` sends the closing result and ends the process (it never returns)."""

    def __init__(self, channel, backend, *, check_ready: Callable[[], list[str]], close: Callable[[dict | None], None],
                 compile_modules: bool = False, profile: dict[str, Any] | None = None, repo_root: Path | None = None,
                 capture: Any = None, loss_sources: Any = None):
        self.channel, self.backend = channel, backend
        self.loss_sources = loss_sources  # sandbox/script_loss.LossSources: backward, unscaled, or the printed loss
        self.capture = capture  # harness mode "capture": sandbox/script_capture.ScriptCapture
        self.profile, self.repo_root = profile, repo_root  # profile: {"start": step command number, "steps": how many}
        self.recorder: Any = None
        self.step_commands = 0
        self.inner_times_s: list[float] = []
        self.compile_modules = compile_modules
        self.compiled: list[str] = []
        self.check_ready, self.close = check_ready, close
        self.started = self.finished = False
        self.steps_done = 0  # completed optimizer steps (boundaries after the first)
        self.stepped: list[Any] = []  # optimizers that stepped since the last boundary, in order
        self.loss_parts: list[Any] = []
        self.loss_values: list[Any] = []  # their values when backward was called (a script may change the tensor in place later,
                                          # e.g. all_reduce of the loss for logging: the loss is what backward saw)
        self._loss_objects: list[Any] = []
        self.pending: _Pending | None = None
        self.kernels = KernelCounter()
        self.probe: _Probe | None = None
        self.marked: dict[str, Any] | None = None
        self.optimizer_count = 0
        self.in_backward = False
        self.closure_depth = 0  # inside an optimizer's closure (optimizer.step(closure)): its backward is no boundary
        self.closure_loss = True  # whether the closure's backward gives the step's loss (not LBFGS's re-evaluations)

    # --- hooks ---------------------------------------------------------------------------------
    def on_backward(self, tensors) -> None:
        import torch

        given = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors or ())
        if given and all(isinstance(t, torch.Tensor) and t.grad_fn is None for t in given):
            # backward on leaves alone computes nothing: no step, no loss. The Modded-NanoGPT records'
            # `torch.empty(1, device="cuda", requires_grad=True).backward()` at import read as the first step's loss
            # added an uninitialised value to it (22400 measured as 9.3e14 with one thread), and began the first step
            # before the model was built
            return
        if self.closure_depth:  # inside optimizer.step(closure): the step began at the optimizer's pre-hook
            if not self.closure_loss:
                return
        elif not self.started:
            self._first_boundary()
        elif self.stepped:
            self._boundary()
        for tensor in given:
            if isinstance(tensor, torch.Tensor) and tensor.numel() == 1:
                self.loss_parts.append(tensor)
                self.loss_values.append(tensor.detach().clone())

    def on_optimizer_pre(self, optimizer, args, kwargs) -> tuple[tuple, dict] | None:
        if not self.started:
            self._first_boundary()
        elif any(optimizer is seen for seen in self.stepped):
            self._boundary()
        replaced = None
        closure = find_closure(optimizer, args, kwargs)
        if closure is not None:  # optimizer.step(closure) (Lightning): forward and backward run now, before the update
            first = self._run_closure(closure, loss=True)
            replaced = with_closure(args, kwargs, replay(first, closure, lambda again: self._run_closure(again, loss=False)))
        if self.probe is not None and not self.probe.losses:
            self.probe.capture(optimizer)
        self.stepped.append(optimizer)
        self.optimizer_count = max(self.optimizer_count, len(self.stepped))
        return replaced

    def _run_closure(self, closure, *, loss: bool):
        """Run an optimizer's closure as its step would (gradients enabled); `loss`: its backward is the step's loss."""
        import torch

        saved = self.closure_loss
        self.closure_depth += 1
        self.closure_loss = loss
        try:
            with torch.enable_grad():
                return closure()
        finally:
            self.closure_depth -= 1
            self.closure_loss = saved

    def script_ended(self) -> None:
        """The script returned: its last step ends here; then only `mark`, `final` and `exit` can be answered."""
        self.finished = True
        if self.started and self.stepped:
            self._boundary()
        elif self.started and self.pending is not None:  # a step was asked and no optimizer stepped: it never ends
            self.close(self._no_optimizer_step() if self.steps_done == 0 else self._ended_early("the step in flight"))
        elif self.started:
            self._serve()

    def _no_optimizer_step(self) -> dict[str, Any]:
        return {"kind": "bad_workload", "step": 0,
                "message": "the script ended without an optimizer step: it called backward() but never optimizer.step() "
                           "(a step is timed from one optimizer step to the next). Give it a launch line that trains, or a "
                           "script whose loop steps an optimizer"}

    # --- boundaries ----------------------------------------------------------------------------
    def _first_boundary(self) -> None:
        self.started = True
        problems = self.check_ready()
        if problems:
            self.close({"kind": "bad_workload", "message": "; ".join(problems)})
        if self.compile_modules:  # the torch.compile arm: the first forward ran eager, every step from here compiled
            self.compiled = compile_trained_modules()
        if self.capture is not None:
            self.capture.first_boundary()
        self.channel.send({"op": "ready"})
        self._serve()

    def _boundary(self) -> None:
        self.backend.sync()
        if self.recorder is not None:
            self.recorder.stop()  # a recorded step ends at its boundary
        loss = self._take_loss()
        now = time.perf_counter()
        self.steps_done += 1
        self.stepped = []
        if self.probe is not None:
            self.probe.after_step(loss, self._loss_objects)
            if self.probe.steps_left > 0 and not self.finished:
                return  # the probe's steps run untimed, one after the other
            if self.probe.steps_left > 0:
                self.close(self._ended_early("the numerics probe"))
            report, self.probe = self.probe.report(), None
            self.channel.send({"op": "probe", "report": report})
        elif self.pending is not None:
            pending, self.pending = self.pending, None
            self.inner_times_s.append(now - pending.started)
            if self.capture is not None:
                self.capture.window_ended(self.step_commands - 1, now - pending.started, loss)
            # NaN/inf travel as JSON's NaN/Infinity, as in step_server
            self.channel.send({"op": "step", "index": pending.index, "loss": loss, "inner_s": now - pending.started, "clock": now,
                               **step_reply_field(self.kernels, pending.kernels_at)})
        self._serve()

    def _take_loss(self) -> float:
        import torch

        parts, self.loss_parts = self.loss_parts, []
        values, self.loss_values = self.loss_values, []
        self._loss_objects = parts
        if self.loss_sources is not None:
            return self.loss_sources.step_loss(parts, values)
        if not parts:
            return math.nan
        total = torch.stack([v.float().reshape(()).cpu() for v in values]).sum()
        return float(total.item())

    def _serve(self) -> None:
        """Read commands until one that needs the script to run on (`step`, `probe`)."""
        while True:
            command = self.channel.recv()
            op = command.get("op")
            if op == "exit":
                self.close(None)
            elif op in ("step", "probe") and self.finished:
                self.close(self._ended_early(f"the {op} command"))
            elif op == "step":
                self._maybe_record()
                if self.capture is not None:
                    self.capture.window_started(self.step_commands)
                self.step_commands += 1
                self.pending = _Pending(index=int(command["index"]), started=time.perf_counter(), kernels_at=self.kernels.mark())
                return
            elif op == "probe":
                self.probe = _Probe(seed=int(command["seed"]), batch_indices=[int(i) for i in command["batch_indices"]],
                                    grads_path=Path(command["grads_path"]), params=tracked_params())
                self.probe.before = {name: bits_fingerprint(p) for name, p in self.probe.params}
                return
            elif op == "mark":
                self.channel.send({"op": "mark", **self._mark()})
            elif op == "final":
                self.channel.send({"op": "final", **self._final(command)})
            else:
                self.close({"kind": "crashed", "message": f"unknown command {op!r} on the control channel"})

    def _maybe_record(self) -> None:
        """Harness mode "profile": record the eager ops of the step commands in the profile window."""
        if self.profile is None:
            return
        start, steps = int(self.profile["start"]), int(self.profile["steps"])
        if start <= self.step_commands < start + steps:
            if self.recorder is None:
                self.hook_recorder()
            self.recorder.start()

    def hook_recorder(self) -> None:
        """Harness mode "profile": the recorder of eager ops, its optimizer-step hooks registered now (after the controller's:
        a closure runs in the controller's pre-hook, before the recorder counts the optimizer phase; and a boundary at a
        pre-hook must not register hooks while PyTorch iterates them)."""
        from trainbridge.tools.eager_profile import BoundaryRecorder

        self.recorder = BoundaryRecorder(self.repo_root)
        self.recorder.hook()

    def eager_ops(self) -> dict[str, Any] | None:
        """The recorded table (JSON) and the optimizer class, for the closing result; None when nothing was recorded."""
        if self.recorder is None or not self.recorder.started:
            return None
        params = tracked_params()
        device = str(params[0][1].device) if params else self.backend.device
        start = int(self.profile["start"])
        timed = [t * 1e6 for t in self.inner_times_s[int(self.profile.get("timed_from", 0)):start]]
        table = self.recorder.table(backend=self.backend.name, device=device, step_times_us=timed)
        optimizers = live_optimizers()
        return {"eager_ops": table.model_dump(mode="json"), "optimizer_class": type(optimizers[0]).__name__ if optimizers else None}

    def _ended_early(self, what: str) -> dict[str, Any]:
        return {"kind": "bad_workload", "step": self.steps_done,
                "message": f"the script finished after {self.steps_done} optimizer step(s), before {what}: the plan needs more "
                           f"steps. Let it run longer, e.g. [overrides] {run_longer_override()} (or the setting that bounds its loop)"}

    def _mark(self) -> dict[str, Any]:
        import torch

        self.marked = {name: p.detach().to("cpu", dtype=torch.float32, copy=True) for name, p in tracked_params() if p.requires_grad}
        return {"params": len(self.marked)}

    def _final(self, command: dict[str, Any]) -> dict[str, Any]:
        if self.marked is None:
            self.close({"kind": "crashed", "message": "final before mark on the control channel"})
        return {**save_parameter_deltas(tracked_params(), self.marked, Path(command["deltas_path"])), "steps": self.steps_done}


def install_step_hooks(controller: StepController) -> None:
    """Wrap backward and register the global optimizer-step hook (before the script runs)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    tensor_backward, autograd_backward = torch.Tensor.backward, torch.autograd.backward

    def backward(self, *args, **kwargs):
        if controller.in_backward:
            return tensor_backward(self, *args, **kwargs)
        controller.on_backward(self)
        controller.in_backward = True
        try:
            return tensor_backward(self, *args, **kwargs)
        finally:
            controller.in_backward = False

    def backward_function(tensors, *args, **kwargs):
        if controller.in_backward:
            return autograd_backward(tensors, *args, **kwargs)
        controller.on_backward(tensors)
        controller.in_backward = True
        try:
            return autograd_backward(tensors, *args, **kwargs)
        finally:
            controller.in_backward = False

    backward.__doc__, backward_function.__doc__ = tensor_backward.__doc__, autograd_backward.__doc__
    torch.Tensor.backward = backward
    torch.autograd.backward = backward_function
    register_optimizer_step_pre_hook(controller.on_optimizer_pre)
    if controller.profile is not None:
        controller.hook_recorder()
