"""What the harness relies on inside the child, remembered before the workload is imported (runs INSIDE the child).

Clocks, device synchronisation and the harness's own functions live in the same process as the code
under test, which can rebind any of them. The parent's clock makes such tricks useless for speed;
this record makes them visible: the closing message lists every name whose object was replaced
while the workload ran, and the gate names them in its verdict.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

CLOCKS = ("time.perf_counter", "time.perf_counter_ns", "time.monotonic", "time.monotonic_ns", "time.time", "time.time_ns",
          "time.process_time", "time.thread_time")
DEVICE = ("torch.cuda.synchronize", "torch.cuda.Event", "torch.Tensor.item", "torch.Tensor.backward", "torch.autograd.backward",
          "torch.set_num_threads", "torch.get_num_threads", "torch.manual_seed", "torch.npu.synchronize")
HARNESS_MODULES = ("trainbridge.sandbox.harness", "trainbridge.sandbox.child.step_server", "trainbridge.sandbox.child.channel",
                   "trainbridge.sandbox.numerics_probe", "trainbridge.sandbox.backends", "trainbridge.sandbox.guard",
                   "trainbridge.sandbox.script.hooks", "trainbridge.sandbox.script.overrides",  # these two: script mode
                   "trainbridge.sandbox.evidence")


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        value: Any = module
        for attribute in parts[cut:]:
            value = getattr(value, attribute, None)
            if value is None:
                return None
        return value
    return None


def _harness_names() -> list[str]:
    names = []
    for module_name in HARNESS_MODULES:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        names.append(module_name + ".time")  # a module's own `time` binding, where it has one
        for key, value in vars(module).items():
            if key.startswith("__"):
                continue
            if callable(value) and getattr(value, "__module__", None) == module_name:
                names.append(f"{module_name}.{key}")
                if isinstance(value, type):
                    names += [f"{module_name}.{key}.{attr}" for attr, member in vars(value).items()
                              if callable(member) and not attr.startswith("__")]
    return names


class Guard:
    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def capture(self) -> "Guard":
        """Remember the object behind every guarded name (call before importing the workload)."""
        for name in (*CLOCKS, *DEVICE, *_harness_names()):
            value = _resolve(name)
            if value is not None:
                self._seen[name] = id(value)
        return self

    def replaced(self) -> list[str]:
        """Names whose object is no longer the one captured (missing ones included)."""
        return sorted(name for name, ident in self._seen.items() if id(_resolve(name)) != ident)
