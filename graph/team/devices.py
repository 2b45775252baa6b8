"""Gate slots: `--devices cpu:2`, `cuda:0,1`, `npu:0-7`.

A slot is where one gate runs: one device (both arms of its A/B on it) and a share of the host's
cores that no other slot uses, so that gates judged at once do not disturb each other's timing.
`cpu:N` means N slots of pinned cores; `cuda:`/`npu:` list device indices (ranges and commas), and
the host's cores are split among them. A gate's process sees only its device: CUDA_VISIBLE_DEVICES
or ASCEND_RT_VISIBLE_DEVICES holds that one index, so the program's `cuda`/`npu` device is it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
SYNTAX = "cpu:N (N slots of pinned cores), cuda:0,1 or npu:0-7 (device indices: commas and ranges)"
_SPEC = re.compile(r"^(cpu|cuda|npu):([0-9][0-9,\-]*)$")


@dataclass(frozen=True)
class Slot:
    index: int  # 0..n-1 within this host
    kind: str  # cpu, cuda, npu
    device: int | None  # the device index on the host (None for cpu slots)
    cores: tuple[int, ...]  # host cores this slot's processes are pinned to

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.device}" if self.device is not None else f"cpu-slot{self.index}"

    def env(self) -> dict[str, str]:
        """Environment of the gate's process: only this slot's device is visible."""
        name = VISIBLE_DEVICES.get(self.kind)
        return {name: str(self.device)} if name and self.device is not None else {}


def parse_devices(spec: str) -> tuple[str, list[int]]:
    """(kind, indices) of a --devices value; for cpu:N the indices are 0..N-1. Raises ValueError."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise ValueError(f"--devices {spec!r}: expected {SYNTAX}")
    kind, body = match.groups()
    if kind == "cpu":
        if not body.isdigit() or int(body) < 1:
            raise ValueError(f"--devices {spec!r}: cpu takes a count of slots (cpu:2), not a list")
        return kind, list(range(int(body)))
    indices: list[int] = []
    for part in body.split(","):
        if re.fullmatch(r"\d+", part):
            indices.append(int(part))
        elif re.fullmatch(r"\d+-\d+", part):
            low, high = (int(x) for x in part.split("-"))
            if high < low:
                raise ValueError(f"--devices {spec!r}: range {part} runs backwards")
            indices.extend(range(low, high + 1))
        else:
            raise ValueError(f"--devices {spec!r}: cannot read {part!r}; expected {SYNTAX}")
    if len(set(indices)) != len(indices):
        raise ValueError(f"--devices {spec!r} names a device twice")
    return kind, indices


def slot_count(spec: str | None) -> int:
    return len(parse_devices(spec)[1]) if spec else 1


def parallel_gates(config) -> bool:
    """True when a run (its RunConfig) judges candidates side by side: the graph's batch path (graph/team/fanout.py)."""
    return config.ray is not None or slot_count(config.devices) > 1


def host_slots(spec: str, *, target: str, cores: list[int] | None = None) -> list[Slot]:
    """The slots of `spec` on this host, each with its own cores. Raises ValueError when the spec does
    not fit the target or the host (more slots than cores)."""
    kind, indices = parse_devices(spec)
    if kind != target:
        raise ValueError(f"--devices {spec!r} does not fit --target {target}: give {target}:... "
                         f"({'cpu:N' if target == 'cpu' else target + ':0,1'})")
    available = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(indices) > len(available):
        raise ValueError(f"--devices {spec!r} asks for {len(indices)} slots but this process may use {len(available)} "
                         f"core(s) ({available}): each slot needs a core of its own")
    share = len(available) // len(indices)
    return [Slot(index=i, kind=kind, device=None if kind == "cpu" else device,
                 cores=tuple(available[i * share:(i + 1) * share]))
            for i, device in enumerate(indices)]
