"""Script mode's seeds: every seeding call of the script under the gate's seed (runs INSIDE the sandbox child).

`torch.manual_seed`, `torch.cuda.manual_seed(_all)`, `torch.npu.manual_seed(_all)` (once torch_npu is imported),
`random.seed`, `numpy.random.seed` and `numpy.random.default_rng` are wrapped before the script runs (library seeders
such as transformers' and accelerate's `set_seed` and Lightning's `seed_everything` call these): each call the script makes gets a
seed derived from the gate's seed and the script's own value (`derive_seed`), so runs with the same
gate seed see the same data order and a candidate cannot know its seed in advance; two seeds the
script keeps apart (`1337 + rank`) stay apart. A call without a value (`random.seed()`) gets one
derived from the gate's seed too, not the clock. Not covered: generators the script makes and
seeds itself (`random.Random(s)`, `torch.Generator().manual_seed(s)`): their seeds are fixed by
the script, so they are repeatable but not under the gate's control.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SEED_BOUND = 2**63 - 1
NUMPY_SEED_BOUND = 2**32


def derive_seed(gate_seed: int, value: Any, bound: int = SEED_BOUND) -> int:
    """The seed a script's seeding call gets: a function of the gate's seed and the script's value only."""
    digest = hashlib.sha256(f"{int(gate_seed)}:{value!r}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % bound


@dataclass
class SeedControl:
    """Wraps the seeding functions; `calls` records (function, the script's value, the seed it got)."""

    gate_seed: int
    calls: list[tuple[str, str, int]] = field(default_factory=list)
    originals: dict[str, Callable] = field(default_factory=dict)
    inside: bool = False

    def install(self) -> "SeedControl":
        import random

        import torch

        self._wrap(torch, "manual_seed", "torch.manual_seed", SEED_BOUND)
        self._wrap(torch.random, "manual_seed", "torch.manual_seed", SEED_BOUND, original=self.originals["torch.manual_seed"])
        for name in ("manual_seed", "manual_seed_all"):
            if hasattr(torch.cuda, name):
                self._wrap(torch.cuda, name, f"torch.cuda.{name}", SEED_BOUND)
        npu = getattr(torch, "npu", None)  # torch_npu's, once imported (the npu backend imports it before the script runs):
        for name in ("manual_seed", "manual_seed_all"):  # library seeders (transformers', accelerate's set_seed) call it too
            if npu is not None and hasattr(npu, name):
                self._wrap(npu, name, f"torch.npu.{name}", SEED_BOUND)
        self._wrap(random, "seed", "random.seed", SEED_BOUND, keep_none=True)
        try:
            import numpy
        except ImportError:
            return self
        self._wrap(numpy.random, "seed", "numpy.random.seed", NUMPY_SEED_BOUND, keep_none=True)
        self._wrap(numpy.random, "default_rng", "numpy.random.default_rng", SEED_BOUND, keep_none=True)
        return self

    def seed_everything(self) -> None:
        """Seed every generator with the gate's seed itself (for scripts that never seed)."""
        self.inside = True
        try:
            self.originals["torch.manual_seed"](self.gate_seed % SEED_BOUND)
            self.originals["random.seed"](self.gate_seed)
            if "numpy.random.seed" in self.originals:
                self.originals["numpy.random.seed"](self.gate_seed % NUMPY_SEED_BOUND)
        finally:
            self.inside = False

    def _wrap(self, owner, attribute: str, label: str, bound: int, *, keep_none: bool = False, original=None) -> None:
        original = original or getattr(owner, attribute)
        self.originals.setdefault(label, original)
        control = self

        def seeded(seed=None, *args, **kwargs):
            if control.inside:  # torch.manual_seed seeds CUDA through torch.cuda.manual_seed_all: already derived
                return original(seed, *args, **kwargs)
            if seed is None and keep_none:  # `random.seed()` / `default_rng()`: the gate's seed, not the clock
                derived = derive_seed(control.gate_seed, "unseeded", bound)
            else:
                derived = derive_seed(control.gate_seed, seed, bound)
            control.calls.append((label, repr(seed)[:80], derived))
            control.inside = True
            try:
                return original(derived, *args, **kwargs)
            finally:
                control.inside = False

        seeded.__name__ = getattr(original, "__name__", attribute)
        seeded.__doc__ = getattr(original, "__doc__", None)
        setattr(owner, attribute, seeded)
