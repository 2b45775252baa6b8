"""The gate's fork server (sandbox/child/fork_server.py, sandbox/child/fork_child.py): children forked from a warm
server see what an exec'd child sees (environment, working directory, sys.path, thread settings,
descriptors, session, memory cap), are the gate's own children, and stay fresh: state one child
plants (a module global, torch's default dtype, a global hook, the seed, the thread count, the
environment, a file in /dev/shm) never reaches another."""

from __future__ import annotations

import json
import os
import textwrap
import uuid
from pathlib import Path

import pytest

from trainbridge.agents.profiler.gate import GateError, run_gate
from trainbridge.sandbox.child import fork_server
from trainbridge.sandbox import confinement
from trainbridge.sandbox.confinement import SIDE_ENV
from trainbridge.tests.host import env_probe_report
from trainbridge.sandbox.runner import run_workload, run_workload_pair
from trainbridge.sandbox.child.step_driver import StepPlan
from trainbridge.sandbox.workload import load_workload

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the fork server needs Linux")

TOML = 'entry = "step:build"\nwarmup_steps = 1\nsteps = 2\nthreads = 2\ntimeout_s = 120\n'
TINY = '''
import torch


def _parts(seed, step_hook=None):
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs = torch.randn(32, 8, generator=generator)

    def batch(step):
        return inputs[(step * 8) % 24:(step * 8) % 24 + 8]

    def loss_fn(model, x):
        return (model(x) ** 2).mean()

    def train_step(model, optimizer, x):
        if step_hook is not None:
            step_hook()
        optimizer.zero_grad()
        loss = loss_fn(model, x)
        loss.backward()
        optimizer.step()
        return loss

    return {"model": model, "optimizer": optimizer, "batch": batch, "loss_fn": loss_fn, "train_step": train_step}
'''
OBSERVER = TINY + '''
import os, sys, resource, json

TOKEN = __TOKEN__


def observe(seed):
    seen = {
        "env": dict(os.environ), "cwd": os.getcwd(), "sys_path": sys.path, "argv": sys.argv,
        "threads": torch.get_num_threads(), "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
        "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0], "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "stdin": os.readlink("/proc/self/fd/0"),
    }
    leaks = []
    if hasattr(torch, "_trainbridge_leak"):
        leaks.append("a module global in torch")
    if torch.get_default_dtype() != torch.float32:
        leaks.append(f"default dtype {torch.get_default_dtype()}")
    if torch.nn.modules.module._global_forward_hooks:
        leaks.append("a global forward hook")
    if torch.initial_seed() != seed:
        leaks.append(f"the seed {torch.initial_seed()} (the gate's: {seed})")
    if torch.get_num_threads() != int(os.environ["OMP_NUM_THREADS"]):
        leaks.append(f"{torch.get_num_threads()} threads")
    if "TRAINBRIDGE_LEAK" in os.environ:
        leaks.append("an environment variable")
    if os.path.exists(f"/dev/shm/trainbridge-leak-{TOKEN}"):
        leaks.append("a file in /dev/shm")
    if "tb_leaker_module" in sys.modules:
        leaks.append("the other workload's module")
    seen["leaks"] = leaks
    return seen


def build(device, seed):
    print("TB-OBSERVED " + json.dumps(observe(seed)), flush=True)  # its stdout: an exec'd child writes nowhere else

    def check():
        leaks = observe(seed)["leaks"]
        if leaks:
            raise RuntimeError("leak seen: " + "; ".join(leaks))

    check()
    return _parts(seed, step_hook=check)
'''
LEAKER = TINY + '''
import os, sys

TOKEN = __TOKEN__
sys.modules["tb_leaker_module"] = sys.modules[__name__]


def plant():
    torch._trainbridge_leak = True
    torch.set_default_dtype(torch.float64)
    torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    os.environ["TRAINBRIDGE_LEAK"] = "1"
    with open(f"/dev/shm/trainbridge-leak-{TOKEN}", "w") as handle:
        handle.write("left here")


def build(device, seed):
    parts = _parts(seed)
    plant()
    torch.set_default_dtype(torch.float32)  # its own parts still in float32; the rest stays planted
    return parts
'''


def _fill(template: str, *, token: str) -> str:
    return template.replace("__TOKEN__", repr(token))


def observed(result) -> dict:
    """What the OBSERVER workload printed at its start (the last such line of its stdout)."""
    lines = [line for line in result.stdout_tail.splitlines() if line.startswith("TB-OBSERVED ")]
    assert lines, f"the observer printed nothing: {result.stdout_tail[-500:]}"
    return json.loads(lines[-1][len("TB-OBSERVED "):])


