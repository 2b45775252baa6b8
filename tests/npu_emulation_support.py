"""Helpers shared by the NPU emulation tests (test_npu_emulation*.py, test_npu_emu_conformance_*.py,
test_npu_wheel_schema.py): the in-process `tnpu` fixture, the on-device switch, the `upstream` tag
naming the Ascend test a case mirrors, and the signature-vs-schema check."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from trainbridge.sandbox.npu_emulation import emulation_path

REFERENCE = Path(__file__).parent / "fixtures" / "npu_reference"
TEMPLATE = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


CONFORMANCE_ON_DEVICE_ENV = "TRAINBRIDGE_NPU_CONFORMANCE_ON_DEVICE"


def on_device() -> bool:
    """True in a process dedicated to running the tests on the emulated npu device (see
    benchmarks/npu_emulation_conformance.py); the stand-in then registers the device in-process."""
    return os.environ.get(CONFORMANCE_ON_DEVICE_ENV) == "1"


def to_npu(t: torch.Tensor) -> torch.Tensor:
    """The test's `x.npu()`: a copy on the emulated device, or a host copy where no device is registered."""
    return t.npu() if on_device() else t.detach().clone()


def upstream(api: str, source: str, case: str):
    """Tags a test with the Ascend test it mirrors: `source` is "<repo> <path>", `case` the test method."""
    def mark(fn):
        fn.upstream = (api, source, case)
        return fn
    return mark


@pytest.fixture(scope="module")
def tnpu():
    """The stand-in, imported in-process without the device mapping; removed again afterwards.
    With TRAINBRIDGE_NPU_CONFORMANCE_ON_DEVICE=1 it is imported with the device and kept."""
    if on_device():
        sys.path.insert(0, str(emulation_path()))
        module = importlib.import_module("torch_npu")
        assert module.__trainbridge_emulated__ is True and torch.zeros(1, device="npu").device.type == "npu"
        yield module
        return
    assert "torch_npu" not in sys.modules, "a torch_npu is already imported in this process"
    old_env = os.environ.get("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP")
    os.environ["TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP"] = "0"
    path = str(emulation_path())
    sys.path.insert(0, path)
    try:
        module = importlib.import_module("torch_npu")
        assert module.__trainbridge_emulated__ is True
        yield module
    finally:
        sys.path.remove(path)
        for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
            del sys.modules[name]
        if old_env is None:
            os.environ.pop("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP", None)
        else:
            os.environ["TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP"] = old_env


def parse_default(text: str):
    text = text.strip()
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[0] in "'\"":
        return text[1:-1]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return float(text)


def schema_params(line: str) -> list[tuple[str, bool, object]]:
    """[(name, keyword_only, default or inspect.Parameter.empty)] from an op-plugin schema line."""
    args = line[line.index("(") + 1: line.rindex(") ->")]
    out, kw_only = [], False
    for raw in (a.strip() for a in args.split(",")):
        if raw == "*":
            kw_only = True
            continue
        decl, _, default = raw.partition("=")
        name = decl.split()[-1]
        out.append((name, kw_only, parse_default(default) if default else inspect.Parameter.empty))
    return out


def op_schemas() -> dict[str, str]:
    """name -> schema line; the un-overloaded schema wins, an overload (`name.Overload(`) only where the
    name has no plain one (e.g. `_npu_dropout_gen_mask.Tensor`)."""
    found: dict[str, str] = {}
    overloads: dict[str, str] = {}
    for line in (REFERENCE / "fused_api_signatures.txt").read_text().splitlines():
        m = re.match(r"(\w+)\(", line)
        if m and not line.startswith("#"):
            found.setdefault(m.group(1), line)
    for line in (REFERENCE / "torch_npu_2.14_ops_from_wheel.txt").read_text().splitlines():
        m = re.match(r"\[custom[^\]]*\] (\w+)(\.\w+)?\(", line)
        if m:
            (overloads if m.group(2) else found).setdefault(m.group(1), line[line.index("] ") + 2:])
    for name, line in overloads.items():
        found.setdefault(name, line)
    return found


EMULATED_OPS = [
    "npu_rms_norm", "npu_rms_norm_backward", "npu_add_rms_norm", "npu_rotary_mul", "npu_rotary_mul_backward",
    "npu_swiglu", "npu_swiglu_backward", "npu_geglu", "npu_geglu_grad", "npu_fusion_attention",
    "npu_fusion_attention_grad", "npu_confusion_transpose",
    "npu_fusion_attention_v2", "npu_fusion_attention_grad_v2", "npu_fusion_attention_v3",
    "npu_fusion_attention_grad_v3", "npu_scaled_masked_softmax", "npu_scaled_masked_softmax_backward",
    "npu_apply_rotary_pos_emb", "npu_interleave_rope", "npu_cross_entropy_loss", "npu_cross_entropy_loss_backward",
    "npu_gelu", "npu_gelu_backward", "npu_fast_gelu", "npu_fast_gelu_backward", "fast_gelu", "npu_format_cast",
    "npu_format_cast_", "_npu_dropout_gen_mask",
    "npu_moe_gating_top_k_softmax",
]


def assert_signature_matches(function, name: str, schema: str, *, same_default_type: bool) -> None:
    """The Python signature of an emulated op against one op-plugin/wheel schema line: names, order,
    keyword-only marks and defaults (and their types, with `same_default_type`)."""
    params = list(inspect.signature(function).parameters.values())
    want = schema_params(schema)
    assert [p.name for p in params] == [w[0] for w in want], schema
    for p, (wname, kw_only, default) in zip(params, want):
        kind = inspect.Parameter.KEYWORD_ONLY if kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert p.kind == kind, f"{name}.{wname}: kind {p.kind} vs schema {schema}"
        assert p.default == default, f"{name}.{wname}: {p.default!r} vs {default!r} in {schema}"
        if same_default_type:
            assert type(p.default) is type(default), f"{name}.{wname}: {p.default!r} vs {default!r}"


def grads_of(fn, inputs, upstream):
    """Gradients of sum(fn(*inputs) * upstream) w.r.t. inputs (a fixed random upstream gradient)."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    torch.autograd.backward(out, upstream)
    return out.detach(), [t.grad for t in inputs]


def assert_close_all(a, b, **tol):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **tol)
