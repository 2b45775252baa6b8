"""Program rule of the static scan: host syncs once per training step (the host waits for the device).

Reported, in a training step (a function that calls ``.backward()`` or ``optimizer.step()``) or a
training loop, once per step:

- ``.item()`` / ``.cpu()`` / ``.tolist()`` (in a print, a logger call, an f-string, a schedule);
- a device tensor used as a Python condition: ``if has_data < world_size: break`` with
  ``has_data = torch.tensor(1, device=device)``, ``if torch.isnan(loss).any():``;
- either of them inside a function or method of the scanned code that the training loop calls every
  step (``loss, stats = rf.forward(x, c)`` whose body calls ``.cpu()``), one call deep.

Not reported: calls in code that runs once (also before or after the training loop of the function
that runs it), calls under an ``if`` that uses ``%`` (logging every N steps; the ``if`` of gradient
accumulation that steps the optimizer is the step itself, see ``ir``), calls in a loop that
synchronizes the device every iteration (a timing loop: the sync is already paid there; a
``synchronize()`` only under such an ``if``, around a periodic evaluation, does not count), and
``.item()`` of a tensor made on the host (``torch.bernoulli(torch.tensor(p)).item()``: no device).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

from trainbridge.records import IntentCategory

from .match import Found, Match, peek, peel
from .model import Expr, FileModel, Scope

HOST_SYNC_OPS = frozenset({"item", "cpu", "tolist"})
_STEP_NAME = re.compile(r"(^|_)(train|training)_?step$|^step_fn$|^train_one_(step|batch)$")
_MODULE_LIKE = re.compile(r"model|net|module", re.IGNORECASE)
# A user's ``def backward(loss, scaler)`` is a step function, but its name is also the tensor method:
# every ``loss.backward()`` of a micro-batch loop would count as a call of a whole step.
_METHOD_NAMES = frozenset({"backward"})
_FACTORIES = frozenset({"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint",
                        "bernoulli", "multinomial", "zeros_like", "ones_like", "full_like"})
_CHECKS = frozenset({"isnan", "isinf", "isfinite", "isneginf", "isposinf"})


def _optimizer_step_called(ops: set[str]) -> bool:
    return any(o.endswith(".step") and "opt" in o.rsplit(".", 1)[0].lower() for o in ops)


def is_step_scope(scope: Scope) -> bool:
    if scope.qualname is None:
        return False
    name = scope.qualname.rsplit(".", 1)[-1]
    return "backward" in scope.ops or _optimizer_step_called(scope.ops) or bool(_STEP_NAME.search(name))


def step_function_names(files: Iterable[FileModel]) -> set[str]:
    """Names of functions that run one training step (call backward or optimizer.step)."""
    names = set()
    for file in files:
        for scope in file.scopes:
            if scope.qualname and is_step_scope(scope):
                names.add(scope.qualname.rsplit(".", 1)[-1])
    return names - _METHOD_NAMES


def epoch_function_names(files: Iterable[FileModel]) -> set[str]:
    """Functions that run a loop of training steps themselves (``def train(...)`` over the batches of one epoch).

    A loop that calls one (``for epoch in ...: train(...); test(...)``) runs once per epoch, not once per step.
    """
    names = set()
    for file in files:
        for scope in file.scopes:
            if scope.qualname and any("backward" in ops or _optimizer_step_called(ops) for ops in scope.loop_ops.values()):
                names.add(scope.qualname.rsplit(".", 1)[-1])
    return names - _METHOD_NAMES


def _on_host(e: Expr, depth: int = 0) -> bool:
    """A tensor a torch factory made on the host: no ``device=``, and built only from host values."""
    x = peek(e)
    if depth > 6 or x.kind != "call" or x.method or x.op not in _FACTORIES or "device" in x.kwargs:
        return False
    return all(_on_host(a, depth + 1) for a in x.args if peek(a).kind == "call")


def _device_tensor(e: Expr, depth: int = 0) -> bool:
    """A tensor a condition reads on the host: a factory result with ``device=``, or an any/all of a check."""
    x = peek(e)
    if depth > 4 or x.kind != "call":
        return False
    if not x.method and x.op in _FACTORIES:
        device = x.kwargs.get("device")
        return device is not None and not (peek(device).kind == "str" and peek(device).value == "cpu")
    if x.method and x.op in ("any", "all") and x.args:
        inner = peek(x.args[0])
        return inner.kind == "call" and (inner.op in _CHECKS or _device_tensor(inner, depth + 1))
    return False


def _conditions(scope: Scope) -> Iterator[Expr]:
    """The tests of ``if`` / ``while`` statements of ``scope`` that read a device tensor."""
    for root in scope.roots:
        if root.node is not root.stmt.node or root.stmt.periodic:
            continue
        operands = root.args if root.kind == "other" and root.op in ("Comparison", "not", "BooleanOperation") else (root,)
        if any(_device_tensor(a) for a in operands):
            yield root


def _syncs(scope: Scope) -> Iterator[tuple[Expr, str]]:
    """Every host sync of ``scope`` (not under a periodic ``if``), with how it reads."""
    for c in scope.calls:
        if c.op not in HOST_SYNC_OPS or not c.method or c.stmt.periodic:
            continue
        receiver = peel(c.args[0])
        if receiver.kind in ("name", "attr") and _MODULE_LIKE.search(receiver.op):
            continue
        if _on_host(c.args[0]):
            continue
        yield c, f".{c.op}()"
    for root in _conditions(scope):
        yield root, "a device tensor as a Python condition"


def _callee(file: FileModel, c: Expr) -> Scope | None:
    """The function or method of ``file`` a call in a loop runs: ``f(...)``, ``self.m(...)``, ``obj.m(...)``.

    ``obj`` is a name bound to ``Class(...)`` of a class defined in the same file.
    """
    if c.kind != "call":
        return None
    if not c.method:
        if c.op.startswith("self."):
            cls = c.stmt.scope.class_name
            return file.methods.get((cls, c.op[5:])) if cls else None
        return file.functions.get(c.op) if c.callee == c.op else None
    receiver = peek(c.args[0])
    if receiver.kind != "call" or receiver.method:
        return None
    return file.methods.get((receiver.op, c.op))


def host_syncs(files: list[FileModel]) -> list[Match]:
    """Host syncs once per training step; see the module docstring."""
    step_names = step_function_names(files)
    epoch_names = epoch_function_names(files)

    def training(ops: set[str]) -> bool:
        return "backward" in ops or _optimizer_step_called(ops) or bool(ops & step_names)

    def full_step(ops: set[str]) -> bool:
        return ("backward" in ops and _optimizer_step_called(ops)) or bool(ops & step_names)

    def outer_loops(scope: Scope) -> set[int]:
        """Training loops that hold a loop of whole steps (epochs around steps), or call a function that runs
        one (``for epoch in ...: train(...)``): once per epoch.

        An inner loop of micro-batches (backward, no optimizer step) or over the optimizers
        (``for opt in optimizers: opt.step()``, no backward) is part of the step: the loop around
        it runs once per step.
        """
        outer: set[int] = set()
        for c in scope.calls:
            if not c.method and c.callee == c.op and c.op in epoch_names:  # for epoch in ...: train(...), not model.train()
                outer |= {id(loop) for loop in c.stmt.loops}
        for c in scope.calls:
            chain = c.stmt.loops
            for i, loop in enumerate(chain):
                if any(full_step(scope.loop_ops.get(id(inner), set())) for inner in chain[i + 1 :]):
                    outer.add(id(loop))
        return outer

    def synced(scope: Scope) -> set[int]:
        """Loops of ``scope`` that synchronize the device every iteration."""
        return {id(loop) for s in scope.calls if s.op == "synchronize" and not s.stmt.periodic for loop in s.stmt.loops}

    out: list[Match] = []
    reported: set[int] = set()
    for file in files:
        for scope in file.scopes:
            outer, timing = outer_loops(scope), synced(scope)
            drives_loop = any(training(ops) for ops in scope.loop_ops.values())

            def per_step(stmt) -> bool:
                """The statement runs once per training step (in the innermost step loop, not a timing loop)."""
                if any(id(loop) in timing for loop in stmt.loops):
                    return False
                steps = [loop for loop in stmt.loops if training(scope.loop_ops.get(id(loop), set()))]
                return bool(steps) and id(steps[-1]) not in outer

            for site, what in _syncs(scope):
                in_loop = per_step(site.stmt)
                # A function that runs the training loop itself is not a per-step function: outside its
                # loop, code runs once.
                if not in_loop and (drives_loop or not is_step_scope(scope) or any(id(l) in timing for l in site.stmt.loops)):
                    continue
                where = "a training loop" if in_loop else f"the training step {scope.qualname}()"
                out.append(Match.at_call(IntentCategory.host_sync, file, site,
                                         Found(0.4, f"{what} in {where}: the host waits for the device every step")))
                reported.add(id(site.node))
            for c in scope.calls:  # one call deep: what the training loop calls every step
                if c.stmt.periodic or not per_step(c.stmt):
                    continue
                callee = _callee(file, c)
                if callee is None or callee is scope or is_step_scope(callee):
                    continue
                for site, what in _syncs(callee):
                    if id(site.node) in reported or any(id(loop) in synced(callee) for loop in site.stmt.loops):
                        continue
                    note = (f"{what} in {callee.qualname}(), which the training loop calls every step (line {c.start}): "
                            "the host waits for the device every step")
                    out.append(Match.at_call(IntentCategory.host_sync, file, site, Found(0.35, note)))
                    reported.add(id(site.node))
    return out
