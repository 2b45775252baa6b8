"""Fresh gate children without paying for interpreter start and `import torch` each time (parent side).

A fork server is one process, started in the sandbox exactly as a gate child would be (the
isolation prefix, the scrubbed environment, its own session), that imports torch and the harness
once and then forks a child per request (sandbox/child/fork_child.py). Each child is still a fresh
process: it starts from the server's state after its imports, never from another child's, and
nothing a child does flows back into the server (the server runs no workload code and reads
nothing from its children). A forked child is made the gate's own child: the server forks an
intermediate process that forks the child and exits at once, so the child is handed to the gate,
which is a subreaper (`proc_watch.become_subreaper`). The gate then waits for it, sees it stopped
or continued (`waitid`), kills its process group and reads its process tree exactly as for a child
it started itself.

`serving(kind)` opens a pool of servers for the duration of a gate (one per environment: the
thread settings are read by OpenMP when torch is imported, so a server serves only children whose
environment matches its own, the hash seed aside); `active()` is what sandbox/runner.py asks when
it builds an entry-mode child. `TRAINBRIDGE_GATE_SPAWN=exec` turns it off. With ``keep_warm`` (the
gate's default) inside a `warm_scope` (a run) the pool outlives the block: the next gate of the run
forks from the same servers instead of paying their start again (a server holds no state of any child, so a later
gate's children are as fresh as a later round's); it keeps at most `WARM_SERVERS` servers (the
least recently used is stopped) and is stopped by `shutdown_warm`, at the latest when the process
exits (and a server exits by itself when the process that holds its socket dies).

A gate whose workloads call torch.compile (`prewarm_env`) gives its children's environment
`fork_child.PREWARM_ENV`, so their server (one per environment) readies Inductor's compile stack once
instead of every child paying 3-4 s for it before its first step.

`prestart(envs)` launches a run's servers ahead of its first gate, without waiting for them (a run
calls it while the analyst compiles its reference, so their imports overlap that work): a server is
asked for a fork only once it has said it is ready, and one that failed to start is started again
then, as if it had never been launched.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import tempfile
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.child.fork_child import PREWARM_ENV
from trainbridge.settings import SettingsError, settings
from trainbridge.sandbox.confinement import SIDE_ENV, bubblewrap
from trainbridge.sandbox.isolation import network_isolation

SpawnKind = Literal["fork-server", "exec"]
SPAWN_KINDS: tuple[SpawnKind, ...] = ("fork-server", "exec")
SPAWN_ENV = "TRAINBRIDGE_GATE_SPAWN"
SERVER_MODULE = "trainbridge.sandbox.child.fork_child"
READY_TIMEOUT_S = 120.0  # a server's imports (torch) on a loaded machine
REPLY_TIMEOUT_S = 30.0
WARM_SERVERS = 3  # servers a kept-warm pool holds at most (each is an interpreter with torch imported)
_HASH_SEED = "PYTHONHASHSEED"  # fixed at interpreter start: a server's children share its own (both sides of a round alike)
_COMPILES = re.compile(r"\btorch\.compile\b|\.compile\(\s*\)")  # torch.compile(...), @torch.compile, model.compile()
_SCANNED_FILES = 5000  # a workload's Python files read at most, looking for a compile call
_SCANNED_BYTES = 1 << 20  # of each file
_SKIPPED_DIRS = frozenset({"site-packages", "node_modules", "__pycache__", "venv"})


def prewarm_env(roots: Iterable[Path]) -> dict[str, str]:
    """The environment entry that has a server ready Inductor (`fork_child.prewarm_inductor`) when a
    workload under one of `roots` calls torch.compile (some Python file of it names it), else {}. A
    miss costs only time: each compiling child then readies Inductor itself."""
    return {PREWARM_ENV: "inductor"} if any(_calls_compile(Path(root)) for root in roots) else {}


def _calls_compile(root: Path) -> bool:
    """Whether some Python file under `root` names a compile call: hidden folders, virtual environments
    and caches are not descended into, links are not followed, and at most `_SCANNED_FILES` files of at
    most `_SCANNED_BYTES` each are read (the worktree is the candidate's: it may be large or odd)."""
    scanned = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS]
        for name in files:
            if not name.endswith(".py"):
                continue
            scanned += 1
            if scanned > _SCANNED_FILES:
                return False
            try:
                with open(os.path.join(folder, name), "rb") as handle:
                    text = handle.read(_SCANNED_BYTES).decode("utf-8", errors="replace")
            except OSError:
                continue
            if _COMPILES.search(text):
                return True
    return False


class ForkServerError(RuntimeError):
    """A server could not be started or stopped answering."""


class CannotConfine(ForkServerError):
    """A server's children cannot confine themselves on this host, where exec'd children are confined."""


