"""Confinement of an exec'd sandbox child by a maintained tool: bubblewrap (`bwrap`, the engine Flatpak uses).

A child started with `child_sandbox(scratch, ...).prefix` runs in its own user, PID, mount, network, IPC and
UTS namespaces, as an unprivileged uid (`SANDBOX_UID`):
- it cannot see or signal any process outside its PID namespace: its partner, the gate, TrainBridge itself
  (and whatever it leaves running dies with it: the namespace's init is its ancestor);
- the whole filesystem is read-only to it (the installed tool, the virtual environment, site-packages, the
  user's checkout, every worktree including the baseline's, the run's state and knowledge base), except its
  own scratch folder (its outputs) and its side's own folder (`cache_dir`: one per workload root, so the
  baseline's and the candidate's are different folders, and a side's survives its rounds);
- HOME, TMPDIR and the compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) are in its side's folder, the
  same paths in every round (nothing in a child's environment tells one round from another: the red team's
  sniffer); its /dev/shm is its own empty tmpfs. PYTHONPYCACHEPREFIX is not set: a prefix makes Python ignore
  every `__pycache__` beside its sources, torch's included, and recompile them in every child (a measure of the
  tiny workload took 16-20 s instead of 6); the bytecode a child could be fooled by is in folders it cannot
  write, and the gate compares the baseline's worktree, `__pycache__` included, before and after each round;
- its network namespace has only a loopback device (torchrun's ranks inside one child still meet on it).
/tmp stays the host's, read-only: a program that writes a temporary file goes through TMPDIR (tempfile does).

Where bubblewrap is missing or the host refuses user namespaces, `child_sandbox` falls back to the network
isolation of sandbox/isolation.py and says so in its notes; `TRAINBRIDGE_CONFINE=0` asks for that fallback
(debugging only). Fork servers (sandbox/child/fork_server.py) are not started under bubblewrap: their forked
children must stay the gate's own children (a subreaper waits for them), which a PID namespace forbids. Each forked
child confines itself instead, to the same writable places (sandbox/child/self_confinement.py).
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.isolation import network_isolation
from trainbridge.settings import settings

CONFINE_ENV = "TRAINBRIDGE_CONFINE"
SANDBOX_UID = 65534  # 'nobody' inside the child's user namespace: no privilege there, and a name in /etc/passwd
NAMESPACES = ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts")
CACHE_PREFIX = "trainbridge-cache-"
# a child's own places, set for it whether exec'd under bubblewrap or forked from a warm server (whose key ignores them:
# nothing reads them before the fork)
SIDE_ENV = ("HOME", "TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@dataclass(frozen=True)
class Sandbox:
    """How one child is started: the argv prefix, the environment entries it adds, and what it guarantees."""

    prefix: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    confined: bool = False
    network_isolated: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Tool:
    path: str | None
    usable: bool
    reason: str


def _base_args(path: str, devices: bool) -> list[str]:
    return [path, *NAMESPACES, "--ro-bind", "/", "/", *(("--dev-bind", "/dev", "/dev") if devices else ("--dev", "/dev")),
            "--tmpfs", "/dev/shm", "--proc", "/proc", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]


def wanted() -> bool:
    """False when confinement was turned off (`TRAINBRIDGE_CONFINE=0`, debugging only)."""
    return settings().CONFINE


@functools.cache
def bubblewrap() -> Tool:
    """Whether bubblewrap is installed and this host lets it make the namespaces (probed once per process)."""
    if not wanted():
        return Tool(None, False, f"{CONFINE_ENV}=0")
    path = shutil.which("bwrap")
    if path is None:
        return Tool(None, False, "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)")
    try:
        probe = proc_watch.run_reaping([*_base_args(path, False), "--", "true"], timeout=30)  # no zombie left
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Tool(path, False, f"bubblewrap could not run: {exc}")
    if probe.returncode != 0:
        return Tool(path, False, "this host refuses bubblewrap's namespaces (enable unprivileged user namespaces: "
                    f"sysctl kernel.unprivileged_userns_clone=1): {probe.stderr.strip() or f'exit {probe.returncode}'}")
    return Tool(path, True, "bubblewrap")


def side_folder(root: Path | str | None) -> Path:
    """Where the side's folder of `root` is (`cache_dir` makes it)."""
    key = hashlib.sha256(str(Path(root).resolve() if root else "").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"{CACHE_PREFIX}{key}"


def cache_dir(root: Path | str | None) -> Path:
    """The side's folder of the children that run code from `root` (created on first use): a folder per
    workload root, so two sides never share one and a side's compile cache outlives its rounds."""
    folder = side_folder(root)
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def remove_side(root: Path | str | None) -> None:
    """Remove the side's folder of `root` (a judged candidate's: nothing runs its code again)."""
    shutil.rmtree(side_folder(root), ignore_errors=True)


def side_env(root: Path | str | None) -> dict[str, str]:
    """A child's HOME, TMPDIR and compile caches, in the folder of the side that runs `root` (made now: ours, and
    the child's, whose uid maps to ours)."""
    cache = cache_dir(root)
    env = {"HOME": str(cache / "home"), "TMPDIR": str(cache / "tmp"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    for folder in env.values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    return env


def child_sandbox(scratch: Path, *, root: Path | str | None = None, backend: str = "cpu",
                  evidence: Sequence[Path] = ()) -> Sandbox:
    """How to start a child whose only writable places are `scratch`, its side's folder (`root`'s) and the folders
    where the gate asked it to leave its evidence (`evidence`: the gate's scratch of this side, never the other's);
    the accelerator backends keep the host's /dev (their device nodes)."""
    env = side_env(root)
    tool = bubblewrap()
    if not tool.usable:
        fallback = network_isolation()
        return Sandbox(prefix=fallback.prefix, env=env, confined=False, network_isolated=fallback.isolated,
                       notes=[f"not confined: {tool.reason}; the child can write wherever TrainBridge can", *fallback.notes])
    writable = dict.fromkeys(str(Path(p).resolve()) for p in (scratch, cache_dir(root), *evidence))
    binds = [arg for folder in writable for arg in ("--bind", folder, folder)]
    prefix = (*_base_args(tool.path, backend != "cpu"), *binds, "--")
    return Sandbox(prefix=prefix, env=env, confined=True, network_isolated=True,
                   notes=["confined by bubblewrap: own user, PID, mount and network namespaces; writable: its own "
                          "scratch, its side's folder (HOME, TMPDIR, compile caches) and its evidence folder only"])
