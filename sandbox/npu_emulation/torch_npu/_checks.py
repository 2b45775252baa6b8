"""Argument checks shared by the emulated fused ops; messages name the offending argument."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_values = threading.local()


@contextmanager
def shapes_only():
    """A run whose inputs are stand-ins (zeros) for a tracer's fake tensors: only the output shapes matter, so the
    checks of input values (a compressed mask's template, fully masked rows) stand aside (_device_compile)."""
    before = getattr(_values, "unknown", False)
    _values.unknown = True
    try:
        yield
    finally:
        _values.unknown = before


def values_unknown() -> bool:
    """In a shapes-only run, or while a compiler traces the op (Dynamo inlining it: the npu -> cpu mapping compiles
    fused ops as their host math, on fake tensors whose values cannot be read)."""
    return getattr(_values, "unknown", False) or torch.compiler.is_compiling()

# dtypes the NPU kernels document; float64 is accepted by the emulation only (for gradcheck).
NPU_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
EMULATION_FLOAT_DTYPES = NPU_FLOAT_DTYPES + (torch.float64,)


def check_tensor(op: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in EMULATION_FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype}; torch_npu supports float16, bfloat16 and float32 "
            "(float64 is accepted only by the CPU emulation, for gradcheck)"
        )


def check_rank(op: str, name: str, t: torch.Tensor, low: int, high: int) -> None:
    if not low <= t.dim() <= high:
        raise ValueError(f"{op}: {name} must have {low} to {high} dimensions, got {t.dim()} (shape {tuple(t.shape)})")


def check_not_empty(op: str, name: str, t: torch.Tensor) -> None:
    if t.numel() == 0:
        raise ValueError(f"{op}: {name} must not be empty (shape {tuple(t.shape)})")


def check_int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    return value


def normalize_dim(op: str, dim, ndim: int, name: str = "dim") -> int:
    check_int(op, name, dim)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{op}: {name}={dim} is out of range for a {ndim}-D input (expected [{-ndim}, {ndim - 1}])")
    return dim % ndim


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The fused kernels compute in fp32; fp64 inputs (emulation only) stay fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sum_to_shape(t: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Sum `t` over the axes where `shape` broadcasts (size 1), keeping dims; same rank assumed."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, t.shape)) if n == 1 and m != 1)
    return t.sum(dim=axes, keepdim=True) if axes else t


def same_device_message(a: torch.device, b: torch.device) -> str:
    """PyTorch's (and torch_npu's) text for tensors on two devices."""
    first, second = (a, b) if a.type != "cpu" else (b, a)
    return f"Expected all tensors to be on the same device, but found at least two devices, {first} and {second}!"


def check_same_device(op: str, reference: torch.Tensor, *others) -> None:
    for t in others:
        if isinstance(t, torch.Tensor) and t.device != reference.device:
            raise RuntimeError(same_device_message(reference.device, t.device) + f" (in {op})")