def default_spawn(backend: str) -> SpawnKind:
    """"fork-server" on the CPU, "exec" on accelerators (a device runtime does not survive fork, and
    none is attached here to prove the server safe with one). TRAINBRIDGE_GATE_SPAWN overrides."""
    try:
        chosen = settings().GATE_SPAWN
    except SettingsError as exc:
        raise ValueError(f"{exc} (choose one of {', '.join(SPAWN_KINDS)})") from None
    if chosen:
        return chosen
    return "fork-server" if backend == "cpu" and sys.platform.startswith("linux") else "exec"


class ForkedChild:
    """The `subprocess.Popen` surface the drivers use, for a child the gate did not start itself
    (it was handed over by the server's intermediate process, so the gate can wait for it)."""

    def __init__(self, pid: int, confined: bool = False):
        self.pid = pid
        self.confined = confined  # it confined itself before running anything (sandbox/child/self_confinement.py)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -9  # reaped elsewhere: its status is lost
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


@dataclass
class ForkServer:
    """One started server: its process and the socket it takes requests on."""

    process: subprocess.Popen
    sock: socket.socket
    log_path: Path
    private_shm: bool = False  # its children get their own empty /dev/shm
    prewarmed: str | None = None  # what it readied beyond its imports (fork_child.prewarm_inductor), if asked
    prewarm_error: str | None = None  # why the asked prewarm failed (its children then pay for it themselves)
    confine_error: str | None = "not ready yet"  # why its children cannot confine themselves (None: they can)
    children: int = 0
    ready: bool = False  # it said "ready" (launched servers say so later: `await_ready`)

    @classmethod
    def start(cls, prefix: tuple[str, ...], env: dict[str, str], scratch: Path) -> "ForkServer":
        """Start a server under `prefix` (network isolation) with `env`, in `scratch` (never a
        workload's folder: its sys.path[0] is replaced in each child); wait until it has imported."""
        server = cls.launch(prefix, env, scratch)
        server.await_ready()
        return server

    @classmethod
    def launch(cls, prefix: tuple[str, ...], env: dict[str, str], scratch: Path) -> "ForkServer":
        """Start a server as `start` does, without waiting for its imports (`await_ready` does)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_path = scratch / f"fork-server-{len(list(scratch.glob('fork-server-*')))}.log"
        with log_path.open("wb") as log:
            try:
                own = {k: v for k, v in env.items() if k not in SIDE_ENV}  # a child's own places are set at its fork
                process = subprocess.Popen([*prefix, sys.executable, "-m", SERVER_MODULE, "--socket", str(theirs.fileno())],
                                           cwd=scratch, env={**own, "HOME": str(scratch), "TMPDIR": str(scratch)}, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                           pass_fds=(theirs.fileno(),), start_new_session=True)
            except OSError as exc:
                ours.close()
                theirs.close()
                raise ForkServerError(f"could not start the fork server: {exc}") from exc
        theirs.close()
        return cls(process=process, sock=ours, log_path=log_path)

    def await_ready(self) -> None:
        """Wait for the server's "ready" (once); ForkServerError, the server stopped, when it does not come."""
        if self.ready:
            return
        try:
            reply = self._reply(READY_TIMEOUT_S)
        except ForkServerError:
            self.close()
            raise
        if reply.get("op") != "ready":
            self.close()
            raise ForkServerError(f"the fork server did not get ready: {reply}")
        self.ready = True
        self.private_shm = bool(reply.get("private_shm"))
        self.prewarmed, self.prewarm_error = reply.get("prewarmed"), reply.get("prewarm_error")
        self.confine_error = reply.get("confine_error", "the server did not say whether its children can confine themselves")

    def fork(self, *, cwd: Path, env: dict[str, str], fds: dict[str, int], channel: tuple[int, int],
             memory_limit_mb: int | None, program: str = "harness", args: list[str] | None = None,
             writable: Iterable[Path | str] | None = None) -> ForkedChild:
        """A fresh child running the harness on `channel` (its two descriptor numbers), or another of
        the server's `fork_child.PROGRAMS` on `args`; `fds`: the parent's descriptors for "command",
        "reply", "stdout", "stderr". With `writable`, the child confines itself, those folders its only writable
        places (sandbox/child/self_confinement.py); where it cannot and bubblewrap confines exec'd children,
        ForkServerError (the caller execs it, confined, instead); where neither can, it runs unconfined, as an
        exec'd child would."""
        names = ("command", "reply", "stdout", "stderr")
        request = {"op": "fork", "cwd": str(cwd), "env": env, "channel": list(channel), "memory_limit_mb": memory_limit_mb,
                   "program": program, "args": list(args or [])}
        confined = writable is not None and self.confine_error is None
        if writable is not None and self.confine_error is not None and bubblewrap().usable:
            raise CannotConfine(f"the fork server's children cannot confine themselves here ({self.confine_error}): "
                                "exec'd under bubblewrap instead")
        if confined:
            request["writable"] = [str(w) for w in writable]
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], [fds[n] for n in names])
        except OSError as exc:
            raise ForkServerError(f"the fork server is gone ({exc})") from exc
        reply = self._reply(REPLY_TIMEOUT_S)
        if reply.get("op") != "forked" or not isinstance(reply.get("pid"), int):
            raise ForkServerError(f"the fork server did not fork: {reply}")
        pid = reply["pid"]
        stat = proc_watch.read_stat(pid)
        if stat is None or stat.ppid != os.getpid():
            # not handed to the gate (it is not a subreaper, or the child already died): it cannot be watched
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, 9)
            raise ForkServerError(f"the forked child {pid} was not handed to this process (parent "
                                  f"{stat.ppid if stat else 'gone'})")
        self.children += 1
        return ForkedChild(pid, confined=confined)

    def _reply(self, timeout_s: float) -> dict:
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(1 << 16)
        except (OSError, TimeoutError) as exc:
            raise ForkServerError(f"no answer from the fork server ({exc}); its log: {self._log_tail()}") from exc
        if not data:
            raise ForkServerError(f"the fork server exited; its log: {self._log_tail()}")
        return json.loads(data)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-1500:] or "(empty)"
        except OSError:
            return "(unreadable)"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()  # the server exits when its socket closes
        try:
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 9)
            self.process.wait()


