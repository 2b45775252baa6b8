"""Program-level rules of the static scan: the optimizer, gradient zeroing, host syncs, conv layout.

Unlike the expression patterns these look at calls in their context: is the call inside a
training step (a function that calls ``.backward()`` or ``optimizer.step()``) or a training loop,
and does the repository use ``channels_last`` anywhere.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, Iterable

from trainbridge.records import IntentCategory

from .model import Expr, FileModel, Scope
from .match import Found, Match, peek, peel

OPTIMIZERS = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD"}
)
HOST_SYNC_OPS = frozenset({"item", "cpu", "tolist"})
_STEP_NAME = re.compile(r"(^|_)(train|training)_?step$|^step_fn$|^train_one_(step|batch)$")
_MODULE_LIKE = re.compile(r"model|net|module", re.IGNORECASE)


def _false(e: Expr | None) -> bool:
    return e is not None and peek(e).kind == "const" and peek(e).value is False


def _calls(files: Iterable[FileModel]) -> Iterable[tuple[FileModel, Scope, Expr]]:
    for file in files:
        for scope in file.scopes:
            for c in scope.calls:
                yield file, scope, c


def _optimizer_step_called(ops: set[str]) -> bool:
    return any(o.endswith(".step") and "opt" in o.rsplit(".", 1)[0].lower() for o in ops)


def step_function_names(files: Iterable[FileModel]) -> set[str]:
    """Names of functions that run one training step (call backward or optimizer.step)."""
    names = set()
    for file in files:
        for scope in file.scopes:
            if scope.qualname and is_step_scope(scope):
                names.add(scope.qualname.rsplit(".", 1)[-1])
    return names


def is_step_scope(scope: Scope) -> bool:
    if scope.qualname is None:
        return False
    name = scope.qualname.rsplit(".", 1)[-1]
    return "backward" in scope.ops or _optimizer_step_called(scope.ops) or bool(_STEP_NAME.search(name))


def optimizer_rules(files: list[FileModel]) -> list[Match]:
    """torch.optim optimizers built with foreach=False (0.6) or with the default implementation (0.3)."""
    out = []
    for file, _, c in _calls(files):
        if c.op not in OPTIMIZERS or c.method:
            continue
        foreach, fused = c.kwargs.get("foreach"), c.kwargs.get("fused")
        chosen = _cuda_only(c)
        if chosen:
            note = (
                f"{c.op}(..., {chosen}): the fused/foreach implementation is chosen by a condition on 'cuda', "
                "so on other devices the per-parameter loop runs; pass fused=True where the target supports it "
                "(or torch_npu's NpuFused*)"
            )
            out.append(Match.at_call(IntentCategory.optimizer_step, file, c, Found(0.55, note)))
        elif _false(foreach):
            note = (
                f"{c.op}(..., foreach=False): a loop of small kernels per parameter and update; "
                "foreach/fused (or torch_npu's NpuFused*) updates all parameters in a few kernels"
            )
            out.append(Match.at_call(IntentCategory.optimizer_step, file, c, Found(0.6, note)))
        elif foreach is None and fused is None and not _may_set_implementation(c.kwargs.get("***")):
            note = (
                f"{c.op} with the default implementation (a per-parameter loop on CPU, foreach on CUDA/NPU); "
                "a fused optimizer (fused=True, NpuFused*) updates all parameters in a few kernels"
            )
            out.append(Match.at_call(IntentCategory.optimizer_step, file, c, Found(0.3, note)))
    return out


def _may_set_implementation(splat: Expr | None) -> bool:
    """``**kwargs`` that may hold fused/foreach: anything but a dict(...) or {...} visibly without them."""
    if splat is None:
        return False
    x = peek(splat)
    if x.kind == "call" and x.op == "dict" and not x.args:
        return any(k in x.kwargs for k in ("fused", "foreach", "***"))
    if x.kind == "other" and x.op == "Dict":
        keys = {peek(a).value for a in x.args if peek(a).kind == "str"}
        return bool(keys & {"fused", "foreach"}) or len(keys) * 2 != len(x.args)
    return True


def _mentions_cuda(e: Expr, depth: int = 12) -> bool:
    x = peek(e)
    if x.kind == "str" and isinstance(x.value, str) and "cuda" in x.value:
        return True
    return depth > 0 and any(_mentions_cuda(a, depth - 1) for a in (*x.args, *x.kwargs.values()))


def _cuda_only(c: Expr) -> str | None:
    """How an optimizer's fused/foreach argument that is on only for CUDA is written, else None.

    ``fused=use_fused`` with ``use_fused = ... device_type == 'cuda'``, or ``**extra_args`` built
    from such a condition.
    """
    for key in ("fused", "***", "foreach"):
        e = c.kwargs.get(key)
        if e is None or peek(e).kind == "const" or not _mentions_cuda(e):
            continue
        name = e.op if e.kind == "name" else "..."
        return f"**{name}" if key == "***" else f"{key}={name}"
    return None


def zero_grad_rules(files: list[FileModel]) -> list[Match]:
    out = []
    for file, _, c in _calls(files):
        if c.op == "zero_grad" and c.method and _false(c.arg(1, "set_to_none")):
            note = "zero_grad(set_to_none=False) writes zeros into every gradient each step; set_to_none=True skips that"
            out.append(Match.at_call(IntentCategory.zero_grad, file, c, Found(0.45, note)))
        elif c.op == "zero_" and c.method:
            grad = peel(c.args[0])
            if grad.kind == "attr" and grad.op == "data":
                grad = peel(grad.args[0])
            if grad.kind == "attr" and grad.op == "grad":
                note = "gradients zeroed one tensor at a time (p.grad.zero_()); optimizer.zero_grad() sets them to None"
                out.append(Match.at_call(IntentCategory.zero_grad, file, c, Found(0.4, note)))
    return out


def host_syncs(files: list[FileModel]) -> list[Match]:
    """.item() / .cpu() / .tolist() in a training step or training loop, once per step.

    Not reported: calls in code that runs once (also before or after the training loop of the
    function that runs it), calls under an ``if`` that uses ``%`` (logging
    every N steps), and calls in a loop that synchronizes the device itself every iteration
    (a timing loop: the sync is already paid there, removing the .item() gains nothing; a
    ``synchronize()`` only under such an ``if``, around a periodic evaluation, does not count).
    """
    step_names = step_function_names(files)

    def training(ops: set[str]) -> bool:
        return "backward" in ops or _optimizer_step_called(ops) or bool(ops & step_names)

    def full_step(ops: set[str]) -> bool:
        return ("backward" in ops and _optimizer_step_called(ops)) or bool(ops & step_names)

    def outer_loops(scope: Scope) -> set[int]:
        """Training loops that hold a loop of whole steps (epochs around steps): once per epoch.

        An inner loop of micro-batches (backward, no optimizer step) or over the optimizers
        (``for opt in optimizers: opt.step()``, no backward) is part of the step: the loop around
        it runs once per step.
        """
        outer = set()
        for c in scope.calls:
            chain = c.stmt.loops
            for i, loop in enumerate(chain):
                if any(full_step(scope.loop_ops.get(id(inner), set())) for inner in chain[i + 1 :]):
                    outer.add(id(loop))
        return outer

    out: list[Match] = []
    outer: dict[int, set[int]] = {}
    synced: dict[int, set[int]] = {}  # per scope: loops that synchronize the device every iteration
    for file, scope, c in _calls(files):
        if c.op not in HOST_SYNC_OPS or not c.method or c.stmt.periodic:
            continue
        receiver = peel(c.args[0])
        if receiver.kind in ("name", "attr") and _MODULE_LIKE.search(receiver.op):
            continue
        loop_ops = [scope.loop_ops.get(id(loop), set()) for loop in c.stmt.loops]
        if id(scope) not in synced:
            synced[id(scope)] = {id(loop) for s in scope.calls if s.op == "synchronize" and not s.stmt.periodic
                                 for loop in s.stmt.loops}
        if any(id(loop) in synced[id(scope)] for loop in c.stmt.loops):
            continue
        steps = [loop for loop, ops in zip(c.stmt.loops, loop_ops) if training(ops)]
        if id(scope) not in outer:
            outer[id(scope)] = outer_loops(scope)
        in_loop = bool(steps) and id(steps[-1]) not in outer[id(scope)]
        # A function that runs the training loop itself is not a per-step function: outside its
        # loop, code runs once.
        drives_loop = any(training(ops) for ops in scope.loop_ops.values())
        if not in_loop and (drives_loop or not is_step_scope(scope)):
            continue
        where = "a training loop" if in_loop else f"the training step {scope.qualname}()"
        note = f".{c.op}() in {where}: the host waits for the device every step"
        out.append(Match.at_call(IntentCategory.host_sync, file, c, Found(0.4, note)))
    return out


def _conv_classes(files: list[FileModel]) -> set[str]:
    """Classes that build Conv2d layers, directly or through other such classes."""
    ops: dict[str, set[str]] = defaultdict(set)
    for _, scope, c in _calls(files):
        if scope.class_name and not c.method:
            ops[scope.class_name].add(c.op)
    conv = {name for name, called in ops.items() if "Conv2d" in called}
    while True:
        more = {name for name, called in ops.items() if called & conv} - conv
        if not more:
            return conv
        conv |= more


def conv_layout(files: list[FileModel]) -> list[Match]:
    """One finding for a conv net (2+ Conv2d, or Conv2d with BatchNorm2d) when channels_last is never used.

    Spans: where the conv model is built outside its own classes (where ``.to(memory_format=
    torch.channels_last)`` goes), then each Conv2d layer.
    """
    if any(f.mentions_channels_last for f in files):
        return []
    layers = [(f, c) for f, _, c in _calls(files) if c.op == "Conv2d" and not c.method]
    batch_norm = any(c.op == "BatchNorm2d" and not c.method for _, _, c in _calls(files))
    if not layers or (len(layers) < 2 and not batch_norm):
        return []
    conv = _conv_classes(files)
    built = [(f, c) for f, scope, c in _calls(files) if c.op in conv and not c.method and scope.class_name not in conv]
    note = (
        f"{len(layers)} Conv2d layer(s) and no memory_format=torch.channels_last anywhere: "
        "convolutions run in NCHW with layout conversions around each kernel"
    )
    sites = built + layers
    first_file, first = sites[0]
    match = Match.at_call(IntentCategory.conv_layout, first_file, first, Found(0.4 if batch_norm else 0.35, note))
    match.sites = sites
    match.core = frozenset(id(c.node) for _, c in sites)
    return [match]


PROGRAM_RULES: tuple[Callable[[list[FileModel]], list[Match]], ...] = (
    optimizer_rules,
    zero_grad_rules,
    host_syncs,
    conv_layout,
)