def _workload(root: Path, source: str) -> Path:
    root.mkdir(parents=True)
    (root / "trainbridge.toml").write_text(TOML, encoding="utf-8")
    (root / "step.py").write_text(textwrap.dedent(source), encoding="utf-8")
    return root


@pytest.fixture
def token():
    value = uuid.uuid4().hex
    yield value
    Path(f"/dev/shm/trainbridge-leak-{value}").unlink(missing_ok=True)


def test_a_forked_child_sees_what_an_exec_child_sees(tmp_path, token):
    seen = {}
    for kind in ("exec", "fork-server"):
        root = _workload(tmp_path / kind / "repo", _fill(OBSERVER, token=token))
        with fork_server.serving(kind) as pool:
            result = run_workload(load_workload(root), mode="measure")
            assert result.failure is None, result.failure
            assert len(result.step_times_s) == 2 and result.timing_source == "parent"
            if pool is not None:
                assert pool.forked == 1 and not pool.fallbacks  # it really was forked
        seen[kind] = observed(result)
        seen[kind]["root"] = str(root)
    exec_, forked = seen["exec"], seen["fork-server"]
    # the workload's scrubbed environment, as a whole; each child's own HOME, TMPDIR and compile caches (its scratch's)
    # (and PWD, which bubblewrap sets for an exec'd child as a shell would)
    own = (*SIDE_ENV, "PWD")
    assert set(forked["env"]) - {"PWD"} == set(exec_["env"]) - {"PWD"} >= set(SIDE_ENV)
    assert {k: v for k, v in forked["env"].items() if k not in own} == {k: v for k, v in exec_["env"].items() if k not in own}
    assert forked["env"]["OMP_NUM_THREADS"] == "2" and forked["threads"] == exec_["threads"] == 2
    for record in (exec_, forked):
        assert record["cwd"] == record["root"] and record["sys_path"][0] == record["root"]
        if record is exec_ and confinement.bubblewrap().usable:
            # its own PID namespace: its session and group are led by bubblewrap's outer process (started in a session
            # of its own, killed as a group), outside the namespace, which it sees as 0
            assert record["pgid"] == record["sid"] == 0 and record["pid"] < 10
        else:
            assert record["pgid"] == record["pid"] == record["sid"]  # its own session and process group
        assert record["stdin"] == "/dev/null"
        assert record["leaks"] == []
    # the rest of sys.path (the interpreter's, the venv's) is the same; the server's folder is nowhere
    assert forked["sys_path"][1:] == exec_["sys_path"][1:]
    assert forked["rlimit_as"] == exec_["rlimit_as"] > 0
    assert forked["argv"][1:] == exec_["argv"][1:] and Path(forked["argv"][0]).name == "harness.py"
    # the channel at the same fixed numbers, and no other descriptor (the server's socket is closed)
    assert [fd for fd in forked["fds"] if fd > 2] == [fd for fd in exec_["fds"] if fd > 2]


def test_a_forked_child_is_in_the_sandboxs_network_namespace_as_an_exec_child_is(tmp_path):
    """The server starts under the network isolation prefix, so every child it forks is in its empty
    namespace (only its own loopback), and the result says so as an exec'd child's does."""
    import socket

    from trainbridge.sandbox.isolation import network_isolation

    isolation = network_isolation()
    seen = {}
    for kind in ("exec", "fork-server"):
        with fork_server.serving(kind) as pool:
            result = run_workload(load_workload(Path(__file__).parent / "fixtures" / "workloads" / "env_probe"))
            assert result.ok, result.failure
            if pool is not None:
                assert pool.forked == 1 and not pool.fallbacks and pool.prefix == isolation.prefix
        assert result.network_isolated == isolation.isolated
        seen[kind] = env_probe_report(result)["interfaces"]
    expected = ["lo"] if isolation.isolated else sorted(name for _, name in socket.if_nameindex())
    assert seen == {"exec": expected, "fork-server": expected}


def test_a_leak_planted_by_one_arm_never_reaches_the_other(tmp_path, token):
    observer = load_workload(_workload(tmp_path / "observer", _fill(OBSERVER, token=token)))
    leaker = load_workload(_workload(tmp_path / "leaker", _fill(LEAKER, token=token)))
    plans = (StepPlan.sequential(1, 2), StepPlan.sequential(1, 2))
    with fork_server.serving("fork-server") as pool:
        # both arms alive at once (the gate's paired round), the leaker first; then one after the other
        led, observed_pair = run_workload_pair((leaker, observer), plans)
        assert led.failure is None and observed_pair.failure is None, observed_pair.failure
        assert run_workload(leaker, mode="measure").failure is None
        after = run_workload(observer, mode="measure")
        assert after.failure is None, after.failure
        assert pool.forked == 4 and not pool.fallbacks
        private_shm = all(server.private_shm for server in pool.servers.values())
    assert observed(observed_pair)["leaks"] == observed(after)["leaks"] == []
    if private_shm:  # each child had its own /dev/shm: the leaker's file never reached the host's either
        assert not Path(f"/dev/shm/trainbridge-leak-{token}").exists()


