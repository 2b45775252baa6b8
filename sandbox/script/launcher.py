"""Script mode's child: runs the user's script unmodified (`python -m trainbridge.sandbox.script.launcher --channel R,W`).

It lives outside the repository, like sandbox/harness.py, and speaks the same control-channel
protocol (sandbox/child/step_server.py), so sandbox/child/step_driver.py and the gate drive it unchanged. The
request (over the channel, never in argv or files) holds the parsed launch line, the overrides,
the seed, the read-only paths and the repository root. The launcher then, in this order:

1. protects the repository and the user's checkout from writes (an audit hook refuses to open a
   file for writing, or remove, rename or create anything, under them; the run's working
   directory is a scratch mirror, sandbox/script/files.py);
2. applies the overrides (sandbox/script/overrides.py) and sets argv, the working directory and
   sys.path as `python train.py ...` would;
3. puts every seeding call under the gate's seed and installs the step hooks
   (sandbox/script/hooks.py), then remembers what the guard watches (sandbox/guard.py);
4. runs the script as `__main__`; the hooks answer the parent at each step boundary, and `exit`
   ends the process right after the closing result.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

from trainbridge.sandbox.loopback import free_port as _free_port
from trainbridge.sandbox.loopback import loopback_up as _loopback_up

TRACEBACK_TAIL_CHARS = 4000
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.truncate": (0,),
                "shutil.rmtree": (0,), "os.mkdir": (0,), "os.symlink": (1,), "os.link": (1,), "os.chmod": (0,), "os.utime": (0,)}


def install_write_guard(protected: list[str], replaceable: list[str] | None = None) -> None:
    """Refuse writes under `protected` (realpaths: a symlink into them counts) with a message saying where to write.
    A file of `replaceable` (the checkout's files outside git that the run shows by itself, sandbox/script/ignored.py:
    perhaps a stale output of an earlier run) opened for writing through its link in the scratch mirror is copied on
    write instead: the link is replaced by the script's own file in scratch (with the old content when it appends or
    updates), and the checkout's file stays as it was."""
    roots = [os.path.realpath(p) for p in protected]
    sources = [os.path.realpath(p) for p in replaceable or []]
    busy: list[bool] = []

    def under(real: str, bases: list[str]) -> str | None:
        return next((base for base in bases if real == base or real.startswith(base + os.sep)), None)

    def inside(path: Any) -> str | None:
        if path is None or isinstance(path, int):
            return None
        return under(os.path.realpath(os.fsdecode(os.fspath(path))), roots)

    def copy_on_write(path: Any, mode: Any, flags: Any) -> bool:
        """Replace the mirror's link `path` to a replaceable file by a file of the script's own; True when done."""
        if not sources or path is None or isinstance(path, int):
            return False
        name = os.path.abspath(os.fsdecode(os.fspath(path)))
        if not os.path.islink(name) or inside(os.path.dirname(name)) or not under(os.path.realpath(name), sources):
            return False
        keep = (isinstance(mode, str) and ("a" in mode or "+" in mode) and "w" not in mode) or (
            isinstance(flags, int) and not flags & os.O_TRUNC and not isinstance(mode, str))
        real = os.path.realpath(name)
        busy.append(True)
        try:
            os.unlink(name)
            if keep and os.path.isfile(real):
                import shutil

                shutil.copyfile(real, name)
        finally:
            busy.pop()
        return True

    def refuse(path: Any, root: str, what: str) -> None:
        raise PermissionError(f"TrainBridge keeps {root} read-only: the script tried to {what} {os.fsdecode(os.fspath(path))!r}. "
                              "Files the script writes belong in its working directory (a scratch folder of this run); "
                              "data it reads is listed in data = [...] of trainbridge.toml")

    def hook(event: str, args: tuple) -> None:
        if busy:
            return
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and not copy_on_write(path, mode, flags):
                root = inside(path)
                if root:
                    refuse(path, root, "write")
        elif event in _PATH_EVENTS:
            for position in _PATH_EVENTS[event]:
                if position < len(args):
                    root = inside(args[position])
                    if root:
                        refuse(args[position], root, f"change ({event})")

    sys.addaudithook(hook)


