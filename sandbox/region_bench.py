"""The region lab's child: time one rewritten region alone, baseline vs candidate, inside the sandbox.

Runs as ``python -m trainbridge.sandbox.region_bench REQUEST.json`` (started by
agents/profiler/region_lab.py with the gate's confinement: scrubbed environment, memory cap, own
process group, timeout kill, no network where the host allows). The request names both roots, their
entries and the sites; the request file is deleted before any workload code runs.

In one child:

1. the baseline's parts are built (sandbox/harness.py `load_parts`) and one training step runs with a
   profile hook on the region's code object that records the first call's real arguments (tensors
   cloned, `requires_grad` as they were); for a method, the instance's path in the model
   (`named_modules`) is kept so the candidate's twin instance is found by the same path;
2. the baseline's modules (those whose files lie under its root) move out of `sys.modules`, and the
   candidate's parts are built from its own root (the two roots hold modules of the same names);
3. baseline region and candidate region run forward + backward (sum of the outputs' float values)
   on the captured inputs, interleaved A B B A ..., until a time budget or a repetition cap; the
   result has the medians per side, the median of the per-repetition ratios B/A and an
   order-statistic interval on it (every sample is kept); both regions' outputs on those inputs are
   compared once (only a region seen to compute the same may be skipped).

Finding the region and capturing its inputs: sandbox/region_capture.py. A region that cannot be
isolated (no function known, not found, not called in the step, another signature in the candidate)
comes back as ``{"unisolated": "why"}``, never as an exception.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from trainbridge.sandbox.region_capture import (Unisolated, arg_names, capture_call, clone, forget_modules, module_of,
                                                 qualname_for, resolve, shapes_of, twin_args)

WARMUP_CALLS = 3


def build_call(function, code, args: dict[str, Any], self_value=None):
    """`prepare() -> run` pairs: `prepare` (untimed) clones the captured arguments (an in-place edit of an
    input never reaches the next repetition), `run()` calls `function` on them, with `self_value` in place
    of the recorded `self`."""
    positional, keyword, star, starstar = arg_names(code)

    def prepare():
        values = {name: clone(value) for name, value in args.items()}
        if self_value is not None:
            values[positional[0]] = self_value
        head = [values[name] for name in positional if name in values]
        head += list(values.get(star, ())) if star else []
        kwargs = {name: values[name] for name in keyword if name in values}
        kwargs.update(values.get(starstar, {}) if starstar else {})
        return lambda: function(*head, **kwargs)

    return prepare


def fwd_bwd(run, backward: bool = True) -> None:
    """Forward, then (when `backward`) backward of the sum of the outputs that carry a gradient."""
    import torch

    out = run()
    tensors = [t for t in _flatten(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors and backward:
        loss = sum(t.float().sum() for t in tensors)
        loss.backward()


def needs_backward(prepare) -> bool:
    """False for a region that runs its own backward (a train_step returning its loss): a second backward
    through its freed graph would fail, and its timing already holds the backward pass."""
    try:
        fwd_bwd(prepare())
    except RuntimeError as exc:
        if "backward through the graph a second time" not in str(exc):
            raise
        fwd_bwd(prepare(), backward=False)
        return False
    return True


def _flatten(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item)
    else:
        yield value


def time_pair(call_a, call_b, sync, *, budget_s: float, max_reps: int, min_reps: int) -> tuple[list[float], list[float]]:
    """Interleaved A B B A ... timings (s) of forward + backward, until `budget_s` or `max_reps` per side."""
    backward = needs_backward(call_a) and needs_backward(call_b)
    for _ in range(WARMUP_CALLS - 1):
        fwd_bwd(call_a(), backward)
        fwd_bwd(call_b(), backward)
    times_a: list[float] = []
    times_b: list[float] = []
    deadline = time.monotonic() + budget_s
    rep = 0
    while len(times_a) < max_reps and (len(times_a) < min_reps or time.monotonic() < deadline):
        order = ((call_a, times_a), (call_b, times_b)) if rep % 2 == 0 else ((call_b, times_b), (call_a, times_a))
        for prepare, times in order:
            run = prepare()
            sync()
            started = time.perf_counter()
            fwd_bwd(run, backward)
            sync()
            times.append(time.perf_counter() - started)
        rep += 1
    return times_a, times_b


def outputs_match(prepare_a, prepare_b, reseed, *, rtol: float = 1e-3, atol: float = 1e-5) -> bool | None:
    """Whether both regions give the same outputs on the captured inputs, each run after `reseed()` (None: not
    comparable: no tensor output, or the region cannot run without gradients). Only a region known to compute
    the same is ever skipped: one whose math differs goes to the gate, whose numerics check names the fault."""
    import torch

    outputs = []
    for prepare in (prepare_a, prepare_b):
        reseed()
        try:
            with torch.no_grad():
                outputs.append([t for t in _flatten(prepare()()) if isinstance(t, torch.Tensor)])
        except RuntimeError:
            return None
    out_a, out_b = outputs
    if not out_a:
        return None
    return len(out_a) == len(out_b) and all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)
                                            for a, b in zip(out_a, out_b))


def paired_ratios(times_a: list[float], times_b: list[float]) -> list[float]:
    """B/A per repetition: the two sides of a repetition ran back to back, so a busy phase of the machine
    slows both and cancels out of their ratio."""
    return [b / a for a, b in zip(times_a, times_b) if a > 0]


def median_interval(values: list[float], *, level: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval on the median: the order statistics (k, n + 1 - k) whose binomial
    coverage is at least `level` (the whole range when n is too small)."""
    ordered = sorted(values)
    n = len(ordered)
    tail, cumulative, k = (1 - level) / 2, 0.0, 0
    while k < n and cumulative + math.comb(n, k) / 2**n <= tail:
        cumulative += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)  # 1-based: ordered[k - 1] .. ordered[n - k]
    return ordered[k - 1], ordered[n - k]


