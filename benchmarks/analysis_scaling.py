"""Analyst wall time against model depth: copies of the llama example with 2, 4, 8, 16 layers.

Each copy changes only `n_layers` in its model.py; `analyze_repo` runs on it with the
torch.compile reference (the loop's first analysis), and every phase is timed (static scan, eager
profile, compile reference, advisor rules, alignment). `linearity` fits time = a + b * depth by
least squares per phase and compares the cost of each added layer between consecutive depths: if
those increments stay within a factor of 1.5 of each other (and the fit explains >= 98% of the
variance), growth is called linear.

    .venv/bin/python benchmarks/analysis_scaling.py --depths 2 4 8 16
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LLAMA = EXAMPLES / "llama_pretrain"
_DEPTH = re.compile(r"^([ \t]*n_layers: int = )\d+[ \t]*$", re.M)
Say = Callable[[str], None]


def llama_at_depth(dest: Path, depth: int, source: Path = LLAMA) -> Path:
    """A copy of the llama example whose model has `depth` decoder layers."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    model = dest / "model.py"
    text, count = _DEPTH.subn(rf"\g<1>{depth}", model.read_text(encoding="utf-8"))
    if count != 1:
        raise SystemExit(f"{source / 'model.py'} must have one line 'n_layers: int = N' (LlamaConfig) to vary the depth")
    model.write_text(text, encoding="utf-8")
    return dest


def time_analysis(repo: Path, depth: int, *, compile_reference: bool = True) -> dict[str, Any]:
    from trainbridge.agents.analyst.analyze import analyze_repo
    from trainbridge.sandbox.workload import load_workload

    started = time.monotonic()
    analysis = analyze_repo(load_workload(repo), backend="cpu", compile_reference=compile_reference)
    wall = time.monotonic() - started
    kernels = analysis.reference.kernels_per_step if analysis.reference else {}
    return {"depth": depth, "wall_s": wall, "phases": dict(analysis.phase_seconds), "intents": len(analysis.intents),
            "eager_ops_per_step": analysis.eager_ops_per_step, "reference_kernels_per_step": dict(kernels)}


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares y = intercept + slope * x, with R^2 (1.0 when y does not vary)."""
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


def linearity(depths: Sequence[int], seconds: Sequence[float]) -> dict[str, Any]:
    """Fit and per-layer increments between consecutive depths, with a one-word verdict."""
    pairs = sorted(zip(depths, seconds))
    xs, ys = [float(d) for d, _ in pairs], [s for _, s in pairs]
    fit = fit_line(xs, ys)
    increments = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
    positive = [x for x in increments if x > 0]
    if len(xs) < 3:
        verdict = "undetermined (needs three depths)"
    elif len(positive) < len(increments):
        verdict = "not growing with depth"
    elif max(positive) <= 1.5 * min(positive) and fit["r2"] >= 0.98:
        verdict = "linear"
    elif increments[-1] > 1.5 * increments[0]:
        verdict = "superlinear"
    elif increments[0] > 1.5 * increments[-1]:
        verdict = "sublinear"
    else:
        verdict = "roughly linear (noisy)"
    return {**fit, "per_layer_increments_s": increments, "verdict": verdict}


def measure(depths: Sequence[int], *, compile_reference: bool = True, say: Say = print) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="tb-analysis-scaling-") as tmp:
        for depth in depths:
            repo = llama_at_depth(Path(tmp) / f"llama_{depth}", depth)
            say(f"  analysing llama with {depth} layer(s)")
            row = time_analysis(repo, depth, compile_reference=compile_reference)
            say(f"    {row['wall_s']:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in row["phases"].items()))
            rows.append(row)
    phases = sorted({k for r in rows for k in r["phases"]})
    fits = {"total": linearity([r["depth"] for r in rows], [r["wall_s"] for r in rows])} if len(rows) >= 2 else {}
    if len(rows) >= 2:
        for phase in phases:
            fits[phase] = linearity([r["depth"] for r in rows], [r["phases"].get(phase, 0.0) for r in rows])
    return {"depths": list(depths), "compile_reference": compile_reference, "rows": rows, "fits": fits}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--no-reference", action="store_true", help="skip the torch.compile reference")
    args = parser.parse_args(argv)
    result = measure(args.depths, compile_reference=not args.no_reference, say=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result["fits"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
