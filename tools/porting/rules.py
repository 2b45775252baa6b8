"""The porting rules as pure functions: which torch.cuda members torch.npu has, and CUDA-specific strings."""

from __future__ import annotations

import re

import libcst as cst

from trainbridge.tools.porting import npu_surface as surface
from trainbridge.tools.porting.results import ChangeKind, SkipCategory

_INDEX = r"(:(\d+|\{[^{}]*\}|%[dis])?)?"  # ":0", ":{}", ":%d" or nothing
_DEVICE = re.compile("cuda" + _INDEX)
_NPU_DEVICE = re.compile("npu" + _INDEX)
FSTRING_DEVICE_HEAD = re.compile(r"cuda(:\d*)?")
_BACKEND_SPEC = re.compile(r"\w+:\w+(,\w+:\w+)+")
CUDA_MODULES = {"torch.cuda": "torch_npu.npu", "torch.cuda.amp": "torch_npu.npu.amp"}
BACKEND_MODULES = ("torch.backends.cudnn", "torch.backends.cuda")
COMPILE_MODES = {"reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"}


def dotted(node: cst.BaseExpression | None) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{dotted(node.value)}.{node.attr.value}"
    return ""


def dotted_expr(name: str) -> cst.Attribute | cst.Name:
    parts = name.split(".")
    expr: cst.Attribute | cst.Name = cst.Name(parts[0])
    for part in parts[1:]:
        expr = cst.Attribute(value=expr, attr=cst.Name(part))
    return expr


def member_verdict(member: str | None) -> tuple[SkipCategory, str] | None:
    """None when torch.npu provides `torch.cuda.<member>`; else the category and reason."""
    if member is None:
        return SkipCategory.cuda_api, ("bare reference to the torch.cuda module: which of its members are used "
                                       "cannot be known statically; use torch.npu by hand where they exist")
    if member in surface.CUDA_GRAPH_MEMBERS:
        return SkipCategory.cuda_graph, surface.CUDA_GRAPH_REASON
    if member == "nvtx":
        return SkipCategory.nvtx, surface.NVTX_REASON
    if member == "amp" or member in surface.NPU_DEVICE_MODULE:
        return None
    hint = surface.CUDA_MEMBER_HINTS.get(member, "port this use by hand or remove it")
    return SkipCategory.cuda_api, f"torch.npu has no `{member}` (torch_npu 2.14 API surface): {hint}"


def amp_verdict(member: str | None) -> tuple[SkipCategory, str] | None:
    if member is None or member in surface.NPU_AMP:
        return None
    hint = surface.CUDA_MEMBER_HINTS.get(member, "use the device-generic torch.amp API with device_type='npu'")
    return SkipCategory.cuda_api, f"torch_npu.npu.amp provides autocast and GradScaler, not `{member}`: {hint}"


def is_npu_string(value: str) -> bool:
    """Is `value` an NPU device string, the hccl backend, or a backend spec naming either?"""
    if _NPU_DEVICE.fullmatch(value) or value == "hccl":
        return True
    return bool(_BACKEND_SPEC.fullmatch(value)) and any(
        p in ("npu", "hccl") for pair in value.split(",") for p in pair.split(":"))


def convert_string(value: str) -> tuple[ChangeKind, str] | None:
    """The NPU spelling of a CUDA-specific string literal, or None when it is not one."""
    if _DEVICE.fullmatch(value):
        return ChangeKind.device_string, "npu" + value[4:]
    if value == "nccl":
        return ChangeKind.dist_backend, "hccl"
    if _BACKEND_SPEC.fullmatch(value) and any(p in ("cuda", "nccl") for pair in value.split(",") for p in pair.split(":")):
        pairs = [pair.split(":") for pair in value.split(",")]
        new = ",".join(f"{'npu' if d == 'cuda' else d}:{'hccl' if b == 'nccl' else b}" for d, b in pairs)
        return ChangeKind.dist_backend, new
    if value == "CUDA_VISIBLE_DEVICES":
        return ChangeKind.env_var, "ASCEND_RT_VISIBLE_DEVICES"
    return None
