"""torch_npu.npu graph capture on the emulation: NPUGraph, graph, graph_pool_handle, is_current_stream_capturing.

A capture runs its body eagerly once while a TorchDispatchMode records every ATen op the body
dispatches (below autograd, so forward and backward work alike; a fused op is recorded as the ATen
ops the emulation computes it with). `replay()` re-runs the recorded ops in order on the same tensor
objects, below autograd: static inputs are read with their current contents and each op's result is
copied into the tensor the capture produced, so the static outputs and every intermediate are
updated in place (the CUDA-graph contract torch_npu's NPUGraph follows). Results that alias an
input (views, in-place and out= ops) are not copied: re-running them writes them already.

Kept from the NPU:
- a capture leaves memory that existed before it unchanged: tensors allocated before
  capture_begin that the body writes get their contents back at capture_end (a device capture
  records kernels without running them), and replay then writes them;
- a host read of a device tensor (`.item()`, `.tolist()`, `bool(t)`) during a capture raises, as an
  aclgraph capture does; this needs the emulated npu device (in the op-math-only mode every tensor is
  a host tensor and nothing is refused);
- one capture at a time; a graph captures once until reset(); replay without a capture raises;
- ops torch_npu documents as not capturable refuse a capture (`refuse_capture`, used by
  npu_fusion_attention and _v2; npu_fusion_attention_v3 is the capturable one).
Not emulated: what the emulation's own op code decides on the host during capture (shapes, values it
reads, npu_fusion_attention's planning) is fixed at capture, like the host arguments of a real graph;
random ops draw new values at each replay; memory pools are accepted and ignored (device tensors are
host memory); the capture stream is not checked (the emulated device has one synchronous stream);
NPUGraph.update (auto_dispatch_capture) is not provided. make_graphed_callables: .graphed_callables.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["NPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing", "refuse_capture"]

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_HOST_READ = torch.ops.aten._local_scalar_dense.default
_pool_ids = itertools.count(1)
_capturing: "NPUGraph | None" = None


def is_current_stream_capturing() -> bool:
    """True while an NPUGraph capture is under way (the emulated device has one stream)."""
    return _capturing is not None


def graph_pool_handle() -> tuple[int, int]:
    """An opaque token naming a graph memory pool, for capture_begin(pool=...) / graph(pool=...)."""
    return (next(_pool_ids), 0)


def refuse_capture(op: str, hint: str) -> None:
    """For an op torch_npu documents as not capturable: raise while a capture is under way."""
    if _capturing is not None:
        raise RuntimeError(f"{op} is not supported in aclgraph (NPUGraph capture): {hint}")


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the values: a device tensor's host tensor, else the tensor itself."""
    return getattr(t, "_host", t)


def _storage_key(t: torch.Tensor) -> int:
    return values_of(t).untyped_storage().data_ptr()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    ha, hb = values_of(a), values_of(b)
    return (ha.data_ptr() == hb.data_ptr() and ha.shape == hb.shape and ha.stride() == hb.stride()
            and ha.dtype == hb.dtype)