def guard_torch_save() -> None:
    """torch.save(obj, path) writes through C++, unseen by Python's audit hooks: announce its path as an `open` for
    writing first, so the write guard refuses it under the worktree or the checkout, or copies a shown file on write."""
    import functools

    import torch

    original = torch.save

    @functools.wraps(original)
    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            sys.audit("open", os.fspath(f), "wb", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        return original(obj, f, *args, **kwargs)

    torch.save = save


def failure_record(kind: str, message: str, exc: BaseException | None = None, step: int | None = None) -> dict[str, Any]:
    tail = "".join(traceback.format_exception(exc))[-TRACEBACK_TAIL_CHARS:] if exc is not None else None
    return {"kind": kind, "message": message[:2000], "exception_type": type(exc).__name__ if exc is not None else None,
            "traceback_tail": tail, "step": step}


def script_code(spec: dict[str, Any], root: Path, plan) -> tuple[Any, types.ModuleType]:
    """The script's code object (overrides applied) and the `__main__` module it runs in."""
    from trainbridge.sandbox.script.overrides import compile_source

    main = types.ModuleType("__main__")
    if spec.get("script"):
        path = root / spec["script"]
        source = path.read_text(encoding="utf-8")
        main.__file__ = str(path)
        main.__spec__ = None
    else:
        found = importlib.util.find_spec(spec["module"])
        if found is None or not found.origin or not found.origin.endswith(".py"):
            raise ScriptNotFound(f"module {spec['module']!r} (from `python -m {spec['module']}`) was not found under {root}")
        path = Path(found.origin)
        source = path.read_text(encoding="utf-8")
        main.__file__, main.__spec__ = str(path), found
        main.__package__ = found.parent
    main.__builtins__ = __builtins__
    return compile_source(source, str(path), plan, is_script=True), main


class ScriptNotFound(FileNotFoundError):
    """The launch line's script or module is not in the repository."""


def missing_file_message(exc: FileNotFoundError) -> str:
    name = exc.filename or str(exc)
    if _from_subprocess(exc):
        return (f"the script runs a program that is not installed here: {name!r} (a subprocess, e.g. nvidia-smi on a machine "
                "without it). Install it, or make the call run something harmless without editing the script: "
                f"[overrides] \"run(executable)\" = \"/bin/true\" (a keyword forced on every subprocess.run call)")
    return (f"the script needs a file that is missing: {name!r} (working directory: the run's mirror of the repository). "
            "If it is git-ignored in your checkout (data, tokenizers, meta.pkl), list it or its folder in data = [...] "
            "of trainbridge.toml so every run sees it read-only; otherwise create it first")


_NETWORK_ERRORS = ("NameResolutionError", "ConnectionError", "MaxRetryError", "URLError", "gaierror", "ConnectTimeout")


def network_message(exc: BaseException) -> str | None:
    """What to do when the script failed reaching the network (the sandbox has none): None for other errors."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    if not any(type(e).__name__ in _NETWORK_ERRORS for e in chain):
        return None
    return (f"the script tried to reach the network before its first optimizer step, and the sandbox has none "
            f"({type(chain[0]).__name__}: {str(chain[0])[:300]}). It downloads something at start (a tokenizer such as "
            "tiktoken's BPE files, a dataset, pretrained weights): fetch it once outside TrainBridge into a git-ignored "
            "path of the repository, list it in data = [...] of trainbridge.toml and point the script at it, or "
            "override the setting that asks for the download")


def _from_subprocess(exc: BaseException) -> bool:
    """Whether the exception was raised while starting a child program (subprocess's exec failed)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(("subprocess.py", "_posixsubprocess.py")):
            return True
        tb = tb.tb_next
    return False


def _loss_sources(request: dict[str, Any]):
    """Each step's loss: backward's scalars (GradScaler's scaling undone), or the printed loss (sandbox/script/loss.py)."""
    from trainbridge.sandbox.script.loss import LoggedLoss, LossSources, install_scaler_hook

    pattern = request.get("loss_pattern")
    logged = LoggedLoss(pattern, preferred=bool(request.get("loss_pattern_preferred"))).install() if pattern else None
    sources = LossSources(logged)
    install_scaler_hook(sources)
    return sources


def execute(channel) -> None:
    """Serve one run (see the module doc); ends the process itself after the closing result."""
    from trainbridge.sandbox.backends import Backend
    from trainbridge.sandbox.guard import Guard
    from trainbridge.sandbox.harness import classify, versions
    from trainbridge.sandbox.script.hooks import ScriptFailure, StepController, install_step_hooks
    from trainbridge.sandbox.script.seeds import SeedControl
    from trainbridge.sandbox.random_alignment import align as align_random
    from trainbridge.sandbox.script.overrides import OverridePlan, apply_argv, install
    from trainbridge.sandbox.script.launch import single_torchrun_env

    request = channel.recv()
    state: dict[str, Any] = {"guard": None, "controller": None, "seeds": None, "backend": None, "capture": None}

    def close(failure: dict | None) -> None:
        evidence: dict[str, Any] = {}
        if state["capture"] is not None and failure is None:  # harness mode "capture": the evidence folder is written now
            try:
                evidence = state["capture"].finish()
            except Exception as exc:
                failure = failure_record("crashed", f"writing the torch.compile evidence failed: {type(exc).__name__}: {exc}", exc)
        result: dict[str, Any] = {"op": "result", "versions": {}, "failure": failure}
        try:
            import torch

            result["versions"] = versions()
            result["replaced"] = state["guard"].replaced() if state["guard"] is not None else []
            result["threads_in_use"] = torch.get_num_threads()
            if state["backend"] is not None:
                result["peak_memory_bytes"] = state["backend"].peak_memory_bytes()
            controller, seeds = state["controller"], state["seeds"]
            eager = controller.eager_ops() if controller is not None and failure is None else None
            if eager is not None:  # harness mode "profile", once a step was recorded
                result["extra"] = eager
            if evidence:
                result["extra"] = {**(result.get("extra") or {}), **evidence}
            result["script"] = {"steps_done": controller.steps_done if controller else 0,
                                "optimizers_per_step": controller.optimizer_count if controller else 0,
                                "compiled": controller.compiled if controller else [],
                                "loss_sources": controller.loss_sources.summary() if controller and controller.loss_sources else {},
                                "seed_calls": seeds.calls[:50] if seeds else [], "argv": list(sys.argv)}
        except Exception as exc:  # reporting must not hide the run's own outcome
            result.setdefault("notes", []).append(f"could not read versions, the guard or the profile: {type(exc).__name__}: {exc}")
        channel.send(result)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(0)

    try:
        import torch

        backend = state["backend"] = Backend(request["backend"])
        torch.set_num_threads(int(request["threads"]))
        backend.prepare()
        if request.get("mode") == "gate":
            align_random()  # compiled random ops draw eager's numbers on both sides (sandbox/random_alignment.py)
        root = Path(request["root"])
        spec = request["launch"]
        install_write_guard(request.get("protected", []), request.get("replaceable", []))
        guard_torch_save()
        plan = OverridePlan.from_overrides(request.get("overrides", {}))
        install(root, plan)
        script_dir = str((root / spec["script"]).parent) if spec.get("script") else os.getcwd()
        sys.path[:0] = [script_dir, *(str(root / extra) for extra in request.get("pythonpath", []))]
        if not spec.get("script"):
            sys.path.insert(1, str(root))
        argv0 = spec["script"] or spec["module"]
        if request.get("workdir"):  # trainbridge.toml's workdir: the script runs from that folder of the run's mirror
            os.chdir(request["workdir"])
            if spec.get("script"):
                argv0 = os.path.relpath(Path(request["run_dir"]) / spec["script"], request["workdir"])
        sys.argv = [argv0, *apply_argv(spec.get("args", []), request.get("overrides", {}))]
        if spec.get("launcher") == "torchrun" and "WORLD_SIZE" not in os.environ:  # one process; a rank of a group
            note = _loopback_up()                     # has torchrun's environment from sandbox/child/rank_supervisor.py
            if note:
                print(f"trainbridge: {note}", file=sys.stderr)
            os.environ.update(single_torchrun_env(_free_port()))
        seeds = state["seeds"] = SeedControl(int(request["seed"])).install()
        seeds.seed_everything()
        if request.get("capture"):  # the torch.compile reference (sandbox/script/capture.py): open before the script runs
            from trainbridge.sandbox.script.capture import ScriptCapture

            state["capture"] = ScriptCapture(Path(request["evidence_dir"]), request["capture"], root).begin()
        controller = state["controller"] = StepController(channel, backend, check_ready=plan.unmatched, close=close,
                                                     compile_modules=bool(request.get("compile")), profile=request.get("profile"),
                                                     repo_root=Path(request["root"]), capture=state["capture"],
                                                     loss_sources=_loss_sources(request))
        install_step_hooks(controller)
        state["guard"] = Guard().capture()  # after our own wrappers: what the script replaces shows in the result
        code, main = script_code(spec, root, plan)
        backend.reset_peak_memory()
    except ScriptNotFound as exc:
        close(failure_record("bad_workload", str(exc)))
    except BaseException as exc:
        close(failure_record("bad_workload", f"script mode could not start the script: {type(exc).__name__}: {exc}", exc))
    saved_main = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    except ScriptFailure as failure:
        close({"kind": failure.kind, "message": failure.message, "step": failure.step})
    except SystemExit as exc:
        if not controller.started:
            close(failure_record("bad_workload", f"the script exited (exit status {exc.code!r}) before its first optimizer step; "
                                 "its output tail is below", None, 0))
    except FileNotFoundError as exc:
        close(failure_record("bad_workload", missing_file_message(exc), exc, controller.steps_done))
    except BaseException as exc:  # the script's own error: classify, keep the traceback tail
        network = network_message(exc)
        if network is not None and not controller.started:
            close(failure_record("bad_workload", network, exc, 0))
        close(failure_record(classify(exc), f"{type(exc).__name__}: {exc}", exc, controller.steps_done))
    finally:
        sys.modules["__main__"] = saved_main
    if not controller.started:
        unmatched = "".join(f"; {problem}" for problem in plan.unmatched())
        close(failure_record("bad_workload", "the script ended before its first optimizer step (no backward() and no "
                             f"optimizer.step() ran); check the launch line's arguments{unmatched} (its output tail is below)", None, 0))
    controller.script_ended()
    close(None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--channel":
        print("usage: python -m trainbridge.sandbox.script.launcher --channel READ_FD,WRITE_FD", file=sys.stderr)
        return 2
    from trainbridge.sandbox.child.channel import Channel

    read_fd, write_fd = (int(fd) for fd in argv[1].split(","))
    execute(Channel(read_fd, write_fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
