"""Ops that torch_npu registers without a derivative: what backward through them does, by release.

From release 26.1.0 op-plugin registers PyTorch's autogradNotImplementedFallback for them, so the
backward raises RuntimeError "derivative for npu::<op> is not implemented"; before, PyTorch's
default autograd fallback ("warn" mode) warns and the inputs receive no gradient (see _version).
"""

from __future__ import annotations

import warnings

import torch

from ._version import ENV, raises_on_missing_derivative, release_string


def not_implemented_message(op: str) -> str:
    return f"derivative for npu::{op} is not implemented"


def warn_message(op: str) -> str:
    return (
        f"npu::{op}: an autograd kernel was not registered to the Autograd key(s) but we are trying to "
        "backprop through it. This may lead to silently incorrect behavior. (trainbridge emulation of "
        f"torch_npu release {release_string()}, set by {ENV}: {op} has no backward, so its inputs receive "
        "no gradient through it; wrap it in an autograd.Function to train.)"
    )


def no_backward(op: str, n_inputs: int):
    """The backward of an op without a derivative: raise (>= 26.1.0) or warn and return no gradients."""
    if raises_on_missing_derivative():
        raise RuntimeError(not_implemented_message(op))
    warnings.warn(warn_message(op), UserWarning, stacklevel=3)
    return (None,) * n_inputs


class ForwardOnly(torch.autograd.Function):
    """Runs `fn(*tensors)` with autograd attached only so that backward behaves like torch_npu's."""

    @staticmethod
    def forward(ctx, op, fn, *tensors):
        ctx.op, ctx.n = op, len(tensors)
        with torch.no_grad():
            out = fn(*tensors)
        return out

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *no_backward(ctx.op, ctx.n))