def _region_side(root: Path, site: dict[str, Any], qualname: str):
    module = module_of(root, site["file"])
    return resolve(module, qualname)


def measure(request: dict[str, Any]) -> dict[str, Any]:
    """Build both sides, capture the region's inputs from one baseline step, time both regions."""
    import torch

    from trainbridge.sandbox.backends import Backend
    from trainbridge.sandbox.harness import load_parts, seed_everything

    backend = Backend(request["backend"])
    backend.prepare()
    torch.set_num_threads(int(request["threads"]))  # the lab may ask fewer than the workload's (see region_lab.py)
    seed = int(request["seed"])
    base_root, cand_root = Path(request["baseline"]["root"]), Path(request["candidate"]["root"])
    skipped: list[str] = []
    for site in request["sites"]:
        try:
            qualname = qualname_for(base_root / site["file"], site.get("function"), int(site["line_start"]))
            break
        except Unisolated as exc:
            skipped.append(f"{site['file']}:{site['line_start']}: {exc}")
    else:
        raise Unisolated("; ".join(skipped) or "the candidate names no site")

    def parts_of(side: dict[str, Any]) -> dict[str, Any]:
        root = Path(side["root"])
        for extra in side.get("pythonpath", []):
            sys.path.insert(0, str(root / extra))
        seed_everything(seed)
        return load_parts(root, side["entry"], backend.device, seed)

    base_parts = parts_of(request["baseline"])
    base_fn, base_owner = _region_side(base_root, site, qualname)
    seed_everything(seed)
    batch = base_parts["batch"](0)
    saved = {name: value.detach().clone() for name, value in base_parts["model"].state_dict().items()}
    captured = capture_call(base_fn.__code__,
                            lambda: base_parts["train_step"](base_parts["model"], base_parts["optimizer"], batch))
    base_parts["model"].load_state_dict(saved)  # the step's update undone: both models start equal for the output check
    args = captured["__frame_args__"]
    path = None
    if base_owner is not None:
        self_name = arg_names(base_fn.__code__)[0][:1]
        instance = captured.get(self_name[0]) if self_name else None
        paths = [name for name, module in base_parts["model"].named_modules() if module is instance]
        if not paths:
            raise Unisolated(f"{qualname} was called on an object that is not a submodule of the model")
        path = paths[0]
    forget_modules(base_root)
    for extra in request["baseline"].get("pythonpath", []):
        while str(base_root / extra) in sys.path:
            sys.path.remove(str(base_root / extra))
    cand_parts = parts_of(request["candidate"])
    cand_fn, cand_owner = _region_side(cand_root, site, qualname)
    if (base_owner is None) != (cand_owner is None):
        raise Unisolated(f"{qualname} is a method on one side and a function on the other")
    if arg_names(base_fn.__code__) != arg_names(cand_fn.__code__):
        raise Unisolated(f"{qualname}'s signature differs: {inspect.signature(base_fn)} vs {inspect.signature(cand_fn)}")
    base_self = cand_self = None
    if path is not None:
        base_self = base_parts["model"].get_submodule(path)
        try:
            cand_self = cand_parts["model"].get_submodule(path)
        except AttributeError as exc:
            raise Unisolated(f"the candidate's model has no submodule {path!r}") from exc
        if not isinstance(cand_self, cand_owner):
            raise Unisolated(f"the candidate's {path!r} is a {type(cand_self).__name__}, not a {cand_owner.__name__}")
    code = base_fn.__code__
    call_a = build_call(base_fn, code, args, base_self)
    call_b = build_call(cand_fn, cand_fn.__code__, twin_args(args, base_parts, cand_parts), cand_self)
    match = outputs_match(call_a, call_b, lambda: seed_everything(seed))
    times_a, times_b = time_pair(call_a, call_b, backend.sync, budget_s=float(request["budget_s"]),
                                 max_reps=int(request["max_reps"]), min_reps=int(request["min_reps"]))
    median_a, median_b = _median(times_a), _median(times_b)
    ratios = paired_ratios(times_a, times_b)
    low, high = median_interval(ratios)
    shapes = shapes_of(args)
    return {"site": site, "qualname": qualname, "module_path": path, "shapes": shapes, "reps": len(times_a),
            "baseline_median_s": median_a, "candidate_median_s": median_b, "ratio": _median(ratios),
            "interval": [low, high], "skipped_sites": skipped, "outputs_match": match, "baseline_times_s": times_a, "candidate_times_s": times_b}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainbridge.sandbox.region_bench REQUEST.json", file=sys.stderr)
        return 2
    from trainbridge.sandbox.harness import HarnessFailure, write_json_atomic

    request_path = Path(argv[0])
    request = json.loads(request_path.read_text(encoding="utf-8"))
    request_path.unlink()  # the workload runs in this process: it must not read what the lab asked
    try:
        result: dict[str, Any] = measure(request)
    except Unisolated as exc:
        result = {"unisolated": str(exc)}
    except HarnessFailure as exc:
        result = {"failure": {"kind": exc.kind, "message": exc.message[:2000]}}
    except BaseException as exc:  # the workload's own error: reported, never raised into the parent
        result = {"failure": {"kind": "exception", "message": f"{type(exc).__name__}: {exc}"[:2000],
                              "traceback_tail": "".join(traceback.format_exception(exc))[-3000:]}}
    write_json_atomic(Path(request["result_path"]), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
