"""Target backends: the one place that knows device names, synchronisation and memory statistics.

Shared code asks a `Backend` instead of naming `torch.cuda` or `torch.npu`; the device module is
resolved once through `torch.get_device_module`. Methods that touch torch run inside the sandbox
child; `child_env`, `availability` and `npu_selection` run in the parent.

The NPU availability check (`availability("npu")`) answers one question: can this host time training steps on a real
NPU? Its reasons are precise: torch_npu not installed, installed but failing to import (with the
error), the CANN toolkit missing (libhccl and friends), torch and torch_npu versions that do not
match (torch_npu pins torch's release exactly), or no NPU device visible. It runs in subprocesses
of the child's interpreter with the child's environment (a broken torch_npu can break `import
torch` itself), once per process: a cheap metadata check first (no torch import), then the
emulation layer's import-and-device probe (`select_torch_npu`), whose result the runner also uses
to decide whether a child gets the real torch_npu or the CPU stand-in.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

BackendName = Literal["cpu", "cuda", "npu"]
BACKENDS: tuple[str, ...] = ("cpu", "cuda", "npu")
# Settings an NPU child needs before torch_npu is imported (reference/README.md, profiler notes).
NPU_ENV = {"TASK_QUEUE_ENABLE": "2", "CPU_AFFINITY_CONF": "1"}
# What CANN's set_env.sh and the device runtime put in the environment; the sandbox's scrubbed
# environment would otherwise drop them and a real torch_npu could not find its libraries.
_NPU_FORWARDED_PREFIXES = ("ASCEND_", "HCCL_", "ACL_")
_NPU_FORWARDED_NAMES = ("LD_LIBRARY_PATH", "PYTHONPATH", "TOOLCHAIN_HOME", "ASCEND_HOME_PATH")
_CUDA_FORWARDED_NAMES = ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "CUDA_HOME")
_CANN_MISSING = re.compile(r"lib(hccl|ascendcl|acl_op_compiler|ge_runner|graph|runtime|msprofiler|opapi)\w*\.so", re.I)
_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")
_MARK = "TRAINBRIDGE_NPU_VERSIONS:"
_SELECTION_HINT = re.compile(r"\(a missing libhccl\.so means[^)]*\)")  # select_torch_npu's advice, not the error


class AvailabilityCause(StrEnum):
    available = "available"
    not_installed = "not_installed"  # no torch_npu for this interpreter
    import_failed = "import_failed"  # torch_npu is there but `import torch_npu` raised
    no_cann = "no_cann"  # import failed because the CANN libraries (libhccl.so, ...) are missing
    version_mismatch = "version_mismatch"  # torch_npu X.Y.Z needs torch X.Y.Z
    no_device = "no_device"  # imports, but no NPU device is visible
    probe_failed = "probe_failed"  # the probe itself timed out or died
    not_built = "not_built"  # torch built without this backend (CUDA)


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str
    cause: AvailabilityCause = AvailabilityCause.available
    versions: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Backend:
    name: str

    def __post_init__(self) -> None:
        if self.name not in BACKENDS:
            raise ValueError(f"unknown backend {self.name!r}: choose one of {', '.join(BACKENDS)}")

    @property
    def device(self) -> str:
        return self.name

    def child_env(self) -> dict[str, str]:
        """Environment the child needs before it imports torch: NPU task queue and CPU affinity,
        plus the device runtime's own variables (CANN, CUDA) taken from this process."""
        if self.name == "npu":
            forwarded = {k: v for k, v in os.environ.items()
                         if k.startswith(_NPU_FORWARDED_PREFIXES) or k in _NPU_FORWARDED_NAMES}
            return {**forwarded, **NPU_ENV}
        if self.name == "cuda":
            return {k: os.environ[k] for k in _CUDA_FORWARDED_NAMES if k in os.environ}
        return {}

    # --- child side -------------------------------------------------------------------------
    def prepare(self) -> Any:
        """Import the device plugin before anything builds a model (NPU: torch_npu, which registers
        the device; in emulation it maps "npu" onto the CPU). Returns the plugin module or None."""
        if self.name != "npu":
            return None
        import torch_npu  # noqa: F401  (the real one, or the stand-in the runner put on the path)

        return torch_npu

    def _module(self):  # the torch device module (torch.cuda, torch.npu), resolved once per call site
        import torch

        return torch.get_device_module(self.name)

    def sync(self) -> None:
        if self.name != "cpu":
            self._module().synchronize()

    def reset_peak_memory(self) -> None:
        if self.name != "cpu":
            self._module().reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int:
        """Device peak allocated bytes; on the CPU, the process's peak resident set size."""
        if self.name == "cpu":
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return int(self._module().max_memory_allocated())

    def memory_stats(self) -> dict[str, int]:
        """Allocated / peak allocated / reserved bytes on the device (CPU: resident set sizes)."""
        if self.name == "cpu":
            current = _current_rss()
            peak = max(self.peak_memory_bytes(), current)  # the kernel updates ru_maxrss lazily
            return {"allocated_bytes": current, "peak_allocated_bytes": peak, "reserved_bytes": peak}
        module = self._module()
        return {"allocated_bytes": int(module.memory_allocated()), "peak_allocated_bytes": int(module.max_memory_allocated()),
                "reserved_bytes": int(module.memory_reserved())}


