"""npu_format_cast / npu_format_cast_ / get_npu_format: NPU storage formats, recorded, never applied.

CPU memory has one layout, so values never change; what is tracked is the format number torch_npu
would report (ACL formats: 0 NCHW, 1 NHWC, 2 ND, 3 NC1HWC0, 4 FRACTAL_Z, 29 FRACTAL_NZ, 30 NCDHW,
32 NDC1HWC0, 33 FRACTAL_Z_3D, ...). Rule of op-plugin's test_format_cast.py: casting a tensor in a
private format back to ND gives its base format (the one it had before the private cast); casting
to the format it already has returns the tensor itself; the result keeps requires_grad.
torch.npu.config.allow_internal_format does not change explicit casts.
"""

from __future__ import annotations

import torch

from ._checks import check_int, check_tensor

ND = 2
_BASE_FORMATS = {0, 1, 2, 27, 30}
_ATTR, _BASE_ATTR = "_trainbridge_npu_format", "_trainbridge_npu_base_format"


def get_npu_format(self) -> int:
    check_tensor("get_npu_format", "self", self)
    return getattr(self, _ATTR, ND)


def _target(op: str, self, acl_format) -> int:
    current, base = get_npu_format(self), getattr(self, _BASE_ATTR, get_npu_format(self))
    fmt = get_npu_format(acl_format) if isinstance(acl_format, torch.Tensor) else check_int(op, "acl_format", acl_format)
    if fmt < 0:
        raise RuntimeError(f"{op}: acl_format must be a non-negative ACL format id, got {fmt}")
    if fmt == ND and current not in _BASE_FORMATS:
        return base
    return fmt


def _mark(t: torch.Tensor, fmt: int, base: int) -> torch.Tensor:
    setattr(t, _ATTR, fmt)
    setattr(t, _BASE_ATTR, fmt if fmt in _BASE_FORMATS else base)
    return t


def npu_format_cast(self, acl_format, *, customize_dtype=None, input_dtype=None):
    """A copy of `self` in format `acl_format` (an int, or another tensor whose format to take)."""
    op = "npu_format_cast"
    check_tensor(op, "self", self)
    fmt = _target(op, self, acl_format)
    if fmt == get_npu_format(self):
        return self
    base = getattr(self, _BASE_ATTR, get_npu_format(self))
    return _mark(self.clone(), fmt, base)


def npu_format_cast_(self, src, *, customize_dtype=None, input_dtype=None):
    """In place: `self` takes format `src` (an int, or a tensor whose format to take)."""
    op = "npu_format_cast_"
    check_tensor(op, "self", self)
    fmt = _target(op, self, src)
    return _mark(self, fmt, getattr(self, _BASE_ATTR, get_npu_format(self)))
