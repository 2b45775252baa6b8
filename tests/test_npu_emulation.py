"""The torch_npu CPU stand-in (shared helpers: tests/npu_emulation_support.py): torch.npu queries and generator, signatures against the op-plugin / wheel schemas, and
real/emulated selection. Op numerics: test_npu_emulation_{ops,attention,optim}.py; the emulated
device (child processes): test_npu_emulation_device.py; Ascend's own op-test cases:
test_npu_emu_conformance_*.py.

Op tests import the stand-in in-process with TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP=0 (so this pytest
process keeps no npu backend registration); the device is tested in child processes, the way the
sandbox uses it.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainbridge.sandbox.npu_emulation import NpuSelection, emulation_path, select_torch_npu, selection_env

from trainbridge.tests.npu_emulation_support import (  # noqa: F401 (tnpu is a fixture)
    EMULATED_OPS, REFERENCE, assert_signature_matches, op_schemas, schema_params, tnpu,
)


# ================================================================================ npu module


def test_npu_module_queries(tnpu, monkeypatch):
    npu = tnpu.npu
    assert npu.is_available() and npu.device_count() == 1 and npu.current_device() == 0
    npu.set_device("npu:0")
    npu.synchronize()
    with pytest.raises(RuntimeError, match="Invalid device ordinal 1"):
        npu.set_device(1)
    monkeypatch.setenv("TRAINBRIDGE_EMULATED_NPU_COUNT", "2")
    npu.set_device(1)
    assert npu.current_device() == 1
    npu.set_device(0)
    cur, peak = npu.memory_allocated(), npu.max_memory_allocated()
    assert 0 < cur <= peak
    free, total = npu.mem_get_info()
    assert 0 < free <= total
    npu.manual_seed(123)
    a = torch.rand(3)
    torch.manual_seed(123)
    torch.testing.assert_close(a, torch.rand(3))
    start, end = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    start.record()
    end.record()
    assert start.elapsed_time(end) >= 0


# ================================================================================ signatures


@pytest.mark.parametrize("name", EMULATED_OPS)
def test_signature_matches_op_plugin_schema(tnpu, name):
    assert_signature_matches(getattr(tnpu, name), name, op_schemas()[name], same_default_type=True)


_SURFACE_CONSTANTS = {"required": "required", "MOMENTUM_MIN": "0.0", "DAMPENING_DEFAULT": "0.0",
                      "WEIGHT_DECAY_MIN": "0.0"}


@pytest.mark.parametrize("name", ["NpuFusedAdamW", "NpuFusedAdam", "NpuFusedSGD"])
def test_fused_optimizer_signatures_match_wheel(tnpu, name):
    """Against the torch_npu 2.14 wheel's Python surface (its named constants spelled out: torch_npu's
    npu_fused_sgd.py sets MOMENTUM_MIN = DAMPENING_DEFAULT = WEIGHT_DECAY_MIN = 0.0)."""
    surface = (REFERENCE / "torch_npu_python_api_surface.txt").read_text()
    line = next(ln for ln in surface.splitlines() if f"class {name}(" in ln)
    want = line.split(".__init__", 1)[1].strip()
    for const, value in _SURFACE_CONSTANTS.items():
        want = re.sub(rf"\b{const}\b", value, want)
    got = str(inspect.signature(getattr(tnpu.optim, name).__init__)).replace("<required parameter>", "required")
    assert got == want


def test_the_optim_module_exports_what_torch_npu_optim_exports(tnpu):
    """Ascend/pytorch test/optim/test_fused_optimizers.py imports these nine names."""
    names = {"NpuFusedSGD", "NpuFusedAdam", "NpuFusedAdamW", "NpuFusedAdamP", "NpuFusedLamb", "NpuFusedAdadelta",
             "NpuFusedBertAdam", "NpuFusedRMSprop", "NpuFusedRMSpropTF", "NpuFusedOptimizerBase"}
    assert names <= set(tnpu.optim.__all__) and all(hasattr(tnpu.optim, n) for n in names)
    with pytest.raises(NotImplementedError, match="NpuFusedLamb is not emulated"):
        tnpu.optim.NpuFusedLamb([torch.zeros(2, requires_grad=True)])


def test_parser_detects_a_wrong_default():
    params = schema_params("f(Tensor self, float epsilon=1e-06, *, str s=\"\", int? k=None) -> Tensor")
    assert params == [("self", False, inspect.Parameter.empty), ("epsilon", False, 1e-06), ("s", True, ""),
                      ("k", True, None)]


# ================================================================================ selection


def _fake_torch_npu(root: Path, body: str, npu_body: str = "") -> Path:
    pkg = root / "torch_npu"
    (pkg / "npu").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    (pkg / "npu" / "__init__.py").write_text(textwrap.dedent(npu_body))
    return root


def _env_with(*paths: Path | str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env


def test_selection_emulates_when_not_installed():
    sel = select_torch_npu(env=_env_with(emulation_path()))  # the stand-in alone never counts as real
    assert sel.mode == "emulated" and sel.cause == "not_installed"
    assert "not installed" in sel.reason and sys.executable in sel.reason


def test_selection_real_wins_even_with_the_stand_in_first_on_the_path(tmp_path):
    root = _fake_torch_npu(tmp_path, "__version__ = '2.13.0'\nfrom . import npu\n",
                           "def is_available():\n    return True\ndef device_count():\n    return 8\n")
    sel = select_torch_npu(env=_env_with(emulation_path(), root))
    assert sel.mode == "real" and sel.cause == "real_usable"
    assert "2.13.0" in sel.reason and "8 NPU device(s)" in sel.reason and str(root) in sel.reason
    child = selection_env(sel, _env_with(emulation_path(), root))
    assert str(emulation_path()) not in child["PYTHONPATH"].split(os.pathsep)
    probe = subprocess.run([sys.executable, "-c", "import torch_npu; print(hasattr(torch_npu, '__trainbridge_emulated__'))"],
                           env=child, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stderr


def test_selection_reports_import_failure_with_the_error(tmp_path):
    root = _fake_torch_npu(tmp_path, "raise ImportError('libhccl.so: cannot open shared object file')\n")
    sel = select_torch_npu(env=_env_with(root))
    assert sel.mode == "emulated" and sel.cause == "import_failed"
    assert "libhccl.so: cannot open shared object file" in sel.reason and "CANN" in sel.reason


def test_selection_reports_no_device(tmp_path):
    root = _fake_torch_npu(tmp_path, "__version__ = '2.13.0'\nfrom . import npu\n",
                           "def is_available():\n    return False\ndef device_count():\n    return 1\n")
    sel = select_torch_npu(env=_env_with(root))
    assert sel.mode == "emulated" and sel.cause == "no_device"
    assert "sees no NPU device" in sel.reason and "is_available()=False" in sel.reason


def test_selection_probe_sets_autoload_off(tmp_path):
    root = _fake_torch_npu(tmp_path, "import os\nassert os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'] == '0', 'autoload on'\n"
                                     "from . import npu\n",
                           "def is_available():\n    return True\ndef device_count():\n    return 1\n")
    env = _env_with(root)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "1"
    assert select_torch_npu(env=env).mode == "real"


def test_selection_env_for_emulated_child():
    sel = NpuSelection(mode="emulated", cause="not_installed", reason="x", python=sys.executable)
    env = selection_env(sel, {"PYTHONPATH": os.pathsep.join(["/a", str(emulation_path()), "/b"])})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(emulation_path()), "/a", "/b"]
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    with pytest.raises(Exception):
        NpuSelection(mode="emulated", cause="not_installed", reason="x", python="p", extra=1)