@dataclass
class ForkPool:
    """The servers of one gate, by environment (the hash seed aside), and what became of each request."""

    prefix: tuple[str, ...]
    scratch: Path
    servers: dict[tuple, ForkServer] = field(default_factory=dict)
    forked: int = 0
    fallbacks: list[str] = field(default_factory=list)  # why a child was exec'd instead
    max_servers: int | None = None  # the least recently used server is stopped beyond this (None: no limit)
    cannot_confine: str | None = None  # why its children cannot confine themselves here (they are exec'd instead)

    def fork(self, *, cwd: Path, env: dict[str, str], fds: dict[str, int], channel: tuple[int, int],
             memory_limit_mb: int | None, program: str = "harness", args: list[str] | None = None,
             writable: Iterable[Path | str] | None = None) -> ForkedChild | None:
        """A forked child (confined to `writable` where asked: `ForkServer.fork`), or None (the reason kept in
        `fallbacks`): the caller then starts it by exec."""
        if writable is not None and self.cannot_confine is not None:
            self.fallbacks.append(self.cannot_confine)
            return None
        key = _env_key(env)
        try:
            server = self.servers.pop(key, None)
            if server is not None:
                try:
                    server.await_ready()  # at once when ready; one launched ahead (`prestart`) that failed is stopped
                except ForkServerError:
                    server = None  # and started again below
            if server is not None and server.process.poll() is not None:
                server.close()
                server = None
            if server is None:
                self._make_room()
                server = ForkServer.start(self.prefix, env, self.scratch)
            self.servers[key] = server  # the most recently used last
            child = server.fork(cwd=cwd, env=env, fds=fds, channel=channel, memory_limit_mb=memory_limit_mb, program=program,
                                args=args, writable=writable)
        except CannotConfine as exc:  # the host's answer, not the server's fault: every later child is exec'd too
            self.cannot_confine = str(exc)[:500]
            self.fallbacks.append(self.cannot_confine)
            return None
        except ForkServerError as exc:
            self.fallbacks.append(str(exc)[:500])
            dead = self.servers.pop(key, None)
            if dead is not None:
                dead.close()
            return None
        self.forked += 1
        return child

    def prestart(self, envs: Iterable[dict[str, str]]) -> int:
        """Launch a server for each environment that has none, without waiting for it; how many were launched."""
        launched = 0
        for env in envs:
            key = _env_key(env)
            if key in self.servers:
                continue
            self._make_room()
            try:
                self.servers[key] = ForkServer.launch(self.prefix, env, self.scratch)
            except ForkServerError:
                continue  # the first fork for this environment starts it, and records why when it cannot
            launched += 1
        return launched

    def _make_room(self) -> None:
        while self.max_servers is not None and len(self.servers) >= self.max_servers:
            self.servers.pop(next(iter(self.servers))).close()  # the least recently used

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()

    def describe(self, since: int = 0) -> str:
        """The verdict's `spawn` field: how this gate's children were started (`since`: the number of
        fallbacks when the gate began, for a pool kept warm across gates)."""
        fallbacks = self.fallbacks[since:]
        if not fallbacks:
            return "fork-server"
        return f"fork-server ({len(fallbacks)} child(ren) exec'd instead: {fallbacks[0][:200]})"


