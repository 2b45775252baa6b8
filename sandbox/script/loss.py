"""Where a script-mode step's loss comes from (runs INSIDE the child; sandbox/script/hooks.py asks at each boundary).

1. **backward**: the scalars `backward()` was called on in the step, summed over gradient
   accumulation. A scalar that a `GradScaler.scale(loss)` call returned counts as the `loss` it
   scaled (source `backward-unscaled`): mixed-precision scripts back-propagate `loss * 65536`.
2. **pattern**: the last line of the program's output (stdout or stderr: `print` and `logging`)
   in the step that matches `loss_pattern` of trainbridge.toml, its `(?P<loss>...)` group. The
   default pattern reads `loss 1.234`, `loss: 1.234` and `loss=1.234`. It is the fallback when
   `backward()` saw no scalar in the step (`torch.autograd.backward` on per-sample losses with
   weights, say), and the source of every step when the toml sets a pattern of its own: the
   user's word that the program logs its loss differently from what it back-propagates.

Each step records its source; the closing result counts them (`loss_sources` in the run's
`extra["script"]`), so a measurement says where its losses came from.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from typing import Any

MAX_PENDING_SCALED = 16  # scale() outputs kept for a backward still to come


class OutputWatch:
    """A stream that passes every write through and keeps the last `loss_pattern` match of each step."""

    def __init__(self, stream: Any, watcher: "LoggedLoss"):
        self._stream, self._watcher, self._partial = stream, watcher, ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._partial += text
        if "\n" in self._partial:
            *lines, self._partial = self._partial.split("\n")
            for line in lines:
                self._watcher.read_line(line)
        return written

    def __getattr__(self, name: str) -> Any:  # flush, fileno, buffer, isatty, encoding, ...
        return getattr(self._stream, name)


class LoggedLoss:
    """The loss the program prints, per step (see the module doc)."""

    def __init__(self, pattern: str, *, preferred: bool):
        self.pattern, self.preferred = re.compile(pattern), preferred
        self.last: float | None = None

    def install(self) -> "LoggedLoss":
        sys.stdout, sys.stderr = OutputWatch(sys.stdout, self), OutputWatch(sys.stderr, self)
        return self

    def read_line(self, line: str) -> None:
        match = None
        for match in self.pattern.finditer(line):
            pass
        if match is not None:
            try:
                self.last = float(match.group("loss"))
            except (IndexError, ValueError):
                pass

    def take(self) -> float | None:
        """The last match since the previous call (None: the step printed no loss)."""
        value, self.last = self.last, None
        return value


class LossSources:
    """Picks each step's loss and counts where it came from."""

    def __init__(self, logged: LoggedLoss | None):
        self.logged = logged
        self.counts: Counter = Counter()
        self.scaled: dict[int, tuple[Any, Any]] = {}  # id(scaled output) -> (scaled output, the loss it scaled)

    def note_scaled(self, scaled: Any, original: Any) -> None:
        self.scaled[id(scaled)] = (scaled, original)

    def step_loss(self, parts: list[Any], values: list[Any] | None = None) -> float:
        """The step's loss from the scalars backward was called on (`parts`; `values`: their copies taken when backward
        was called, since a script may all-reduce the tensor in place for its log afterwards) and what the step printed."""
        import torch

        logged = self.logged.take() if self.logged is not None else None
        # the next step's scale(loss) already ran when this boundary fires (before its backward): keep what is not used
        scaled = {key: self.scaled.pop(key) for key in [id(p) for p in parts] if key in self.scaled}
        for key in list(self.scaled)[:-MAX_PENDING_SCALED]:
            del self.scaled[key]
        if logged is not None and self.logged.preferred:
            return self._count("pattern", logged)
        if parts:
            values = parts if values is None else values
            unscaled = [scaled[id(p)][1] if id(p) in scaled and scaled[id(p)][0] is p else v for p, v in zip(parts, values)]
            total = torch.stack([p.detach().float().reshape(()).cpu() for p in unscaled]).sum()
            source = "backward-unscaled" if any(u is not p for u, p in zip(unscaled, parts)) else "backward"
            return self._count(source, float(total.item()))
        if logged is not None:
            return self._count("pattern", logged)
        return self._count("none", math.nan)

    def _count(self, source: str, value: float) -> float:
        self.counts[source] += 1
        return value

    def summary(self) -> dict[str, int]:
        return dict(self.counts)


def install_scaler_hook(sources: LossSources) -> None:
    """Remember what each `GradScaler.scale(loss)` returned (torch.amp's scaler and its cuda subclass)."""
    from torch.amp.grad_scaler import GradScaler

    original = GradScaler.scale

    def scale(self, outputs):
        out = original(self, outputs)
        if out is not outputs and hasattr(out, "numel") and hasattr(outputs, "numel") and out.numel() == 1:
            sources.note_scaled(out, outputs)
        return out

    scale.__doc__ = original.__doc__
    GradScaler.scale = scale
