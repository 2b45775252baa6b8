"""torch_npu.npu stand-in: the device module of the emulated NPU (which is the CPU).

Device queries answer for one emulated device (TRAINBRIDGE_EMULATED_NPU_COUNT overrides the count,
read at call time, for multi-process runs); synchronisation is a no-op (CPU ops are synchronous);
memory statistics are the process's resident memory (psutil / /proc), since tensors live in host
memory; seeds and RNG state are the emulated NPU generator's (torch_npu._generator); graph capture
and replay (NPUGraph, graph) are in .graphs, make_graphed_callables in .graphed_callables.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
import types
from typing import Any

import torch

from . import amp, config

__all__ = [
    "is_available", "is_initialized", "init", "device_count", "current_device", "set_device", "synchronize",
    "get_device_name", "get_device_properties", "get_device_capability", "mem_get_info", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached",
    "memory_stats", "memory_summary", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "reset_accumulated_memory_stats", "empty_cache", "manual_seed", "manual_seed_all", "seed", "seed_all",
    "initial_seed", "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "is_bf16_supported", "get_amp_supported_dtype", "device", "device_of", "Stream", "Event", "stream",
    "current_stream", "default_stream", "set_stream", "amp", "config", "set_compile_mode", "is_jit_compile_false",
    "get_npu_overflow_flag", "clear_npu_overflow_flag", "NPUGraph", "graph", "graph_pool_handle",
    "is_current_stream_capturing", "make_graphed_callables",
]

from ._state import _index, current_index, device_count, set_current
from .graphed_callables import make_graphed_callables
from .graphs import NPUGraph, graph, graph_pool_handle, is_current_stream_capturing
from .._generator import all_generators, default_generator


_initialized = True  # torch.utils.checkpoint saves device RNG states only for an initialised device module


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    return None


def _is_in_bad_fork() -> bool:
    return False


def current_device() -> int:
    return current_index()


def set_device(device: Any) -> None:
    set_current(_index(device))


def synchronize(device: Any = None) -> None:
    _index(device)


def get_device_name(device: Any = None) -> str:
    _index(device)
    return "Emulated NPU (trainbridge, CPU)"


def get_device_capability(device: Any = None) -> tuple[int, int]:
    _index(device)
    return (0, 0)


def get_device_properties(device: Any = None) -> types.SimpleNamespace:
    _index(device)
    return types.SimpleNamespace(name=get_device_name(device), total_memory=_host_memory()[1],
                                 multi_processor_count=os.cpu_count() or 1)


def is_bf16_supported() -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


# --- memory: host memory of this process ------------------------------------------------------


def _rss() -> int:
    try:
        import psutil
    except ImportError:  # the child's interpreter may lack psutil: read /proc, else the peak
        try:
            with open("/proc/self/statm", encoding="ascii") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return _peak_rss()
    return int(psutil.Process().memory_info().rss)


def _peak_rss() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def mem_get_info(device: Any = None) -> tuple[int, int]:
    _index(device)
    return _host_memory()


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    try:
        import psutil
    except ImportError:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def memory_allocated(device: Any = None) -> int:
    _index(device)
    return _rss()


def max_memory_allocated(device: Any = None) -> int:
    _index(device)
    return _peak_rss()


memory_reserved = memory_allocated
max_memory_reserved = max_memory_allocated
memory_cached = memory_allocated
max_memory_cached = max_memory_allocated


def reset_peak_memory_stats(device: Any = None) -> None:
    """Resets the peak resident size (Linux: writes 5 to /proc/self/clear_refs); else a no-op."""
    _index(device)
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")


reset_max_memory_allocated = reset_peak_memory_stats


def reset_accumulated_memory_stats(device: Any = None) -> None:
    _index(device)


def memory_stats(device: Any = None) -> dict[str, int]:
    cur, peak = memory_allocated(device), max_memory_allocated(device)
    return {
        "allocated_bytes.all.current": cur,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": cur,
        "reserved_bytes.all.peak": peak,
    }


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    stats = memory_stats(device)
    return "Emulated NPU memory (host RSS of this process)\n" + "\n".join(f"{k}: {v}" for k, v in stats.items())


def empty_cache() -> None:
    return None


# --- RNG: the emulated NPU generator (see torch_npu._generator) ------------------------------
# Fused ops that draw random bits (npu_fusion_attention dropout, _npu_dropout_gen_mask) take
# (seed, offset) from it. Ordinary random ops on the emulated device run on the CPU and draw from
# the host generator, so manual_seed also seeds the host generator (the emulated device's own
# stream for those ops); it never advances either.


def _gen(device: Any = None):
    return default_generator(_index(device))


def manual_seed(seed: int) -> None:
    _gen().manual_seed(int(seed))
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: that calls back into us


def manual_seed_all(seed: int) -> None:
    for gen in all_generators(device_count()):
        gen.manual_seed(int(seed))
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    _gen().seed()


def seed_all() -> None:
    s = _gen().seed()
    for gen in all_generators(device_count()):
        gen.manual_seed(s)


def initial_seed() -> int:
    return _gen().initial_seed()


def get_rng_state(device: Any = "npu") -> torch.Tensor:
    return _gen(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    _gen(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in all_generators(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for gen, state in zip(all_generators(device_count()), new_states):
        gen.set_state(state)


# --- device context, streams, events -----------------------------------------------------------


class device:
    """Context manager selecting the current emulated device."""

    def __init__(self, device: Any):
        self.idx = _index(device) if device is not None else None
        self.prev = None

    def __enter__(self):
        self.prev = current_index()
        if self.idx is not None:
            set_current(self.idx)
        return self

    def __exit__(self, *exc):
        set_current(self.prev)
        return False


class device_of(device):
    def __init__(self, obj: torch.Tensor):
        super().__init__(None)


class Stream:
    """A CPU 'stream': work is already complete when it is queued."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs):
        self.device_index = _index(device)
        self.priority = priority

    @property
    def device(self) -> torch.device:
        return torch.device("npu", self.device_index)

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: "Stream") -> None:
        return None

    def wait_event(self, event: "Event") -> None:
        return None

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event


_default_stream: Stream | None = None


def default_stream(device: Any = None) -> Stream:
    global _default_stream
    if _default_stream is None:
        _default_stream = Stream(device)
    return _default_stream


def current_stream(device: Any = None) -> Stream:
    return default_stream(device)


def set_stream(stream: Stream) -> None:
    return None


@contextlib.contextmanager
def stream(stream: Stream | None):
    yield stream


class Event:
    """Wall-clock event; elapsed_time in milliseconds like torch.npu.Event(enable_timing=True)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: "Event") -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Events must be created with enable_timing=True to measure elapsed time")
        if self._t is None or end_event._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end_event._t - self._t) * 1000.0


# --- compile mode, overflow flag --------------------------------------------------------------

_jit_compile = False  # torch_npu's default for A2/A3 binaries (binary kernels, no online compile)


def set_compile_mode(jit_compile: bool = True) -> None:
    """Recorded only: the emulation runs every op eagerly on the CPU either way."""
    global _jit_compile
    if not isinstance(jit_compile, bool):
        raise TypeError(f"set_compile_mode: jit_compile must be a bool, got {type(jit_compile).__name__}")
    _jit_compile = jit_compile


def is_jit_compile_false() -> bool:
    return not _jit_compile


def get_npu_overflow_flag() -> bool:
    return False


def clear_npu_overflow_flag() -> None:
    return None
