"""The fork server's own side: runs INSIDE the sandbox (`python -m trainbridge.sandbox.child.fork_child --socket FD`).

It imports torch and the harness once (`PRELOAD`, and nothing that runs a torch operation: OpenMP's
thread pool must not exist before a fork), and, when its environment asks (`PREWARM_ENV`: a gate whose
workloads call torch.compile), Inductor's compile stack too (`prewarm_inductor`: 3-4 s that every
compiling child would otherwise pay before its first step), says "ready", then answers one request at a time from
the gate (sandbox/child/fork_server.py): "fork" with the child's working directory, environment, memory
cap, the program it runs (`PROGRAMS`: the harness, or the region lab's child with its request
file), and four descriptors passed over the socket (the channel's two ends, stdout, stderr). For each
it forks an intermediate process that forks the child and exits, so the child is handed to the
gate (a subreaper), and answers with the child's pid.

The child makes itself what an exec'd harness child would be before it runs any workload code:
its own session and process group, the memory cap, when the request names its writable folders its own
user and mount namespaces with everything else read-only and no capability (sandbox/child/self_confinement.py;
it exits with `CONFINE_FAILED` rather than run unconfined), else its own empty /dev/shm where the host allows a
private mount namespace (a file one child leaves there never reaches another), a seccomp filter that
refuses stop signals to any process but itself, ptrace and cross-process memory access
(sandbox/child/signal_filter.py: it is not in a PID namespace of its own), stdin from
/dev/null, stdout and stderr to the gate's files, the channel at the numbers every child gets
(1000/1001), every other descriptor closed (the server's socket among them), the workload's
working directory, environment (replaced as a whole) and `sys.path[0]` (its directory, as
``python -m`` sets it), and argv as the exec'd harness sees it. Its name in a process listing
(/proc/PID/comm) becomes `CHILD_NAME`; its /proc cmdline stays the server's. Then it runs the harness.

The server never runs workload code and never reads anything from a child, so nothing a child
does reaches the server or a later child.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import json
import os
import resource
import signal
import socket
import sys
import tempfile
import traceback

from trainbridge.sandbox.child import self_confinement, signal_filter

PRELOAD = ("torch", "torch._dynamo", "torch.optim", "trainbridge.sandbox.harness", "trainbridge.sandbox.child.step_server", "trainbridge.sandbox.child.channel",
           "trainbridge.sandbox.guard", "trainbridge.sandbox.numerics_probe", "trainbridge.sandbox.backends",
           "trainbridge.sandbox.script.hooks", "trainbridge.sandbox.script.overrides", "trainbridge.sandbox.region_bench",
           "trainbridge.sandbox.evidence")
# what a forked child may run, by the name a request gives: the harness (on its channel), or the region lab's child
# (on a request file, agents/profiler/region_lab.py); a request naming anything else is refused
PROGRAMS = {"harness": "trainbridge.sandbox.harness", "region_bench": "trainbridge.sandbox.region_bench"}
PREWARM_ENV = "TRAINBRIDGE_FORK_PREWARM"  # "inductor": the server also readies Inductor's compile stack once
INDUCTOR_PRELOAD = ("torch._inductor.compile_fx", "torch._inductor.codecache", "torch._functorch.aot_autograd")
_FDS = ("command", "reply", "stdout", "stderr")
CONFINE_FAILED = 125  # a forked child's exit code when it could not confine itself (it ran nothing)
CHILD_NAME = "tb-harness"  # a forked child's name in /proc/PID/comm and `ps -o comm` (its cmdline stays the server's)
_PR_SET_NAME = 15


def name_process(name: str) -> bool:
    """Set this process's name (/proc/PID/comm, at most 15 bytes); False where the host refuses."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_child(request: dict, fds: list[int]) -> None:
    """Turn this freshly forked process into a harness child and run it; never returns."""
    code = 1
    try:
        os.setsid()
        name_process(CHILD_NAME)  # tells a forked child from its server in a process listing
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        limit_mb = request.get("memory_limit_mb")
        if limit_mb is not None:
            limit = int(limit_mb) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        writable = request.get("writable")
        if writable is not None:  # the gate asked for a confined child: it runs confined or not at all
            try:
                self_confinement.confine([str(w) for w in writable])
            except self_confinement.ConfinementError as exc:
                os.write(fds[3], f"this forked child could not confine itself ({exc}); nothing of the workload ran\n".encode())
                os._exit(CONFINE_FAILED)
        else:
            self_confinement.private_shm()
        if not signal_filter.install():
            print("note: no seccomp signal filter on this host: this forked child could stop or trace other processes "
                  "(the gate still watches for it)", file=sys.stderr, flush=True)
        command, reply, stdout, stderr = fds
        read_fd, write_fd = (int(n) for n in request["channel"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.dup2(command, read_fd)
        os.dup2(reply, write_fd)
        low, high = sorted((read_fd, write_fd))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, _max_fd())
        cwd = str(request["cwd"])
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["env"].items()})
        refresh_cached_paths()
        sys.path[0] = os.getcwd()  # what `python -m` puts first: the working directory
        program = sys.modules[PROGRAMS[request.get("program", "harness")]]
        args = (["--channel", f"{read_fd},{write_fd}"] if program.__name__ == PROGRAMS["harness"]
                else [str(a) for a in request.get("args", [])])
        sys.argv = [program.__file__, *args]
        code = program.main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child's own crash, reported on its stderr as an exec'd child's would be
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        os._exit(code)


