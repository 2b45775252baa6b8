"""torch.npu.config stand-in: `allow_internal_format` (private NZ/5HD formats off or on).

The emulation stores every tensor in the plain ND format whatever the setting (CPU memory has no
private formats), so the flag only changes what npu_format_cast reports (see torch_npu._format).
"""

from __future__ import annotations

import sys
import types


class _Config(types.ModuleType):
    """Module with checked attributes, like torch_npu.npu.config (assignment validates the value)."""

    _allow_internal_format = False

    @property
    def allow_internal_format(self) -> bool:
        return type(self)._allow_internal_format

    @allow_internal_format.setter
    def allow_internal_format(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"torch.npu.config.allow_internal_format must be a bool, got {type(value).__name__}")
        type(self)._allow_internal_format = value


sys.modules[__name__].__class__ = _Config