_ACTIVE: list[ForkPool] = []  # the innermost `serving` pool; empty outside a gate
_WARM: dict[tuple[str, ...], ForkPool] = {}  # pools kept warm across gates, by isolation prefix
_EXIT_HOOK: list = []  # shutdown_warm, once registered with atexit
_SCOPES: list[bool] = []  # open `warm_scope` blocks


def active() -> ForkPool | None:
    return _ACTIVE[-1] if _ACTIVE else None


def _env_key(env: dict[str, str]) -> tuple:
    """Which server serves a child with `env`: the environment, its hash seed and its own places aside
    (`confinement.SIDE_ENV`: HOME, TMPDIR, compile caches, read by nothing before the fork)."""
    return tuple(sorted((k, v) for k, v in env.items() if k != _HASH_SEED and k not in SIDE_ENV))


def _warm_pool(prefix: tuple[str, ...], work_dir: Path | None) -> ForkPool:
    pool = _WARM.get(prefix)
    if pool is None:
        scratch = Path(tempfile.mkdtemp(prefix="trainbridge-warm-forkserver-", dir=work_dir))
        pool = _WARM[prefix] = ForkPool(prefix=prefix, scratch=scratch, max_servers=WARM_SERVERS)
        if not _EXIT_HOOK:
            _EXIT_HOOK.append(atexit.register(shutdown_warm))
    return pool


def prestart(envs: Iterable[dict[str, str]], *, backend: str, work_dir: Path | None = None) -> int:
    """Launch the warm pool's servers for these child environments now, in the background (see the
    module doc); how many were launched. Only inside a `warm_scope` (outside one, no pool outlives a
    gate) and when `backend`'s children are forked (`default_spawn`); at most `WARM_SERVERS`."""
    try:
        if not _SCOPES or default_spawn(backend) != "fork-server":
            return 0
    except ValueError:  # a bad TRAINBRIDGE_GATE_SPAWN: the gate itself says so
        return 0
    wanted = list({_env_key(env): env for env in envs}.values())[:WARM_SERVERS]
    return _warm_pool(tuple(network_isolation().prefix), work_dir).prestart(wanted)


@contextlib.contextmanager
def serving(kind: SpawnKind, *, prefix: tuple[str, ...] | None = None, work_dir: Path | None = None,
            keep_warm: bool = False) -> Iterator[ForkPool | None]:
    """Entry-mode children started inside this block are forked from a server (kind "fork-server")
    or exec'd as before ("exec": yields None). The servers start under `prefix` (default: the
    sandbox's network isolation, `isolation.network_isolation`, as an exec'd child's: a namespace is
    inherited across fork, so every forked child is in the server's). The servers are stopped when
    the block ends, unless `keep_warm`: then the pool stays for the next `serving(..., keep_warm=True)`
    of this process (see the module doc)."""
    if kind not in SPAWN_KINDS:
        raise ValueError(f"spawn kind {kind!r}: choose one of {', '.join(SPAWN_KINDS)}")
    if kind == "exec":
        yield None
        return
    if prefix is None:
        prefix = network_isolation().prefix
    proc_watch.become_subreaper()  # forked children are handed to this process; without it they are exec'd
    if keep_warm and _SCOPES:
        pool = _warm_pool(tuple(prefix), work_dir)
        _ACTIVE.append(pool)
        try:
            yield pool
        finally:
            _ACTIVE.remove(pool)
        return
    from trainbridge.sandbox.scratch import scratch_dir

    with scratch_dir("trainbridge-run-forkserver-", work_dir) as scratch:
        pool = ForkPool(prefix=tuple(prefix), scratch=scratch)
        _ACTIVE.append(pool)
        try:
            yield pool
        finally:
            _ACTIVE.remove(pool)
            pool.close()


@contextlib.contextmanager
def warm_scope() -> Iterator[None]:
    """Inside this block (a whole run: graph/runs.py), `serving(..., keep_warm=True)` keeps its pool for
    the next gate; the servers are stopped when the outermost block ends. Outside any block a gate's
    pool lives for that gate only, so a library caller never finds servers it did not ask to keep."""
    _SCOPES.append(True)
    try:
        yield
    finally:
        _SCOPES.pop()
        if not _SCOPES:
            shutdown_warm()


def shutdown_warm() -> None:
    """Stop every pool kept warm across gates and remove their scratch folders (at exit, or when a
    caller wants its servers gone now)."""
    while _WARM:
        _, pool = _WARM.popitem()
        pool.close()
        shutil.rmtree(pool.scratch, ignore_errors=True)


@contextlib.contextmanager
def exec_only() -> Iterator[None]:
    """Children started inside this block are exec'd even inside `serving` (benchmarks/gate_cost.py
    interleaves both kinds while one pool stays open)."""
    saved = list(_ACTIVE)
    _ACTIVE.clear()
    try:
        yield
    finally:
        _ACTIVE.extend(saved)