def test_the_observer_does_see_a_leak_in_its_own_process(tmp_path, token):
    """The control: the same checks fire when the leak is in the observer's own process."""
    root = _workload(tmp_path / "both", _fill(OBSERVER, token=token))
    (root / "leaker.py").write_text(textwrap.dedent(_fill(LEAKER, token=token)), encoding="utf-8")
    step = root / "step.py"
    step.write_text(step.read_text() + "\n\n_build = build\n\ndef build(device, seed):\n    import leaker\n    leaker.plant()\n"
                    "    torch.set_default_dtype(torch.float64)\n    return _build(device, seed)\n", encoding="utf-8")
    with fork_server.serving("fork-server"):
        result = run_workload(load_workload(root), mode="measure")
    assert result.failure is not None and "leak seen" in result.failure.message
    for kind in ("a module global in torch", "default dtype", "a global forward hook", "the seed", "1 threads",
                 "an environment variable", "a file in /dev/shm", "the other workload's module"):
        assert kind in result.failure.message


def test_the_parent_still_kills_a_forked_child_on_timeout(tmp_path):
    root = _workload(tmp_path / "hang", TINY + "\nimport time\n\ndef build(device, seed):\n    time.sleep(600)\n")
    (root / "trainbridge.toml").write_text(TOML.replace("timeout_s = 120", "timeout_s = 3"), encoding="utf-8")
    with fork_server.serving("fork-server") as pool:
        result = run_workload(load_workload(root), mode="measure")
        assert pool.forked == 1
    assert result.failure is not None and result.failure.kind == "timeout"


def test_spawn_kind_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.delenv(fork_server.SPAWN_ENV, raising=False)
    assert fork_server.default_spawn("cpu") == "fork-server" and fork_server.default_spawn("npu") == "exec"
    monkeypatch.setenv(fork_server.SPAWN_ENV, "exec")
    assert fork_server.default_spawn("cpu") == "exec"
    monkeypatch.setenv(fork_server.SPAWN_ENV, "vfork")
    with pytest.raises(GateError, match="TRAINBRIDGE_GATE_SPAWN"):
        run_gate(load_workload(Path(__file__).parent / "fixtures" / "workloads" / "tiny"),
                 load_workload(Path(__file__).parent / "fixtures" / "workloads" / "tiny"))
    with fork_server.serving("exec") as pool:
        assert pool is None and fork_server.active() is None


def test_a_pool_stays_warm_across_gates_only_inside_a_runs_scope():
    """Inside `warm_scope` (a run) the next gate's `serving(keep_warm=True)` finds the same pool and its
    started servers; the scope's end stops them. Outside a scope nothing outlives the block, so a library
    caller (or a test) never finds servers it did not ask to keep."""
    with fork_server.serving("fork-server", keep_warm=True) as alone:
        pass
    assert alone is not fork_server._WARM.get(()) and not fork_server._WARM
    with fork_server.warm_scope():
        with fork_server.serving("fork-server", keep_warm=True) as first:
            server = ForkServerProbe.start(first)
        with fork_server.serving("fork-server", keep_warm=True) as second:
            assert second is first and server.process.poll() is None  # still running for the next gate
    assert server.process.wait(timeout=10) is not None and not fork_server._WARM


class ForkServerProbe:
    """Starts one server in a pool the way a forked child would, without running a workload."""

    @staticmethod
    def start(pool):
        env = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
        server = fork_server.ForkServer.start(pool.prefix, env, pool.scratch)
        pool.servers[("probe",)] = server
        return server


COMPILING = TINY.replace("def _parts(seed, step_hook=None):", '''@torch.compile(dynamic=False)
def squash(x):
    return torch.tanh(x) * x + 0.5 * x


def _parts(seed, step_hook=None):''').replace("return (model(x) ** 2).mean()", "return (squash(model(x)) ** 2).mean()") + '''

def build(device, seed):
    return _parts(seed)
'''