def _current_rss() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- parent side: probing -----------------------------------------------------------------------


def availability(name: str, *, python: str | None = None, env: Mapping[str, str] | None = None) -> Availability:
    """Whether a backend can run here, with a precise reason when it cannot (parent side).

    For "npu", `python` and `env` name the interpreter and environment to probe (default: this
    interpreter with the environment a sandbox child gets); the default answer is cached per process.
    """
    Backend(name)  # validates the name
    if name == "cpu":
        return Availability(True, "the CPU is always available")
    if name == "cuda":
        return _cuda_availability()
    if python is None and env is None:
        return _default_npu_availability()
    return npu_availability(python or sys.executable, env=npu_check_env() if env is None else env)


def host_capabilities(target: str) -> frozenset[str]:
    """What recipes may require (knowledge/schema.py, `Recipe.requires`) that this host has for `target`: "torchair"
    on a real NPU host whose torch_npu has TorchAir (never on the emulation)."""
    if target != "npu" or npu_emulated():
        return frozenset()
    import importlib.util

    spec = importlib.util.find_spec("torch_npu")
    torch_npu_dir = Path(spec.origin).parent if spec is not None and spec.origin else None
    found = importlib.util.find_spec("torchair") is not None or (torch_npu_dir is not None and (torch_npu_dir / "dynamo" / "torchair").is_dir())
    return frozenset({"torchair"} if found else ())


def npu_emulated() -> bool:
    """No usable NPU here: the sandbox gives `npu` children the torch_npu emulation (the device maps to
    the CPU), so their numerics are real but their times are never NPU speed."""
    return not availability("npu").available


def _cuda_availability() -> Availability:
    import torch

    if not torch.backends.cuda.is_built():
        return Availability(False, f"this torch ({torch.__version__}) is built without CUDA", AvailabilityCause.not_built)
    if not torch.cuda.is_available():
        return Availability(False, "torch has CUDA support but no CUDA device is visible", AvailabilityCause.no_device)
    return Availability(True, f"{torch.cuda.device_count()} CUDA device(s)")


def npu_check_env() -> dict[str, str]:
    """The environment an NPU sandbox child starts with (before per-run seeds and threads)."""
    from trainbridge.sandbox.isolation import scrubbed_env

    return scrubbed_env(Backend("npu").child_env(), threads=1, seed=0)


@functools.cache
def _default_npu_availability() -> Availability:
    return npu_availability(sys.executable, env=npu_check_env(), select=npu_selection)


@functools.cache
def npu_selection():
    """The emulation layer's choice (real torch_npu or the CPU stand-in) for this interpreter and
    the child environment; probed once per process. The runner and the availability check share it."""
    from trainbridge.sandbox.npu_emulation import select_torch_npu

    return select_torch_npu(sys.executable, env=npu_check_env())


