"""torch.distributed for the emulated device: an "hccl" backend that is gloo underneath.

Real NPU programs call init_process_group("hccl"). Here "hccl" is registered (when absent) for the
npu and cpu device types as a gloo process group; collectives on device tensors reach gloo with
their host values through the device tensor's dispatch (see _device_backend).

Where gloo falls short of HCCL, `reduce_scatter_tensor`, the list form `reduce_scatter` and `all_reduce` on an
hccl group are completed here: gloo's Work for them has no future ("Work::getFuture not implemented"; the
Modded-NanoGPT records' Muon step calls `dist.reduce_scatter_tensor(..., op=ReduceOp.AVG,
async_op=True).get_future()`, record 27 the list form), and AVG is gloo's SUM divided by the group's size. The emulated collective runs at once and returns a finished Work whose future holds the
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


def _reduce_scatter_on(original):
    """reduce_scatter_tensor(output, input, ...) or the list form reduce_scatter(output, input_list, ...) (record 27's
    Muon step) on an hccl group: run at once, AVG as SUM over the group's size, a finished Work when asked."""
    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _hccl(group):
            return original(output, input, op=op, group=group, async_op=async_op)
        average = op == dist.ReduceOp.AVG
        original(output, input, op=dist.ReduceOp.SUM if average else op, group=group, async_op=False)
        if average:
            output.div_(dist.get_world_size(group))
        return FinishedWork(output) if async_op else None

    reduce_scatter.__wrapped__ = original
    return reduce_scatter


def _all_reduce_on(original):
    """all_reduce(tensor, op=ReduceOp.AVG, async_op=True) on an hccl group: gloo refuses AVG ("Cannot use
    ReduceOp.AVG with Gloo") and gives no future; HCCL does both."""
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _hccl(group):
            return original(tensor, op=op, group=group, async_op=async_op)
        average = op == dist.ReduceOp.AVG
        original(tensor, op=dist.ReduceOp.SUM if average else op, group=group, async_op=False)
        if average:
            tensor.div_(dist.get_world_size(group))
        return FinishedWork(tensor) if async_op else None

    all_reduce.__wrapped__ = original
    return all_reduce


# the collectives a program's compiled code may call (the Modded-NanoGPT records' optimizers: reduce_scatter_tensor,
# all_gather_into_tensor, all_reduce)
_COLLECTIVES = ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce", "all_gather", "reduce_scatter",
                "broadcast", "all_to_all_single", "barrier")


def opaque_to_compile() -> None:
    """Under a program's torch.compile each collective runs whole, as the C++ HCCL call does on an NPU: a graph break
    around the call, and Dynamo never compiles a frame of its own inside it. Traced, the completed
    reduce_scatter_tensor's call of gloo's became Dynamo's functional collective, which refused the ReduceOp
    ("'RedOpType' object has no attribute 'lower'"); and once Dynamo gave up the compiled optimizer step that calls
    them in a loop (the Modded-NanoGPT records' DistAdam.step), it compiled torch.distributed's deprecation wrapper
    of all_gather_into_tensor as a frame of its own, whose input, a no_grad slice of a parameter updated in place,
    Dynamo cannot fake ("A view was created in no_grad mode and its base ... has been modified inplace")."""
    import torch._dynamo

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "__trainbridge_whole__", False):
            continue
        whole = torch._dynamo.disable(fn, reason="an emulated HCCL collective runs whole")
        whole.__trainbridge_whole__ = True
        setattr(dist, name, whole)


def install() -> None:
    global _done
    if _done or not dist.is_available():
        return
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _create_gloo, devices=["npu", "cpu"])
    dist.reduce_scatter_tensor = _reduce_scatter_on(dist.reduce_scatter_tensor)
    dist.reduce_scatter = _reduce_scatter_on(dist.reduce_scatter)
    dist.all_reduce = _all_reduce_on(dist.all_reduce)
    _done = True
