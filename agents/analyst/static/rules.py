"""Program-level rules of the static scan: the optimizer, gradient zeroing, host syncs (``syncs``), conv layout.

Unlike the expression patterns these look at calls in their context: how an optimizer is built,
where gradients are zeroed, and does the repository use ``channels_last`` anywhere.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

from trainbridge.records import IntentCategory

from .model import Expr, FileModel, Scope
from .match import Found, Match, peek, peel
from .syncs import host_syncs

OPTIMIZERS = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD"}
)


def _false(e: Expr | None) -> bool:
    return e is not None and peek(e).kind == "const" and peek(e).value is False


def _calls(files: Iterable[FileModel]) -> Iterable[tuple[FileModel, Scope, Expr]]:
    for file in files:
        for scope in file.scopes:
            for c in scope.calls:
                yield file, scope, c


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
