"""Choose between a real torch_npu and the CPU stand-in for a child interpreter (parent side).

The probe runs in a subprocess of the child's interpreter with TORCH_DEVICE_BACKEND_AUTOLOAD=0 (a
torch_npu installed without CANN otherwise breaks `import torch` itself) and without the stand-in
on its path, so only a real torch_npu can answer. The real one wins whenever it imports and sees a
device; the stand-in is chosen only when it is absent or unusable, with the precise reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

_MARK = "TRAINBRIDGE_NPU_PROBE:"
_PROBE = r"""
import importlib.util, json, sys
def emit(**kw):
    print(%(mark)r + json.dumps(kw), flush=True)
    sys.exit(0)
spec = importlib.util.find_spec("torch_npu")
if spec is None:
    emit(state="not_installed")
origin = spec.origin or next(iter(spec.submodule_search_locations or []), "?")
try:
    import torch
    import torch_npu
except BaseException as exc:
    emit(state="import_failed", origin=origin, error=f"{type(exc).__name__}: {exc}"[:2000])
if getattr(torch_npu, "__trainbridge_emulated__", False):
    emit(state="emulated_on_path", origin=origin)
version = str(getattr(torch_npu, "__version__", "unknown"))
try:
    available = bool(torch_npu.npu.is_available())
    count = int(torch_npu.npu.device_count())
except BaseException as exc:
    emit(state="no_device", origin=origin, version=version, error=f"{type(exc).__name__}: {exc}"[:2000])
emit(state="ok" if available and count > 0 else "no_device", origin=origin, version=version,
     available=available, count=count)
""" % {"mark": _MARK}

Cause = Literal["real_usable", "not_installed", "import_failed", "no_device", "probe_failed"]


class NpuSelection(BaseModel):
    """Which torch_npu a child process gets, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["real", "emulated"]
    cause: Cause
    reason: str
    python: str


def emulation_path() -> Path:
    """The directory to prepend to a child's PYTHONPATH so that `import torch_npu` finds the stand-in."""
    return Path(__file__).resolve().parent


def _without_emulation(pythonpath: str) -> str:
    ours = str(emulation_path())
    return os.pathsep.join(p for p in pythonpath.split(os.pathsep) if p and os.path.abspath(p) != ours)


def select_torch_npu(
    python: str = sys.executable,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 180.0,
) -> NpuSelection:
    """Probe `python` for a usable real torch_npu; fall back to the emulation with the reason."""
    probe_env = dict(os.environ if env is None else env)
    probe_env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    probe_env["PYTHONPATH"] = _without_emulation(probe_env.get("PYTHONPATH", ""))
    if not probe_env["PYTHONPATH"]:
        del probe_env["PYTHONPATH"]
    with tempfile.TemporaryDirectory(prefix="tb-npu-probe-") as cwd:  # nothing importable in the cwd
        try:
            proc = subprocess.run(
                [python, "-c", _PROBE], env=probe_env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return _emulated(python, "probe_failed", f"probing torch_npu with {python} timed out after "
                             f"{timeout_s:.0f} s; the real torch_npu is treated as unusable")
        except OSError as exc:
            return _emulated(python, "probe_failed", f"could not run {python} to probe torch_npu: {exc}")
    report = next((ln[len(_MARK):] for ln in reversed(proc.stdout.splitlines()) if ln.startswith(_MARK)), None)
    if report is None:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        return _emulated(python, "probe_failed", f"the torch_npu probe in {python} exited with code {proc.returncode} "
                         f"without a result; the real torch_npu is treated as unusable. Output tail:\n{tail}")
    return _decide(python, json.loads(report))


def _emulated(python: str, cause: Cause, reason: str) -> NpuSelection:
    return NpuSelection(mode="emulated", cause=cause, reason=reason, python=python)


def _decide(python: str, r: dict) -> NpuSelection:
    state = r["state"]
    where = r.get("origin", "?")
    if state == "ok":
        reason = f"real torch_npu {r['version']} at {where} imports and sees {r['count']} NPU device(s)"
        return NpuSelection(mode="real", cause="real_usable", python=python, reason=reason)
    if state == "not_installed":
        return _emulated(python, "not_installed", f"torch_npu is not installed for {python}; using the CPU emulation")
    if state == "emulated_on_path":
        return _emulated(python, "not_installed", f"no real torch_npu for {python}: the torch_npu found at {where} is "
                         "trainbridge's emulation itself; using the CPU emulation")
    if state == "import_failed":
        return _emulated(python, "import_failed", f"torch_npu at {where} is installed but failed to import: "
                         f"{r['error']} (a missing libhccl.so means the CANN toolkit is not set up: source its "
                         "set_env.sh); using the CPU emulation")
    detail = r.get("error") or f"is_available()={r.get('available')}, device_count()={r.get('count')}"
    return _emulated(python, "no_device", f"torch_npu {r.get('version', '?')} at {where} imports but sees no NPU "
                     f"device ({detail}); using the CPU emulation")


def selection_env(selection: NpuSelection, env: Mapping[str, str]) -> dict[str, str]:
    """The child's environment for `selection`: the stand-in first on PYTHONPATH only when emulated.

    Emulated children also get TORCH_DEVICE_BACKEND_AUTOLOAD=0, so that a broken real torch_npu's
    autoload entry point cannot break `import torch`.
    """
    out = dict(env)
    rest = _without_emulation(out.get("PYTHONPATH", ""))
    if selection.mode == "emulated":
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(emulation_path()), rest) if p)
        out["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    elif rest:
        out["PYTHONPATH"] = rest
    else:
        out.pop("PYTHONPATH", None)
    return out


def host_reference_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a host-CPU child that runs an NPU program for its torch.compile reference where no
    NPU is usable: the stand-in on its path with the npu -> cpu mapping (TRAINBRIDGE_NPU_EMULATION_DEVICE=map),
    so a ported program's `import torch_npu`, `.npu()` and `device="npu"` give CPU tensors Inductor compiles, and
    its fused torch_npu calls trace as the CPU math they emulate."""
    emulated = NpuSelection(mode="emulated", cause="not_installed", reason="the host CPU's compile reference",
                            python=sys.executable)
    return {**selection_env(emulated, env), "TRAINBRIDGE_NPU_EMULATION_DEVICE": "map"}
