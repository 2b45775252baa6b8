"""The NPU target through the sandbox: probe reasons (fake torch_npu packages in temp dirs), the
child's environment, real-vs-emulated selection end to end through run_workload, an example
trained on device "npu" under emulation, TorchAir fallback detection, and the torch_npu.profiler
capture wired to the parser (with a fake profiler module: no NPU here)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from trainbridge.sandbox import backends
from trainbridge.sandbox.backends import AvailabilityCause, Backend, availability, npu_compile_status, release, version_mismatch
from trainbridge.sandbox.isolation import scrubbed_env
from trainbridge.sandbox.npu_emulation import emulation_path
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.workload import load_workload
from trainbridge.tests.host import needs_no_torch_npu

TESTS = Path(__file__).parent
EXAMPLES = TESTS.parent / "examples"
TORCH_RELEASE = ".".join(map(str, release(torch.__version__)))
PROFILER_FIXTURE = TESTS / "fixtures" / "npu_profiler" / "normal" / "devbox_4242_20260101120000123_ascend_pt"


@pytest.fixture
def fresh_probe_cache():
    """The default NPU probe and selection are cached per process; tests that change the
    environment they depend on must not leak into (or read from) that cache."""
    backends.npu_selection.cache_clear()
    backends._default_npu_availability.cache_clear()
    yield
    backends.npu_selection.cache_clear()
    backends._default_npu_availability.cache_clear()


# --- versions -------------------------------------------------------------------------------------

def test_release_parsing_and_mismatch():
    assert release("2.13.0+cpu") == (2, 13, 0)
    assert release("2.1.0.post10") == (2, 1, 0)
    assert release("2.6.0rc1") == (2, 6, 0)
    assert release("2.5") == (2, 5, 0) and release("banana") is None and release(None) is None
    assert version_mismatch("2.13.0+cpu", "2.13.0") is None
    assert version_mismatch("2.1.0", "2.1.0.post3") is None
    message = version_mismatch("2.13.0+cpu", "2.12.0.post1")
    assert "torch 2.13.0+cpu" in message and "torch_npu 2.12.0.post1" in message and "needs torch 2.12.0" in message
    assert version_mismatch("2.13.0", None) is None  # unknown: the import probe decides


# --- probe reasons with fake torch_npu packages ---------------------------------------------------

def _fake_torch_npu(root: Path, init: str, *, npu: str = "", version: str | None = TORCH_RELEASE,
                    dist_version: str | None = None) -> Path:
    pkg = root / "torch_npu"
    (pkg / "npu").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(init))
    (pkg / "npu" / "__init__.py").write_text(textwrap.dedent(npu))
    if version is not None:
        (pkg / "version.py").write_text(f"__version__ = '{version}'\ngit_version = 'abc'\n")
    if dist_version is not None:
        info = root / f"torch_npu-{dist_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {dist_version}\n")
    return root


def _env(*paths: Path | str) -> dict[str, str]:
    return {**scrubbed_env({}, threads=1, seed=0), "PYTHONPATH": ":".join(str(p) for p in paths)}


_DEVICE_NPU = """
    def is_available():
        return {available}
    def device_count():
        return {count}