def npu_availability(python: str, *, env: Mapping[str, str], select: Callable[[], Any] | None = None,
              timeout_s: float = 60.0) -> Availability:
    """Probe `python` under `env` for a usable real NPU (see the module doc for the order of checks).
    `select` gives the emulation layer's selection when the cheap checks pass (default: probe now)."""
    report = _version_report(python, env, timeout_s)
    if report is None:
        return Availability(False, f"could not run {python} to read torch/torch_npu versions; the NPU is treated as "
                            "unavailable", AvailabilityCause.probe_failed)
    versions = {k: v for k, v in (("torch", report.get("torch")), ("torch_npu", report.get("torch_npu"))) if v}
    if not report.get("found"):
        return Availability(False, f"torch_npu is not installed for {python} (pip install torch-npu matching torch "
                            f"{versions.get('torch', '?')}, on a host with the CANN toolkit)", AvailabilityCause.not_installed, versions)
    mismatch = version_mismatch(versions.get("torch"), versions.get("torch_npu"))
    if mismatch:
        return Availability(False, f"{mismatch} (torch_npu at {report.get('origin', '?')})", AvailabilityCause.version_mismatch, versions)
    if select is None:
        from trainbridge.sandbox.npu_emulation import select_torch_npu

        return _from_selection(select_torch_npu(python, env=env), versions)
    return _from_selection(select(), versions)


def _from_selection(selection, versions: dict[str, str]) -> Availability:
    if selection.mode == "real":
        return Availability(True, selection.reason, AvailabilityCause.available, versions)
    cause = {"not_installed": AvailabilityCause.not_installed, "import_failed": AvailabilityCause.import_failed,
             "no_device": AvailabilityCause.no_device}.get(selection.cause, AvailabilityCause.probe_failed)
    reason = selection.reason.removesuffix("; using the CPU emulation")
    if cause == AvailabilityCause.import_failed and _CANN_MISSING.search(_SELECTION_HINT.sub("", selection.reason)):
        cause = AvailabilityCause.no_cann
        error = _SELECTION_HINT.sub("", reason).split(" failed to import: ", 1)[-1].strip()
        reason = (f"the CANN toolkit is not set up: importing torch_npu failed with {error} (install CANN and "
                  "`source <cann>/set_env.sh` before starting trainbridge)")
    return Availability(False, reason, cause, versions)


def release(version: str | None) -> tuple[int, int, int] | None:
    """'2.13.0+cpu' -> (2, 13, 0); '2.1.0.post10' -> (2, 1, 0); '2.6.0rc1' -> (2, 6, 0); junk -> None."""
    match = _RELEASE.match(version or "")
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def version_mismatch(torch_version: str | None, npu_version: str | None) -> str | None:
    """A sentence when torch_npu's release does not match torch's (it pins torch exactly), else None."""
    t, n = release(torch_version), release(npu_version)
    if t is None or n is None or t == n:
        return None
    return (f"torch {torch_version} does not match torch_npu {npu_version}: torch_npu {'.'.join(map(str, n))} needs torch "
            f"{'.'.join(map(str, n))}; install the matching pair")


_VERSION_SCRIPT = r"""
import importlib.util, json, os, re, sys
from importlib import metadata
def dist_version(*names):
    for name in names:
        try:
            return metadata.version(name)
        except Exception:
            pass
    return None
def file_version(spec):
    for folder in list(getattr(spec, "submodule_search_locations", None) or []):
        try:
            text = open(os.path.join(folder, "version.py"), encoding="utf-8").read()
        except OSError:
            continue
        m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M)
        if m:
            return m.group(1)
    return None
out = {}
spec = importlib.util.find_spec("torch")
out["torch"] = dist_version("torch") or (file_version(spec) if spec else None)
spec = importlib.util.find_spec("torch_npu")
out["found"] = spec is not None
if spec is not None:
    out["origin"] = spec.origin or next(iter(spec.submodule_search_locations or []), "?")
    out["torch_npu"] = dist_version("torch_npu", "torch-npu") or file_version(spec)
print(%(mark)r + json.dumps(out), flush=True)
""" % {"mark": _MARK}