def _returns(func, out) -> list[tuple[Any, bool]]:
    """[(returned value, aliases an input)] in the schema's return order."""
    returns = func._schema.returns
    if not returns:
        return []
    values = [out] if len(returns) == 1 else list(out)
    return [(v, r.alias_info is not None) for v, r in zip(values, returns)]


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _written_args(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes (schema arguments annotated `Tensor(a!)`)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written += _tensors(value)
    return written


class _Record:
    __slots__ = ("func", "args", "kwargs", "outputs")

    def __init__(self, func, args, kwargs, outputs):
        self.func, self.args, self.kwargs, self.outputs = func, args, kwargs, outputs


class _CaptureMode(TorchDispatchMode):
    """Records each dispatched op; keeps the memory that existed before the capture unchanged."""

    def __init__(self):
        super().__init__()
        self.records: list[_Record] = []
        self.owned: set[int] = set()  # storages the capture allocated (the graph's pool)
        self.saved: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # first value of written old memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _HOST_READ and args[0].device.type == "npu":
            raise RuntimeError(
                "operation not permitted when stream is capturing: a host read (.item(), .tolist(), bool()) of "
                f"a tensor on {args[0].device} inside an NPUGraph capture; move it out of the captured region"
            )
        if func.namespace == "profiler":  # record_function markers: host bookkeeping, not device work
            return func(*args, **kwargs)
        for t in _written_args(func, args, kwargs):
            self._save_before_write(t)
        out = func(*args, **kwargs)
        outputs = _returns(func, out)
        for value, aliased in outputs:
            if not aliased:
                self.owned.update(_storage_key(t) for t in _tensors(value))
        self.records.append(_Record(func, args, kwargs, outputs))
        return out

    def _save_before_write(self, t: torch.Tensor) -> None:
        if _storage_key(t) in self.owned:
            return
        m = values_of(t)
        key = (m.data_ptr(), tuple(m.shape), m.stride(), m.dtype)
        if key not in self.saved:
            with torch.no_grad():
                self.saved[key] = (t, t.clone())

    def restore(self) -> None:
        """Puts back what the capture wrote into memory that existed before it (latest write first)."""
        with torch.no_grad():
            for t, before in reversed(list(self.saved.values())):
                t.copy_(before)
        self.saved.clear()


class NPUGraph:
    """A captured sequence of work on the emulated NPU, replayed on its static tensors."""

    def __init__(self):
        self._records: list[_Record] | None = None
        self._mode: _CaptureMode | None = None
        self._pool: tuple[int, int] | None = None

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        global _capturing
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise RuntimeError(f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, "
                               f"got {capture_error_mode!r}")
        if self._records is not None or self._mode is not None:
            raise RuntimeError("This NPUGraph instance already owns a captured graph. To capture a new graph, "
                               "create a new instance (or call reset() first).")
        if _capturing is not None:
            raise RuntimeError("another NPUGraph capture is under way: only one capture at a time")
        self._pool = tuple(pool) if pool is not None else graph_pool_handle()
        self._mode = _CaptureMode()
        self._mode.__enter__()
        _capturing = self

    def capture_end(self) -> None:
        global _capturing
        if self._mode is None or _capturing is not self:
            raise RuntimeError("NPUGraph.capture_end() without a capture_begin() on this graph")
        mode, self._mode = self._mode, None
        _capturing = None
        mode.__exit__(None, None, None)
        mode.restore()
        self._records = mode.records

    def replay(self) -> None:
        if self._records is None:
            raise RuntimeError("Called NPUGraph::replay without a preceding successful capture.")
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for rec in self._records:
                out = rec.func(*rec.args, **rec.kwargs)
                for (captured, aliased), (new, _) in zip(rec.outputs, _returns(rec.func, out)):
                    if aliased:
                        continue
                    for dst, src in zip(_tensors(captured), _tensors(new)):
                        if not _same_memory(dst, src):
                            dst.copy_(src)

    def reset(self) -> None:
        if self._mode is not None:
            raise RuntimeError("NPUGraph.reset() during its own capture")
        self._records = None

    def pool(self) -> tuple[int, int]:
        if self._pool is None or self._records is None:
            raise RuntimeError("Called NPUGraph::pool() without a preceding successful capture.")
        return self._pool

    @property
    def num_ops(self) -> int:
        """Emulation only: how many ATen ops the capture recorded (what replay re-runs)."""
        return 0 if self._records is None else len(self._records)


class graph:
    """Context manager capturing its body into `npu_graph` (torch_npu.npu.graph)."""

    default_capture_stream = None

    def __init__(self, npu_graph: NPUGraph, pool=None, stream=None, auto_dispatch_capture: bool = False,
                 capture_error_mode: str = "global"):
        if auto_dispatch_capture:
            raise NotImplementedError("torch.npu.graph(auto_dispatch_capture=True) (NPUGraph.update of FA/IFA "
                                      "arguments) is not emulated by trainbridge")
        self.npu_graph = npu_graph
        self.pool = pool
        self.capture_stream = stream
        self.capture_error_mode = capture_error_mode

    def __enter__(self):
        self.npu_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, exc_type, exc_value, traceback):
        self.npu_graph.capture_end()
        return None
