"""torch_npu.testing.common_utils stand-in: SupportedDevices and create_common_tensor.

The emulated device counts as the chip torch_npu._soc names (Atlas A2, Ascend910B, unless
TRAINBRIDGE_EMULATED_NPU_SOC says otherwise): tests marked for other SoCs are skipped, as on such a host.
"""

from __future__ import annotations

import functools
import unittest

import numpy as np
import torch

from .._soc import soc_version


def SupportedDevices(devices):  # noqa: N802 (upstream name)
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            soc = soc_version()
            if not any(soc.startswith(d) or d.startswith(soc) for d in devices):
                raise unittest.SkipTest(f"for {devices}; the emulation is {soc}")
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
