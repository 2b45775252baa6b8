"""Training loops run by libraries, as script mode's step hooks see them (runs INSIDE the sandbox child).

Libraries that own the loop reach the optimizer in two ways plain loops do not:

- **Optimizer wrappers.** accelerate's `AcceleratedOptimizer` (what `transformers.Trainer` and
  `accelerator.prepare` hand back) subclasses `torch.optim.Optimizer` without running its `__init__`:
  it has no hook tables of its own (`register_step_pre_hook` raises AttributeError) and delegates
  `param_groups` and `step` to the optimizer it wraps, which is live too. `real_optimizers` keeps the
  optimizers whose `Optimizer.__init__` ran (the wrapped ones), so nothing is hooked, counted or named
  twice.
- **Closures.** Lightning's automatic optimization calls `optimizer.step(closure)`: the closure runs
  `training_step`, `zero_grad`, `backward` and gradient clipping *inside* `step`, after the step's
  pre-hooks. `find_closure` finds it in the hook's arguments and `with_closure` hands `step` another
  one, so the step hooks can run the closure first (the forward and backward belong to the step's
  forward and backward, not to the optimizer's update) and give `step` back its result.

Gradient accumulation inside a library (Trainer's `gradient_accumulation_steps`, `accelerator.accumulate`)
needs nothing here: the wrapped optimizer steps once per accumulated step, and the backward calls
before it are summed as a plain loop's are (sandbox/script/hooks.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def real_optimizers(optimizers: list[Any]) -> list[Any]:
    """The optimizers whose `torch.optim.Optimizer.__init__` ran: a wrapper that skipped it (accelerate's
    AcceleratedOptimizer) is left out, the optimizer it wraps is live and listed itself."""
    return [o for o in optimizers if "_optimizer_step_pre_hooks" in getattr(o, "__dict__", {})]


def find_closure(optimizer: Any, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
    """The closure of `optimizer.step(closure)` as a step pre-hook sees the call (`args` begins with the optimizer
    itself), or None."""
    closure = kwargs.get("closure")
    if closure is None and len(args) > 1 and args[0] is optimizer:
        closure = args[1] if _takes_closure_first(optimizer) else None
    return closure if callable(closure) else None


def with_closure(args: tuple, kwargs: dict, closure: Callable[[], Any]) -> tuple[tuple, dict]:
    """The step call's (args, kwargs) with its closure replaced (as a pre-hook returns them to `step`)."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


def replay(first_result: Any, closure: Callable[[], Any], again: Callable[[Callable[[], Any]], Any]) -> Callable[[], Any]:
    """A closure for `step` that returns `first_result` (the closure's run before the step) on its first call and runs
    `closure` through `again` on later ones (LBFGS evaluates its closure several times in one step)."""
    calls = [0]

    def closure_for_step():
        calls[0] += 1
        return first_result if calls[0] == 1 else again(closure)

    return closure_for_step


# Where a module class's `forward` is no model's own: nn.Module's placeholder, LightningModule's pass-through
_CONTAINER_FORWARDS = ("torch.nn.modules.module", "pytorch_lightning.core.module", "lightning.pytorch.core.module")


def forward_owners(module: Any) -> list[Any]:
    """The modules whose `forward` a step calls, to compile for the torch.compile arm: `module` itself, or, when its class
    has no forward of its own (a LightningModule whose training_step calls `self.model(...)`), its children that hold
    parameters, by the same rule."""
    if hasattr(module, "_orig_mod") or "forward" in vars(module):  # torch.compile's wrapper: its forward is the instance's
        return [module]
    owner = next((cls for cls in type(module).__mro__ if "forward" in vars(cls)), None)
    if owner is None or owner.__module__ not in _CONTAINER_FORWARDS:
        return [module]
    return [found for child in module.children() if any(True for _ in child.parameters()) for found in forward_owners(child)]


def run_longer_override() -> str:
    """The `[overrides]` line that lets a script that ended too early run longer, in its loop's own terms: a library
    trainer's `max_steps` argument when one is loaded, else a command-line argument."""
    import sys

    if "transformers.trainer" in sys.modules:
        return '"TrainingArguments(max_steps)" = 1000'
    if "pytorch_lightning.trainer" in sys.modules or "lightning.pytorch.trainer" in sys.modules:
        return '"Trainer(max_steps)" = 1000'
    return '"--max_iters" = 1000'


def _takes_closure_first(optimizer: Any) -> bool:
    """Whether the optimizer's `step` takes the closure as its first parameter (torch's optimizers do)."""
    try:
        parameters = list(inspect.signature(type(optimizer).step).parameters)
    except (TypeError, ValueError):
        return False
    return len(parameters) > 1 and parameters[1] == "closure"
