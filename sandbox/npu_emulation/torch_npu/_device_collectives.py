"""torch.distributed for the emulated device: an "hccl" backend that is gloo underneath.

Real NPU programs call init_process_group("hccl"). Here "hccl" is registered (when absent) for the
npu and cpu device types as a gloo process group; collectives on device tensors reach gloo with
their host values through the device tensor's dispatch (see _device_backend).
"""

from __future__ import annotations

import torch.distributed as dist

_done = False


def _create_gloo(store, rank, world_size, timeout):
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world_size, timeout)


def install() -> None:
    global _done
    if _done or not dist.is_available():
        return
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _create_gloo, devices=["npu", "cpu"])
    _done = True