def test_a_workload_that_compiles_asks_for_a_prewarmed_server_and_one_that_does_not_does_not(tmp_path):
    compiling = _workload(tmp_path / "compiling", COMPILING)
    nested = tmp_path / "nested"
    (nested / "pkg").mkdir(parents=True)
    (nested / "pkg" / "model.py").write_text("import torch\nnet = torch.nn.Linear(2, 2)\nnet.compile()\n", encoding="utf-8")
    hidden = tmp_path / "hidden"
    (hidden / ".venv" / "lib").mkdir(parents=True)
    (hidden / ".venv" / "lib" / "x.py").write_text("import torch\ntorch.compile(lambda x: x)\n", encoding="utf-8")
    eager = _workload(tmp_path / "eager", TINY + "\nimport re\nPATTERN = re.compile('x')\n\ndef build(device, seed):\n    return _parts(seed)\n")
    assert fork_server.prewarm_env([compiling]) == {fork_server.PREWARM_ENV: "inductor"}
    assert fork_server.prewarm_env([eager, nested]) == {fork_server.PREWARM_ENV: "inductor"}  # model.compile()
    assert fork_server.prewarm_env([eager, hidden]) == {}  # re.compile is not torch's; a virtual environment is not the workload


@pytest.mark.slow
def test_a_prewarmed_server_forks_children_that_compile_as_an_exec_child_does(tmp_path):
    """The server readies Inductor (imports, cache key, vector ISA) before any fork, without starting
    OpenMP's pool or a thread: its children compile, run on their two threads and give an exec'd
    child's losses bit for bit."""
    root = _workload(tmp_path / "compiling", COMPILING)
    env = fork_server.prewarm_env([root])
    losses = {}
    for kind in ("exec", "fork-server"):
        with fork_server.serving(kind) as pool:
            result = run_workload(load_workload(root), mode="measure", extra_env=env)
            assert result.failure is None, result.failure
            if pool is not None:
                assert pool.forked == 1 and not pool.fallbacks
                (server,) = pool.servers.values()
                assert server.prewarm_error is None and server.prewarmed.startswith("inductor (vector ISA ")
        losses[kind] = result.losses
    assert losses["fork-server"] == losses["exec"]


def test_servers_launched_ahead_serve_the_first_gate_and_a_dead_one_is_started_again(tmp_path, monkeypatch):
    """`judge.ready_servers` launches, without waiting, the servers of exactly the environments the first
    gate's children, its drift child and the region lab fork from: the gate then forks from them (no server
    started in it), and a launched server that died before its first fork is replaced, not used."""
    from trainbridge.agents.profiler import quiet
    from trainbridge.agents.profiler.judge import ready_servers

    # a host whose load is above its cores at the gate's start gives the children a passive wait policy, another
    # environment than the one launched ahead (its own servers, the launched ones evicted): the quiet host's case here
    monkeypatch.setattr(quiet, "contended_at_start", lambda *args, **kwargs: False)
    from trainbridge.agents.profiler.region_lab import lab_env
    from trainbridge.sandbox.runner import child_env

    root = _workload(tmp_path / "repo", TINY + "\n\ndef build(device, seed):\n    return _parts(seed)\n")
    workload = load_workload(root)
    assert ready_servers(root, target="cpu") == 0  # outside a run's scope nothing would outlive the call
    with fork_server.warm_scope():
        assert ready_servers(root, target="cpu") == 2  # the gate's two threads; one thread: the drift child and the lab
        (pool,) = fork_server._WARM.values()
        keys = set(pool.servers)
        assert keys == {fork_server._env_key(child_env(workload.config, "cpu")),
                        fork_server._env_key(lab_env(workload.config, "cpu")),
                        fork_server._env_key(child_env(workload.with_overrides(threads=1).config, "cpu"))}
        assert not any(server.ready for server in pool.servers.values())  # launched, not waited for
        assert ready_servers(root, target="cpu") == 0  # launched once
        launched = dict(pool.servers)
        dead = launched[fork_server._env_key(lab_env(workload.config, "cpu"))]
        os.killpg(dead.process.pid, 9)
        dead.process.wait(timeout=10)
        verdict = run_gate(workload, load_workload(root), rounds=1, max_rounds=1)
        assert verdict.spawn == "fork-server", verdict.spawn
        gate_server = launched[fork_server._env_key(child_env(workload.config, "cpu"))]
        assert pool.servers[fork_server._env_key(child_env(workload.config, "cpu"))] is gate_server
        assert gate_server.ready and gate_server.children == 2  # both sides of the round, from the launched server
        drift_server = pool.servers[fork_server._env_key(child_env(workload.with_overrides(threads=1).config, "cpu"))]
        assert drift_server is not dead and drift_server.ready and drift_server.children == 1  # started again for the drift child
    assert not fork_server._WARM