def refresh_cached_paths() -> None:
    """Paths the server worked out from its own environment at import (its TMPDIR is its scratch, shared by every
    child it forks), worked out again from the child's: tempfile's cached temp folder, and the module-level folders
    torch derives from it (Inductor's precompiled headers, Dynamo's package cache, the compiled-module profile).
    Without this, children of both sides would share those folders; a confined child cannot write them at all."""
    tempfile.tempdir = None
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None and hasattr(codecache, "_HEADER_DIR"):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        codecache._HEADER_DIR = os.path.join(default_cache_dir(), "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")
    package = sys.modules.get("torch._dynamo.package")
    if package is not None and hasattr(package, "DynamoCache") and hasattr(package, "DiskDynamoCache"):
        package.DynamoCache = package.DiskDynamoCache(os.path.join(package.cache_dir(), "dynamo"))
    benchmark = sys.modules.get("torch._inductor.wrapper_benchmark")
    if benchmark is not None and hasattr(benchmark, "PROFILE_DIR"):
        benchmark.PROFILE_DIR = tempfile.gettempdir()
        benchmark.PROFILE_PATH = f"{benchmark.PROFILE_DIR}/compiled_module_profile.json"


def _max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 65536


def fork_one(request: dict, fds: list[int]) -> int:
    """Fork the child through an intermediate that exits at once (so the child is handed to the
    gate); the child's pid."""
    read_end, write_end = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(read_end)
            child = os.fork()
            if child == 0:
                os.close(write_end)
                become_child(request, fds)
            os.write(write_end, str(child).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    while chunk := os.read(read_end, 64):
        data += chunk
    os.close(read_end)
    os.waitpid(intermediate, 0)
    return int(data)


def prewarm_inductor() -> str:
    """Ready what a child's first torch.compile call pays for in every process, Inductor's cache hits
    included (measured on llama's regional compile, warm cache: 2.0 s of imports, 0.3 s hashing torch's
    sources for the cache key, 0.6 s probing the CPU's vector ISA in a subprocess): the imports, the
    key and the ISA, all cached per process and inherited by a fork. None of it runs a torch operation
    in this process (the ISA probe builds and loads its test in a subprocess). Returns the ISA's name."""
    for name in INDUCTOR_PRELOAD:
        importlib.import_module(name)
    from torch._inductor.codecache import torch_key
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    torch_key()
    return str(pick_vec_isa() or "none")


def serve(sock: socket.socket) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    ready: dict = {"op": "ready"}
    if os.environ.get(PREWARM_ENV) == "inductor":
        try:
            ready["prewarmed"] = f"inductor (vector ISA {prewarm_inductor()})"
        except Exception as exc:  # noqa: BLE001 - said in the ready message; each child then pays for it as before
            ready["prewarm_error"] = f"{type(exc).__name__}: {exc}"[:500]
    sys.stdout.flush()
    sys.stderr.flush()
    ready["private_shm"] = self_confinement.in_throwaway(self_confinement.private_shm) is None
    ready["confine_error"] = self_confinement.probe([os.getcwd()])  # None: its children can confine themselves
    sock.send(json.dumps(ready).encode())
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, len(_FDS))
        except ConnectionResetError:
            return
        if not data:
            return  # the gate closed its end: done
        try:
            request = json.loads(data)
            if request.get("op") != "fork" or len(fds) != len(_FDS):
                raise ValueError(f"expected a fork request with {len(_FDS)} descriptors, got {request.get('op')!r} with {len(fds)}")
            if request.get("program", "harness") not in PROGRAMS:
                raise ValueError(f"no program {request.get('program')!r} to run: choose one of {', '.join(PROGRAMS)}")
            reply = {"op": "forked", "pid": fork_one(request, fds)}
        except Exception as exc:  # noqa: BLE001 - answered to the gate, which falls back to exec
            reply = {"op": "error", "message": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(reply).encode())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--socket":
        print("usage: python -m trainbridge.sandbox.child.fork_child --socket FD", file=sys.stderr)
        return 2
    serve(socket.socket(fileno=int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