def _version_report(python: str, env: Mapping[str, str], timeout_s: float) -> dict[str, Any] | None:
    """torch / torch_npu versions and where torch_npu is, read from metadata without importing them."""
    from trainbridge.sandbox.npu_emulation import emulation_path

    ours = str(emulation_path())
    probe_env = dict(env)
    path = os.pathsep.join(p for p in probe_env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ours)
    probe_env.pop("PYTHONPATH", None)
    if path:
        probe_env["PYTHONPATH"] = path
    try:
        with tempfile.TemporaryDirectory(prefix="tb-npu-versions-") as cwd:  # nothing importable in the cwd
            proc = subprocess.run([python, "-c", _VERSION_SCRIPT], env=probe_env, cwd=cwd, capture_output=True, text=True,
                                  timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(_MARK)), None)
    return json.loads(line[len(_MARK):]) if line else None


# --- torch.compile(backend="npu"): a graph compiler, or silently eager? ---------------------------


@dataclass(frozen=True)
class NpuCompileStatus:
    """Whether `torch.compile(backend="npu")` compiles graphs (TorchAir) or silently runs eager."""

    compiles: bool
    cause: Literal["graph_compiler", "eager_fallback", "no_backend", "emulated", "not_installed"]
    reason: str


def npu_compile_status(torch_npu_module: Any = None, *, behavioural: bool = False) -> NpuCompileStatus:
    """Detect torch_npu's silent fallback: built without TorchAir, torch_npu/dynamo registers an
    'npu' dynamo backend that returns the graph unchanged (eager), with only a warning.

    Checks, as torch_npu decides it: the `dynamo/torchair` folder beside torch_npu, and whether the
    registered 'npu' backend is torch_npu.dynamo's `_eager_npu_backend`. With `behavioural=True`
    the registered backend is also called on a one-op FX graph: returning that very graph is eager.
    Runs where torch_npu is importable (a sandbox child); `torch_npu_module` is for tests.
    """
    import importlib

    module = torch_npu_module
    if module is None:
        try:
            module = importlib.import_module("torch_npu")
        except Exception as exc:
            return NpuCompileStatus(False, "not_installed", f"torch_npu does not import here: {type(exc).__name__}: {exc}")
    if getattr(module, "__trainbridge_emulated__", False):
        return NpuCompileStatus(False, "emulated", "torch_npu is trainbridge's CPU emulation: no NPU graph compiler; "
                                "torch.compile(backend='npu') cannot be judged without the real torch_npu")
    package_dir = Path(module.__file__).resolve().parent
    try:
        dynamo = importlib.import_module(f"{module.__name__}.dynamo")
        from torch._dynamo.backends.registry import lookup_backend

        registered = lookup_backend("npu")
    except Exception as exc:
        return NpuCompileStatus(False, "no_backend", f"no 'npu' dynamo backend is registered ({type(exc).__name__}: {exc}); "
                                "torch.compile(backend='npu') fails")
    eager = getattr(dynamo, "_eager_npu_backend", None)
    torchair_dir = package_dir / "dynamo" / "torchair"
    if (eager is not None and registered is eager) or not torchair_dir.exists():
        return NpuCompileStatus(False, "eager_fallback", f"torch_npu at {package_dir} was built without TorchAir "
                                f"({torchair_dir} is missing): torch.compile(backend='npu') silently runs eager. Use a "
                                "torch_npu build with TorchAir, or do not count on NPU graph compilation")
    if behavioural and _returns_graph_unchanged(registered):
        return NpuCompileStatus(False, "eager_fallback", "the registered 'npu' dynamo backend returned the FX graph "
                                "unchanged: torch.compile(backend='npu') runs eager")
    return NpuCompileStatus(True, "graph_compiler", f"torch.compile(backend='npu') uses TorchAir ({torchair_dir})")


def _returns_graph_unchanged(backend) -> bool:
    import torch

    class _One(torch.nn.Module):
        def forward(self, x):
            return x + 1

    graph = torch.fx.symbolic_trace(_One())
    return backend(graph, [torch.ones(2)]) is graph
