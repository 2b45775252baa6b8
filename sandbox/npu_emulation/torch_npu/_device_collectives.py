"""torch.distributed for the emulated device: an "hccl" backend that is gloo underneath.

Real NPU programs call init_process_group("hccl"). Here "hccl" is registered (when absent) for the
npu and cpu device types as a gloo process group; collectives on device tensors reach gloo with
their host values through the device tensor's dispatch (see _device_backend).

Where gloo falls short of HCCL, `reduce_scatter_tensor` on an hccl group is completed here: gloo's Work for it
has no future ("Work::getFuture not implemented"; the Modded-NanoGPT records' Muon step calls
`dist.reduce_scatter_tensor(..., op=ReduceOp.AVG, async_op=True).get_future()`), and AVG is gloo's SUM divided
by the group's size. The emulated collective runs at once and returns a finished Work whose future holds the
output, which is what an asynchronous HCCL call looks like once waited on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_done = False


def _create_gloo(store, rank, world_size, timeout):
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world_size, timeout)


class FinishedWork:
    """A collective that already ran: what `async_op=True` callers use of a Work (wait, get_future, is_completed)."""

    def __init__(self, output) -> None:
        self._output = output

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result([self._output])
        return future


def _hccl(group) -> bool:
    try:
        return dist.get_backend(group) == "hccl"
    except (RuntimeError, ValueError):
        return False


def _reduce_scatter_tensor_on(original):
    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _hccl(group):
            return original(output, input, op=op, group=group, async_op=async_op)
        average = op == dist.ReduceOp.AVG
        original(output, input, op=dist.ReduceOp.SUM if average else op, group=group, async_op=False)
        if average:
            output.div_(dist.get_world_size(group))
        return FinishedWork(output) if async_op else None

    reduce_scatter_tensor.__wrapped__ = original
    return reduce_scatter_tensor


def install() -> None:
    global _done
    if _done or not dist.is_available():
        return
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _create_gloo, devices=["npu", "cpu"])
    dist.reduce_scatter_tensor = _reduce_scatter_tensor_on(dist.reduce_scatter_tensor)
    _done = True
