"""torch_npu.testing.common_utils stand-in: SupportedDevices and create_common_tensor.

The emulated device counts as an Atlas A2 (Ascend910B) chip: tests marked for other SoCs are
skipped, as on such a host.
"""

from __future__ import annotations

import functools
import unittest

import numpy as np
import torch

EMULATED_SOC = "Ascend910B"


def SupportedDevices(devices):  # noqa: N802 (upstream name)
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not any(EMULATED_SOC.startswith(d) or d.startswith(EMULATED_SOC) for d in devices):
                raise unittest.SkipTest(f"for {devices}; the emulation is {EMULATED_SOC}")
            return fn(*args, **kwargs)
        return wrapper
    return decorator


def create_common_tensor(item, minvalue, maxvalue):
    """(cpu tensor, npu tensor) with values uniform in [minvalue, maxvalue); item = [np dtype, format, shape]."""
    dtype, fmt, shape = item
    data = np.random.uniform(minvalue, maxvalue, shape).astype(dtype)
    cpu = torch.from_numpy(data)
    npu = cpu.to("npu")
    if fmt not in (-1, 2):
        import torch_npu

        npu = torch_npu.npu_format_cast(npu, fmt)
    return cpu, npu