"""


@needs_no_torch_npu
def test_probe_not_installed_even_with_the_stand_in_on_the_path():
    found = availability("npu", env=_env(emulation_path()))
    assert not found.available and found.cause == AvailabilityCause.not_installed
    assert "torch_npu is not installed" in found.reason and sys.executable in found.reason
    assert found.versions["torch"] == torch.__version__


def test_probe_reports_missing_cann_with_the_error(tmp_path):
    root = _fake_torch_npu(tmp_path, "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n")
    found = availability("npu", env=_env(root))
    assert not found.available and found.cause == AvailabilityCause.no_cann
    assert "libhccl.so: cannot open shared object file" in found.reason and "set_env.sh" in found.reason


def test_probe_reports_other_import_failures_with_the_error(tmp_path):
    root = _fake_torch_npu(tmp_path, "raise RuntimeError('torch_npu built for another Python')\n")
    found = availability("npu", env=_env(root))
    assert not found.available and found.cause == AvailabilityCause.import_failed
    assert "RuntimeError: torch_npu built for another Python" in found.reason


@pytest.mark.parametrize("how", ["version_file", "dist_info"])
def test_probe_reports_a_version_mismatch_without_importing(tmp_path, how):
    init = "raise SystemExit('the version check must come before any import')\n"
    if how == "version_file":
        root = _fake_torch_npu(tmp_path, init, version="2.12.0")
        wanted = "2.12.0"
    else:
        root = _fake_torch_npu(tmp_path, init, version=None, dist_version="2.5.1.post2")
        wanted = "2.5.1.post2"
    found = availability("npu", env=_env(root))
    assert not found.available and found.cause == AvailabilityCause.version_mismatch
    assert f"torch_npu {wanted}" in found.reason and f"torch {torch.__version__}" in found.reason
    assert found.versions == {"torch": torch.__version__, "torch_npu": wanted}


def test_probe_reports_no_device(tmp_path):
    root = _fake_torch_npu(tmp_path, "from . import npu\n", npu=_DEVICE_NPU.format(available=False, count=0))
    found = availability("npu", env=_env(root))
    assert not found.available and found.cause == AvailabilityCause.no_device
    assert "sees no NPU device" in found.reason and "is_available()=False" in found.reason


def test_probe_accepts_a_matching_torch_npu_that_sees_devices(tmp_path):
    root = _fake_torch_npu(tmp_path, "from . import npu\n", npu=_DEVICE_NPU.format(available=True, count=2))
    found = availability("npu", env=_env(root))
    assert found.available and found.cause == AvailabilityCause.available
    assert "2 NPU device(s)" in found.reason and found.versions["torch_npu"] == TORCH_RELEASE


@needs_no_torch_npu
def test_default_probe_is_cached_and_the_cpu_always_available(fresh_probe_cache):
    first = availability("npu")
    assert availability("npu") is first and first.cause == AvailabilityCause.not_installed  # this machine has no torch_npu
    assert availability("cpu").available
    with pytest.raises(ValueError, match="unknown backend"):
        availability("tpu")


# --- the child's environment ----------------------------------------------------------------------

def test_npu_child_env_sets_task_queue_and_forwards_cann_but_no_secrets(monkeypatch):
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/Ascend/driver/lib64")
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1200")
    monkeypatch.setenv("ASCEND_API_TOKEN", "should-not-leak")
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "0")  # the parent's own setting never wins
    child = Backend("npu").child_env()
    assert child["TASK_QUEUE_ENABLE"] == "2" and child["CPU_AFFINITY_CONF"] == "1"
    env = scrubbed_env(child, threads=2, seed=0)
    assert env["ASCEND_TOOLKIT_HOME"] == "/usr/local/Ascend/ascend-toolkit/latest"
    assert env["LD_LIBRARY_PATH"] == "/usr/local/Ascend/driver/lib64" and env["HCCL_CONNECT_TIMEOUT"] == "1200"
    assert "ASCEND_API_TOKEN" not in env
    assert Backend("cpu").child_env() == {}
    assert Backend("npu").device == "npu"


# --- selection end to end through run_workload -------------------------------------------------------

_PROBE_WORKLOAD = '''
import json, os, sys
import torch

NPU_IMPORTED_FIRST = "torch_npu" in sys.modules


def build(device, seed):
    import torch_npu
    emulated = bool(getattr(torch_npu, "__trainbridge_emulated__", False))
    dev = device if emulated else "cpu"  # a fake real torch_npu has no kernels
    made = torch.ones(2, device=dev)
    record = {"device": device, "npu_imported_first": NPU_IMPORTED_FIRST, "torch_npu_file": torch_npu.__file__,
              "emulated": emulated, "task_queue": os.environ.get("TASK_QUEUE_ENABLE"),
              "affinity": os.environ.get("CPU_AFFINITY_CONF"), "ascend_home": os.environ.get("ASCEND_TOOLKIT_HOME"),
              "tensor_device": str(made.device), "pythonpath": os.environ.get("PYTHONPATH", "")}
    print("TB-NPU-PROBE " + json.dumps(record), flush=True)  # a confined child writes nowhere the test reads
    model = torch.nn.Linear(4, 1).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(dev)

    def loss_fn(model, batch):
        return model(batch).pow(2).mean()

    def train_step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return loss

    return {"model": model, "optimizer": optimizer, "batch": lambda step: data, "loss_fn": loss_fn, "train_step": train_step}
'''


def _probe_report(result) -> dict:
    line = next(x for x in reversed(result.stdout_tail.splitlines()) if x.startswith("TB-NPU-PROBE "))
    return json.loads(line[len("TB-NPU-PROBE "):])


def _probe_workload(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    (root / "step.py").write_text(_PROBE_WORKLOAD)
    (root / "trainbridge.toml").write_text('entry = "step:build"\nwarmup_steps = 0\nsteps = 2\ntimeout_s = 180\n')
    return load_workload(root)


def test_npu_run_without_torch_npu_gets_the_emulation(tmp_path, fresh_probe_cache):
    result = run_workload(_probe_workload(tmp_path / "wl"), backend="npu")
    assert result.ok, result.failure
    seen = _probe_report(result)
    assert seen["emulated"] and Path(seen["torch_npu_file"]).is_relative_to(emulation_path())
    assert seen["npu_imported_first"], "the harness imports torch_npu before the entry's module"
    assert seen["device"] == "npu" and seen["tensor_device"] == "npu:0"  # the stand-in's real npu device type
    assert seen["task_queue"] == "2" and seen["affinity"] == "1"
    assert result.versions["torch_npu"].endswith("(emulated)") and result.versions["torch_npu_mode"] == "emulated"
    assert result.versions["torch_npu_compile"] == "emulated"
    assert len(result.losses) == 2 and result.losses[1] < result.losses[0]


def test_npu_run_prefers_a_usable_real_torch_npu(tmp_path, monkeypatch, fresh_probe_cache):
    root = _fake_torch_npu(tmp_path / "site", """
        __version__ = '%s'
        import torch
        from . import npu
        torch.utils.rename_privateuse1_backend("npu")
        torch._register_device_module("npu", npu)
    """ % TORCH_RELEASE, npu=_DEVICE_NPU.format(available=True, count=1) + """
    def synchronize(device=None):
        pass
    def reset_peak_memory_stats(device=None):
        pass
    def max_memory_allocated(device=None):
        return 1234
    """)
    monkeypatch.setenv("PYTHONPATH", f"{emulation_path()}:{root}")  # the stand-in first: the real one must still win
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", "/opt/fake-cann")
    assert backends.npu_selection().mode == "real"
    assert availability("npu").available
    result = run_workload(_probe_workload(tmp_path / "wl"), backend="npu")
    assert result.ok, result.failure
    seen = _probe_report(result)
    assert not seen["emulated"] and Path(seen["torch_npu_file"]).is_relative_to(root)
    assert str(emulation_path()) not in seen["pythonpath"].split(":")
    assert seen["ascend_home"] == "/opt/fake-cann" and seen["task_queue"] == "2"
    assert result.versions["torch_npu"] == TORCH_RELEASE and result.versions["torch_npu_mode"] == "real"
    assert result.versions["torch_npu_compile"] == "no_backend"  # the fake registers no dynamo backend
    assert result.peak_memory_bytes == 1234


def _train_two_steps(example: str, backend: str):
    workload = load_workload(EXAMPLES / example).with_overrides(steps=2, warmup_steps=0, timeout_s=600)
    return run_workload(workload, backend=backend)


@pytest.fixture(scope="module")
def trained():
    """`trained(example, backend)`: two steps of an example in a sandbox child, run once per module (the tests below
    read the same runs)."""
    runs = {}

    def get(example: str, backend: str):
        if (example, backend) not in runs:
            runs[example, backend] = _train_two_steps(example, backend)
        return runs[example, backend]

    return get


def test_an_example_trains_on_device_npu_under_emulation(fresh_probe_cache, trained):
    result = trained("resnet_classify", "npu")
    assert result.ok, result.failure
    assert result.device == "npu" and result.versions["torch_npu_mode"] == "emulated"
    assert len(result.losses) == 2 and all(math.isfinite(v) for v in result.losses)
    assert result.losses[1] < result.losses[0]
    # every timed step's NPU kernels, counted on the emulated device (forward, backward and optimizer of a ResNet:
    # far more than a handful; after the first step, whose optimizer creates its state, the same each step)
    assert len(result.device_kernels_per_step) == len(result.inner_step_times_s) >= 3  # a cool-down step too
    assert result.kernels_per_step > 100 and len(set(result.device_kernels_per_step[1:])) == 1
    assert trained("resnet_classify", "cpu").kernels_per_step is None  # nothing counts on the CPU


@pytest.mark.slow
@pytest.mark.parametrize("example", ["resnet_classify", "llama_pretrain", "gpt2_pretrain", "clip_pretrain"])
def test_every_example_trains_on_device_npu_under_emulation_like_on_the_cpu(example, fresh_probe_cache, trained):
    on_npu, on_cpu = trained(example, "npu"), trained(example, "cpu")
    assert on_npu.ok, on_npu.failure
    assert on_npu.versions["torch_npu_mode"] == "emulated" and "torch_npu" not in on_cpu.versions
    assert len(on_npu.losses) == 2 and all(math.isfinite(v) for v in on_npu.losses)
    assert on_npu.losses == pytest.approx(on_cpu.losses, rel=1e-5, abs=1e-6)  # npu mapped onto the CPU: the same math
    assert on_npu.kernels_per_step > 50 and on_cpu.kernels_per_step is None  # counted on the emulated device only


# --- torch.compile(backend="npu"): TorchAir or silent eager ------------------------------------------

@pytest.fixture
def dynamo_registry():
    from torch._dynamo.backends import registry

    saved = {name: dict(d) for name, d in (("backends", registry._BACKENDS), ("fns", registry._COMPILER_FNS))}
    added: list[str] = []
    yield added
    registry._BACKENDS.clear()
    registry._BACKENDS.update(saved["backends"])
    registry._COMPILER_FNS.clear()
    registry._COMPILER_FNS.update(saved["fns"])
    for name in added:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


_DYNAMO = '''
from torch._dynamo.backends import registry as _registry


def _eager_npu_backend(gm, *args, **kwargs):
    return gm


def _graph_backend(gm, example_inputs):
    def compiled(*args):
        return gm(*args)
    return compiled


_registry._COMPILER_FNS.pop("npu", None)
_registry._BACKENDS.pop("npu", None)
_registry.register_backend({registered}, "npu")
'''


def _fake_npu_module(tmp_path: Path, added: list[str], name: str, *, registered: str | None, torchair: bool):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '2.13.0'\n")
    if registered is not None:
        (pkg / "dynamo").mkdir()
        (pkg / "dynamo" / "__init__.py").write_text(_DYNAMO.format(registered=registered))
        if torchair:
            (pkg / "dynamo" / "torchair").mkdir()
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    added.append(name)
    spec.loader.exec_module(module)
    return module


def test_torch_npu_without_torchair_is_detected_as_eager_fallback(tmp_path, dynamo_registry):
    module = _fake_npu_module(tmp_path, dynamo_registry, "fake_npu_no_torchair", registered="_eager_npu_backend", torchair=False)
    status = npu_compile_status(module)
    assert not status.compiles and status.cause == "eager_fallback"
    assert "without TorchAir" in status.reason and "silently runs eager" in status.reason
    assert str(tmp_path / "fake_npu_no_torchair" / "dynamo" / "torchair") in status.reason


def test_torch_npu_with_torchair_compiles_and_the_behavioural_check_agrees(tmp_path, dynamo_registry):
    module = _fake_npu_module(tmp_path, dynamo_registry, "fake_npu_torchair", registered="_graph_backend", torchair=True)
    assert npu_compile_status(module).compiles
    status = npu_compile_status(module, behavioural=True)
    assert status.compiles and status.cause == "graph_compiler"


def test_eager_backend_registered_despite_a_torchair_folder_is_still_eager(tmp_path, dynamo_registry):
    module = _fake_npu_module(tmp_path, dynamo_registry, "fake_npu_reregistered", registered="_eager_npu_backend", torchair=True)
    assert npu_compile_status(module).cause == "eager_fallback"


def test_a_backend_returning_the_graph_unchanged_is_caught_behaviourally(tmp_path, dynamo_registry):
    module = _fake_npu_module(tmp_path, dynamo_registry, "fake_npu_identity", registered="lambda gm, inputs: gm", torchair=True)
    assert npu_compile_status(module).compiles  # the static checks cannot see it
    status = npu_compile_status(module, behavioural=True)
    assert not status.compiles and status.cause == "eager_fallback" and "unchanged" in status.reason


def test_no_dynamo_backend_and_emulation(tmp_path, dynamo_registry):
    module = _fake_npu_module(tmp_path, dynamo_registry, "fake_npu_no_dynamo", registered=None, torchair=False)
    assert npu_compile_status(module).cause == "no_backend"
    emulated = types.SimpleNamespace(__trainbridge_emulated__=True, __file__=str(tmp_path / "x.py"), __name__="torch_npu")
    assert npu_compile_status(emulated).cause == "emulated"


# --- torch_npu.profiler capture, with a fake profiler module ---------------------------------------

def _fake_profiler(calls: dict, *, writes: bool = True) -> types.SimpleNamespace:
    class ProfilerActivity:
        CPU, NPU = "CPU", "NPU"

    class ProfilerLevel:
        Level0, Level1, Level2 = "Level0", "Level1", "Level2"

    class AiCMetrics:
        AiCoreNone, PipeUtilization = "AiCoreNone", "PipeUtilization"

    class ExportType:
        Text, Db = "text", "db"

    class _ExperimentalConfig:
        def __init__(self, **kwargs):
            calls["experimental"] = kwargs

    def schedule(**kwargs):
        calls["schedule"] = kwargs
        return kwargs

    def tensorboard_trace_handler(dir_name, **kwargs):
        def ready(prof):
            calls["ready"] = calls.get("ready", 0) + 1
            if writes:
                shutil.copytree(PROFILER_FIXTURE, Path(dir_name) / PROFILER_FIXTURE.name)
        return ready

    class profile:
        def __init__(self, **kwargs):
            calls["profile"] = kwargs
            self.kwargs, self.steps = kwargs, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def step(self):  # the trace is ready when the schedule's active phase ends
            self.steps += 1
            s = self.kwargs["schedule"]
            if self.steps == s["skip_first"] + s["wait"] + s["warmup"] + s["active"]:
                self.kwargs["on_trace_ready"](self)

        def export_chrome_trace(self, path):
            raise AssertionError("export_chrome_trace writes no step_trace_time.csv: never use it")

    profiler = types.SimpleNamespace(ProfilerActivity=ProfilerActivity, ProfilerLevel=ProfilerLevel, AiCMetrics=AiCMetrics,
                                     ExportType=ExportType, _ExperimentalConfig=_ExperimentalConfig, schedule=schedule,
                                     tensorboard_trace_handler=tensorboard_trace_handler, profile=profile)
    return types.SimpleNamespace(profiler=profiler, __name__="torch_npu")


def _tiny_parts(counter: list[int]) -> dict:
    spec = importlib.util.spec_from_file_location("trainbridge_test_tiny_model_npu", TESTS / "fixtures" / "eager_model" / "tiny_model.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    parts = tiny.trainbridge_entry(seed=0)
    inner = parts["train_step"]

    def counted(model, optimizer, batch):
        counter.append(1)
        return inner(model, optimizer, batch)

    return {**parts, "train_step": counted}


@pytest.mark.parametrize("attribution", [False, True])
def test_profile_capture_uses_the_documented_settings_and_feeds_the_parser(tmp_path, attribution):
    from trainbridge.tools.npu_profile.capture import profile_npu_step

    calls: dict = {}
    ran: list[int] = []
    capture = profile_npu_step(_tiny_parts(ran), tmp_path / "prof", Path("/home/dev/work/llm"), steps=2, warmup=1,
                               attribution=attribution, torch_npu_module=_fake_profiler(calls))
    profile = calls["profile"]
    assert profile["activities"] == ["CPU", "NPU"] and profile["record_shapes"] and profile["with_stack"]
    assert calls["schedule"] == {"wait": 0, "warmup": 1, "active": 2, "repeat": 1, "skip_first": 0}
    assert calls["experimental"] == {"profiler_level": "Level1" if attribution else "Level0",
                                     "aic_metrics": "PipeUtilization" if attribution else "AiCoreNone", "export_type": "text"}
    assert calls["ready"] == 1 and len(ran) == 1 + 1 + 2  # caller's warm-up, profiler warm-up, active steps
    assert capture.parse_error is None and Path(capture.output_dir).name == PROFILER_FIXTURE.name
    assert len(capture.host_step_times_us) == 2 and capture.kernels_per_step == 36
    target = capture.target_profile
    assert target.backend == "npu" and target.steps_profiled == 2
    assert any(s.span.file == "model.py" and s.span.line_start == 20 for s in target.spans)
    assert capture.settings["profiler_level"] == ("Level1" if attribution else "Level0")


def test_profile_capture_reports_missing_output_and_refuses_the_emulation(tmp_path):
    from trainbridge.tools.npu_profile.capture import profile_npu_step

    calls: dict = {}
    capture = profile_npu_step(_tiny_parts([]), tmp_path / "prof", tmp_path, steps=1, warmup=0,
                               torch_npu_module=_fake_profiler(calls, writes=False))
    assert capture.output_dir is None and "wrote no *_ascend_pt" in capture.parse_error
    emulated = types.SimpleNamespace(__trainbridge_emulated__=True)
    with pytest.raises(RuntimeError, match="needs a real NPU"):
        profile_npu_step(_tiny_parts([]), tmp_path / "p2", tmp_path, torch_npu_module=emulated)


@needs_no_torch_npu
def test_capture_refuses_up_front_where_the_child_would_be_emulated(tmp_path, fresh_probe_cache):
    from trainbridge.sandbox.npu_profile import NpuProfileUnavailable, capture_npu_profile

    with pytest.raises(NpuProfileUnavailable, match="needs a real NPU: torch_npu is not installed"):
        capture_npu_profile(_probe_workload(tmp_path / "wl"), tmp_path / "prof")
    assert not (tmp_path / "prof").exists()


def test_cpu_memory_stats_are_process_sizes():
    stats = Backend("cpu").memory_stats()
    assert set(stats) == {"allocated_bytes", "peak_allocated_bytes", "reserved_bytes"}
    assert 0 < stats["allocated_bytes"] <= stats["peak_allocated_bytes"]
