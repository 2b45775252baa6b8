"""torch_npu.npu stand-in: the device module of the emulated NPU (which is the CPU).

Device queries answer for one emulated device (TRAINBRIDGE_EMULATED_NPU_COUNT overrides the count,
read at call time, for multi-process runs); synchronisation is a no-op (CPU ops are synchronous);
memory statistics are the process's resident memory (psutil / /proc), since tensors live in host
memory; seeds and RNG state are the CPU generator's.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
import types
from typing import Any

import torch

from . import amp

__all__ = [
    "is_available", "is_initialized", "init", "device_count", "current_device", "set_device", "synchronize",
    "get_device_name", "get_device_properties", "get_device_capability", "mem_get_info", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached",
    "memory_stats", "memory_summary", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "reset_accumulated_memory_stats", "empty_cache", "manual_seed", "manual_seed_all", "seed", "seed_all",
    "initial_seed", "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "is_bf16_supported", "get_amp_supported_dtype", "device", "device_of", "Stream", "Event", "stream",
    "current_stream", "default_stream", "set_stream", "amp",
]

_current = 0


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    return None


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    raw = os.environ.get("TRAINBRIDGE_EMULATED_NPU_COUNT", "1")
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"TRAINBRIDGE_EMULATED_NPU_COUNT must be a positive int, got {raw!r}") from None
    if count < 1:
        raise ValueError(f"TRAINBRIDGE_EMULATED_NPU_COUNT must be a positive int, got {raw!r}")
    return count


def _index(device: Any = None) -> int:
    if device is None:
        return _current
    if isinstance(device, str):
        kind, _, num = device.partition(":")
        if kind != "npu" or (num and not num.isdigit()):
            raise ValueError(f"expected an npu device such as 'npu' or 'npu:0', got {device!r}")
        index = int(num) if num else _current
    elif isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError(f"expected an npu device, got {device}")
        index = _current if device.index is None else device.index
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        raise TypeError(f"expected an npu device (int, 'npu:N' or torch.device), got {device!r}")
    if not 0 <= index < device_count():
        raise RuntimeError(f"Invalid device ordinal {index}: the emulated NPU has {device_count()} device(s)")
    return index


def current_device() -> int:
    return _current


def set_device(device: Any) -> None:
    global _current
    _current = _index(device)


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


# --- RNG: the CPU generator --------------------------------------------------------------------


def manual_seed(seed: int) -> None:
    # the CPU generator itself: torch.manual_seed calls torch.npu.manual_seed_all, so no call back into it
    torch.default_generator.manual_seed(int(seed))


manual_seed_all = manual_seed


def seed() -> None:
    torch.default_generator.seed()


seed_all = seed


def initial_seed() -> int:
    return torch.initial_seed()


def get_rng_state(device: Any = "npu") -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    torch.set_rng_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [torch.get_rng_state() for _ in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    if new_states:
        torch.set_rng_state(new_states[0])


# --- device context, streams, events -----------------------------------------------------------


class device:
    """Context manager selecting the current emulated device."""

    def __init__(self, device: Any):
        self.idx = _index(device) if device is not None else None
        self.prev = None

    def __enter__(self):
        global _current
        self.prev = _current
        if self.idx is not None:
            _current = self.idx
        return self

    def __exit__(self, *exc):
        global _current
        _current = self.prev
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
