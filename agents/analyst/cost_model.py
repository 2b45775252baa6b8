"""Datasheet cost model: ESTIMATES of device time per eager op and of what fusing a region saves.

Per op (name and input shapes from the eager op table, tools/eager_profile.EagerOp):

    time = max(FLOPs / peak FLOP/s, bytes moved / HBM bandwidth) + launches x host launch overhead

with peaks, bandwidth and launch overhead from data/devices.yaml (each with its source, date and
confidence). An intent that K reference kernels can cover instead of N eager ops is estimated as
the same FLOPs in K kernels that each move at most the bytes of the region's largest op, and pay
K launches instead of N. Everything returned is labelled "estimate": datasheet arithmetic, not a
measurement, and never a speed-up. Only the profiler gate, on the device, measures.

Limits, on purpose: FLOPs are counted for matmul, convolution and attention ops from their shapes
and as one per output element for everything else; bytes are inputs plus one output the size of
the largest input (views move nothing); the dtype is one for the whole table (the op table records
no dtypes); a forward convolution's output size is assumed equal to its input's (stride 1: the
table records no strides); where a device publishes no peak for the dtype, only memory traffic
and launches are counted and the estimate says it is a lower bound.
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from trainbridge.records import Intent, IntentCategory, Phase

DEVICES_FILE = Path(__file__).resolve().parent / "data" / "devices.yaml"
BASIS = ("estimate from datasheet figures: per op max(FLOPs/peak, bytes/bandwidth) + launches x host launch "
         "overhead; not a measurement")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_METADATA_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "expand_as", "as_strided",
    "slice", "select", "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind", "narrow",
    "view_as", "view_as_real", "view_as_complex", "lift_fresh", "empty", "empty_like", "empty_strided", "numpy_T",
    "unflatten", "flatten", "movedim", "diagonal", "_to_copy_noop", "set_", "resize_",
})
_MATMUL_BIAS = {"addmm": 0, "baddbmm": 0, "addbmm": 0}  # name -> index of the bias argument
_CONV_FORWARD = {"convolution", "_convolution", "conv2d", "conv1d", "conv3d", "mkldnn_convolution", "cudnn_convolution",
                 "_slow_conv2d_forward", "thnn_conv2d", "miopen_convolution"}
_ATTENTION_FORWARD = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
                      "scaled_dot_product_attention", "npu_fusion_attention"}
_ATTENTION_BACKWARD_FACTOR = 2.5  # backward of attention: dQ, dK, dV and the recomputed scores


class Figure(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: float | None
    low: float | None = None
    high: float | None = None
    confidence: Literal["vendor", "reported", "assumption", "unknown"]
    source: str
    date: str
    checked: str
    note: str = ""


class DeviceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    name: str
    peak_flops: dict[str, Figure] = Field(description="dense FLOP/s per dtype")
    hbm_bandwidth: Figure = Field(description="bytes per second")
    launch_overhead_us: Figure = Field(description="host time per kernel launch")


class OpEstimate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: Literal["estimate"] = "estimate"
    name: str
    shapes: str
    flops: float
    bytes: float
    launches: int
    compute_us: float | None = Field(description="FLOPs / peak; None when the device publishes no peak for the dtype")
    memory_us: float
    launch_us: float
    time_us: float
    bound: Literal["compute", "memory", "launch", "none"]
    notes: list[str] = Field(default_factory=list)


class SavingEstimate(BaseModel):
    """What replacing N eager ops by K reference kernels would save per step on a device: an estimate."""

    model_config = ConfigDict(extra="forbid")

    label: Literal["estimate"] = "estimate"
    basis: str = BASIS
    device: str
    dtype: str
    eager_ops: float = Field(description="N per step")
    reference_kernels: int = Field(description="K")
    eager_us: float = Field(description="estimated device time of the N eager ops per step")
    fused_us: float = Field(description="estimated device time of K kernels doing the same work per step")
    saving_us: float = Field(ge=0, description="eager_us - fused_us, floored at 0")
    launch_saving_us: float = Field(description="the part of the saving that is launches removed")
    lower_bound: bool = Field(description="True when the device publishes no peak for the dtype (compute not counted)")
    figures: dict[str, str] = Field(description="the device figures used, with their confidence")
    notes: list[str] = Field(default_factory=list)


@functools.cache
def _load(path: str) -> dict[str, DeviceSpec]:
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return {key: DeviceSpec(key=key, **spec) for key, spec in data["devices"].items()}


def load_devices(path: Path | None = None) -> dict[str, DeviceSpec]:
    """Every device of the datasheet table, validated."""
    return dict(_load(str(path or DEVICES_FILE)))


def device_spec(name: str | DeviceSpec, path: Path | None = None) -> DeviceSpec:
    if isinstance(name, DeviceSpec):
        return name
    devices = load_devices(path)
    key = name.lower().replace(" ", "_").replace("-", "_").removeprefix("huawei_").removeprefix("nvidia_")
    key = {"910b": "ascend_910b", "910c": "ascend_910c"}.get(key, key)
    if key not in devices:
        raise KeyError(f"no device {name!r} in {DEVICES_FILE.name}: choose one of {', '.join(sorted(devices))}")
    return devices[key]


# --- one op -------------------------------------------------------------------------------------


def parse_shapes(shapes: str | Sequence[Any]) -> list[Any]:
    """'[[8, 64], [64], []]' -> [[8, 64], [64], []]; a tensor-list argument stays a list of shapes."""
    if isinstance(shapes, str):
        shapes = ast.literal_eval(shapes.strip() or "[]")
    return [list(s) for s in shapes]


def _is_shape(arg: Any) -> bool:
    return all(isinstance(d, int) for d in arg)


def _numel(arg: Any) -> int:
    if _is_shape(arg):
        return math.prod(arg) if arg else 0
    return sum(_numel(a) for a in arg)


def count_flops_and_bytes(name: str, shapes: str | Sequence[Any], elem_bytes: int) -> tuple[float, float, int, list[str]]:
    """(FLOPs, bytes, launches, notes) of one op from its name and input shapes."""
    op = name.split("::", 1)[-1].split(".", 1)[0]
    args = parse_shapes(shapes)
    tensors = [a for a in args if a]
    if op in _METADATA_OPS:
        return 0.0, 0.0, 0, []
    notes: list[str] = []
    in_elems = sum(_numel(a) for a in tensors)
    flops, out_elems = None, None
    shape_args = [a for a in args if _is_shape(a)]
    if op in ("mm", "addmm") and len(tensors) >= 2:
        a, b = tensors[-2], tensors[-1]
        if len(a) == 2 and len(b) == 2:
            flops, out_elems = 2.0 * a[0] * a[1] * b[1] + (a[0] * b[1] if op == "addmm" else 0), a[0] * b[1]
    elif op in ("bmm", "baddbmm") and len(tensors) >= 2:
        a, b = tensors[-2], tensors[-1]
        if len(a) == 3 and len(b) == 3:
            flops, out_elems = 2.0 * a[0] * a[1] * a[2] * b[2], a[0] * a[1] * b[2]
    elif op == "linear" and len(tensors) >= 2 and len(tensors[1]) == 2:
        x, w = tensors[0], tensors[1]
        rows = math.prod(x[:-1]) if len(x) > 1 else 1
        flops, out_elems = 2.0 * rows * w[0] * w[1], rows * w[0]
    elif op in _CONV_FORWARD and len(shape_args) >= 2 and len(shape_args[0]) >= 3:
        x, w = shape_args[0], shape_args[1]
        spatial = math.prod(x[2:])
        flops = 2.0 * x[0] * w[0] * spatial * math.prod(w[1:])
        out_elems = x[0] * w[0] * spatial
        notes.append("convolution output size assumed equal to its input's (stride 1): the op table records no strides")
    elif op == "convolution_backward" and len(shape_args) >= 3:
        grad_out, x, w = shape_args[0], shape_args[1], shape_args[2]
        flops = 2 * 2.0 * grad_out[0] * grad_out[1] * math.prod(grad_out[2:]) * math.prod(w[1:])
        out_elems = math.prod(x) + math.prod(w)
    elif op in _ATTENTION_FORWARD or "attention_backward" in op:
        q = next((a for a in shape_args if len(a) == 4), None)
        k = next((a for a in shape_args[1:] if len(a) == 4), q)
        if q is not None:
            flops = 4.0 * q[0] * q[1] * q[2] * k[2] * q[3]
            out_elems = math.prod(q)
            if "backward" in op:
                flops *= _ATTENTION_BACKWARD_FACTOR
                out_elems = 3 * math.prod(q)
    if flops is None:  # pointwise, reduction, copy, optimizer foreach ops: one FLOP per element of the output
        out_elems = max((_numel(a) for a in tensors), default=0)
        flops = float(out_elems)
    moved = float((in_elems + out_elems) * elem_bytes)
    return flops, moved, 1, notes


def estimate_op(name: str, shapes: str | Sequence[Any], device: str | DeviceSpec, dtype: str = "float32") -> OpEstimate:
    """The estimated device time of one eager op (see the module doc)."""
    spec = device_spec(device)
    elem_bytes = _elem_bytes(dtype)
    flops, moved, launches, notes = count_flops_and_bytes(name, shapes, elem_bytes)
    peak = spec.peak_flops.get(dtype)
    compute_us = flops / peak.value * 1e6 if peak is not None and peak.value else None
    if compute_us is None and flops:
        notes.append(f"{spec.name} publishes no {dtype} peak: compute time not counted (lower bound)")
    memory_us = moved / spec.hbm_bandwidth.value * 1e6
    launch_us = launches * spec.launch_overhead_us.value
    device_us = max(compute_us or 0.0, memory_us)
    if launches == 0:
        bound = "none"
    elif launch_us >= device_us:
        bound = "launch"
    else:
        bound = "compute" if (compute_us or 0.0) >= memory_us else "memory"
    return OpEstimate(name=name, shapes=str(shapes), flops=flops, bytes=moved, launches=launches, compute_us=compute_us,
                      memory_us=memory_us, launch_us=launch_us, time_us=device_us + launch_us, bound=bound, notes=notes)


def _elem_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not modelled: choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# --- a region: N eager ops -> K kernels -----------------------------------------------------------


def estimate_saving(ops: Iterable[Any], reference_kernels: int, device: str | DeviceSpec, *, dtype: str = "float32",
                    steps: int = 1) -> SavingEstimate:
    """Estimated saving per step when `reference_kernels` (K) kernels replace the eager `ops` (N over
    `steps` profiled steps; anything with `.name` and `.shapes`, e.g. EagerOp)."""
    if reference_kernels < 0 or steps < 1:
        raise ValueError(f"need reference_kernels >= 0 and steps >= 1 (got {reference_kernels}, {steps})")
    spec = device_spec(device)
    estimates = [estimate_op(op.name, op.shapes, spec, dtype) for op in ops]
    launched = [e for e in estimates if e.launches]
    n = sum(e.launches for e in estimates) / steps
    eager_us = sum(e.time_us for e in estimates) / steps
    flops = sum(e.flops for e in estimates) / steps
    peak = spec.peak_flops.get(dtype)
    lower_bound = any(e.compute_us is None and e.flops for e in estimates)
    k = min(reference_kernels, math.ceil(n)) if n else 0
    largest = max((e.bytes for e in launched), default=0.0)
    fused_bytes = min(sum(e.bytes for e in estimates) / steps, k * largest)
    compute_us = flops / peak.value * 1e6 if peak is not None and peak.value else 0.0
    launch = spec.launch_overhead_us.value
    fused_us = max(compute_us, fused_bytes / spec.hbm_bandwidth.value * 1e6) + k * launch if k else 0.0
    notes = sorted({note for e in estimates for note in e.notes})
    if reference_kernels > n:
        notes.append(f"K={reference_kernels} exceeds the {n:g} eager launches per step: nothing to fuse (K capped at N)")
    return SavingEstimate(
        device=spec.name, dtype=dtype, eager_ops=n, reference_kernels=reference_kernels, eager_us=eager_us,
        fused_us=fused_us, saving_us=max(0.0, eager_us - fused_us), launch_saving_us=max(0.0, (n - k) * launch),
        lower_bound=lower_bound, figures=_figures(spec, dtype), notes=notes)


def estimate_intent_saving(intent: Intent, table: Any, device: str | DeviceSpec, *, dtype: str = "float32") -> SavingEstimate:
    """The intent's saving on `device`: its eager ops (by source line, or the optimizer phase for an
    optimizer intent) from an EagerOpTable, K from its evidence (1 kernel when none is recorded)."""
    if intent.category == IntentCategory.optimizer_step:
        ops = [op for op in table.ops if op.phase == Phase.optimizer]
    else:
        ops = [op for op in table.ops if any(span.overlaps(op.span) for span in intent.spans)]
        if intent.library is not None:  # a library region: only the ops that ran under it from those call sites
            from trainbridge.agents.analyst.align import in_library_region

            ops = [op for op in ops if in_library_region(intent.library, table, op)]
    k = intent.evidence.reference_kernels
    estimate = estimate_saving(ops, 1 if k is None else k, device, dtype=dtype, steps=table.steps)
    if k is None:
        estimate.notes.append("no reference kernel count in the evidence: K=1 assumed (one fused kernel)")
    return estimate


def _figures(spec: DeviceSpec, dtype: str) -> dict[str, str]:
    peak = spec.peak_flops.get(dtype)
    peak_text = "not published" if peak is None or peak.value is None else f"{peak.value / 1e12:g} TFLOP/s"
    return {
        f"peak_{dtype}": f"{peak_text} ({peak.confidence if peak else 'unknown'})",
        "hbm_bandwidth": f"{spec.hbm_bandwidth.value / 1e12:g} TB/s ({spec.hbm_bandwidth.confidence})",
        "launch_overhead": f"{spec.launch_overhead_us.value:g} us ({spec.launch_overhead_us.confidence})",
    }
