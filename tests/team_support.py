"""What the team tests share: a real Postgres server in a temporary folder (Debian's `postgresql`
binaries, initdb/pg_ctl on a loopback port, as the `postgres` user when this process is root), the
loop in a child process that can be SIGKILLed, and the views of a run its assertions compare."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from trainbridge.tests.loop_checks import child_env, harness_children, kill_harness_groups

ROOT = Path(__file__).resolve().parents[1]


def postgres_bin() -> Path | None:
    """The folder of initdb and pg_ctl (Debian keeps them out of PATH), or None when not installed."""
    for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(found) / "initdb").is_file() and (Path(found) / "pg_ctl").is_file():
            return Path(found)
    initdb = shutil.which("initdb")
    return Path(os.path.realpath(initdb)).parent if initdb else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def postgres_server(database: str = "trainbridge") -> Iterator[str]:
    """A fresh Postgres cluster on 127.0.0.1 (trust authentication, no password), stopped and removed
    afterwards; yields the URL of `database` in it. Postgres refuses to run as root: a root process
    runs the server as the `postgres` user that Debian's package creates."""
    bindir = postgres_bin()
    if bindir is None:
        raise RuntimeError("no Postgres server binaries: apt-get install -y postgresql")
    folder = Path(tempfile.mkdtemp(prefix="trainbridge-pg-", dir="/tmp"))
    data, sockets, logs = folder / "data", folder / "sockets", folder / "logs"
    for made in (data, sockets, logs):
        made.mkdir()
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chmod(folder, 0o755)
        for made in (data, sockets, logs):
            os.chown(made, user.pw_uid, user.pw_gid)
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
    port = free_port()
    env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
    pg_ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data)]
    try:
        subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "trainbridge", "--auth=trust", "-E", "UTF8",
                        "--no-sync"], check=True, capture_output=True, env=env, cwd=folder)
        options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
        started = subprocess.run([*pg_ctl, "-o", options, "-l", str(logs / "server.log"), "-w", "-t", "60", "start"],
                                 capture_output=True, text=True, env=env, cwd=folder)
        if started.returncode != 0:
            log = (logs / "server.log").read_text(errors="replace") if (logs / "server.log").is_file() else ""
            raise RuntimeError(f"pg_ctl start failed: {started.stdout}{started.stderr}{log[-2000:]}")
        subprocess.run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "trainbridge", database],
                       check=True, capture_output=True, env=env)
        yield f"postgresql://trainbridge@127.0.0.1:{port}/{database}"
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "-w", "-t", "60", "stop"], capture_output=True, env=env, cwd=folder)
        shutil.rmtree(folder, ignore_errors=True)


# The loop in a child process: start (with the config) or resume (by run id, through --checkpoint).
DRIVER = r"""
import json, sys
args = json.loads(sys.argv[1])
from trainbridge.graph.runs import resume_run, start_run
from trainbridge.graph.state import RunConfig
say = lambda message: print(message, flush=True)
if args["action"] == "start":
    outcome = start_run(RunConfig.model_validate(args["config"]), say=say)
else:
    outcome = resume_run(args["run_id"], say=say, checkpoint=args.get("checkpoint"))
print("OUTCOME " + json.dumps({"finished": outcome.finished}), flush=True)
"""


class LoopProcess:
    """One loop process with its log, SIGKILLed when its `kill_at_measure`-th timed sandbox child runs."""

    def __init__(self, args: dict, home: Path, log: Path, env: dict[str, str] | None = None):
        self.log, self.handle = log, log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=ROOT,
                                     env={**child_env(home), **(env or {})}, stdout=self.handle, stderr=subprocess.STDOUT)
        self.children: dict[int, str] = {}

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]

    def watch(self, *, kill_at_measure: int | None = None, timeout_s: float = 900, before_kill=None) -> int:
        started = time.monotonic()
        while self.proc.poll() is None:
            self.children.update(harness_children(self.proc.pid))
            if kill_at_measure is not None and sum(mode == "timed" for mode in self.children.values()) >= kill_at_measure:
                if before_kill is not None:
                    before_kill()
                os.kill(self.proc.pid, signal.SIGKILL)
                break
            if time.monotonic() - started > timeout_s:
                os.kill(self.proc.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        status = self.proc.wait()
        self.reap()
        self.handle.close()
        return status

    def reap(self) -> None:
        """Sandbox children run in sessions of their own and outlive a killed parent: end the ones we saw."""
        kill_harness_groups(self.children)


def outcome_view(verdicts: list[dict]) -> list[tuple]:
    """A run's decisions without the names that depend on line numbers at the time (intent ids move
    when an earlier rewrite changed the file): what was tried, and how it was decided."""
    return sorted((v["category"], v["recipe_id"], v["accepted"], v["reason"]) for v in verdicts)
