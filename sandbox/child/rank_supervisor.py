"""Script mode's rank group, inside the sandbox: torchrun's part for `torchrun --nproc_per_node N train.py`.

`python -m trainbridge.sandbox.child.rank_supervisor --ranks N --output-dir DIR --channels R0,W0,R1,W1,...`

The parent (sandbox/child/rank_group.py) starts this one process the way it starts any sandbox child (its
own process group and session, the memory cap, the scrubbed environment, a new network namespace
where the host allows it). It then does what torchrun does for one node, and nothing more:

- brings up the loopback interface of the namespace and picks a free MASTER_PORT on 127.0.0.1, so
  the ranks' process group (gloo on the CPU) forms over loopback and nothing outside is reachable;
- starts N ranks of the script-mode launcher (sandbox/script/launcher.py), each with torchrun's
  environment (`script_launch.torchrun_env`), its share of the threads, and its own control
  channel to the parent (the pipes the parent made; this process keeps no copy, so a rank's death
  closes its channel). The ranks stay in this process's group: one kill ends the whole tree;
- rank 0 writes to this process's stdout and stderr, rank i to `rank{i}.stdout.txt` /
  `rank{i}.stderr.txt` in DIR; every start and exit goes to `ranks.jsonl` there;
- when a rank dies (a signal or a non-zero status), kills the others at once (a peer would
  otherwise wait in a collective until gloo's own timeout) and exits; when all ended, exits 0.

It never runs code of the repository itself and speaks no protocol: the parent talks to each rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

RANKS_LOG = "ranks.jsonl"
LAUNCHER_MODULE = "trainbridge.sandbox.script.launcher"


def rank_output(output_dir: Path, rank: int) -> tuple[Path, Path]:
    """Where rank `rank` (> 0) writes its stdout and stderr (rank 0: the group's own)."""
    return output_dir / f"rank{rank}.stdout.txt", output_dir / f"rank{rank}.stderr.txt"


def _log(output_dir: Path, **event) -> None:
    with (output_dir / RANKS_LOG).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(event) + "\n")


def _exit_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        try:
            return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
        except ValueError:
            return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


def run_group(ranks: int, output_dir: Path, channels: list[tuple[int, int]]) -> int:
    from trainbridge.sandbox.script.launch import rank_threads, torchrun_env
    from trainbridge.sandbox.loopback import free_port, loopback_up

    note = loopback_up()
    if note:
        print(f"trainbridge: {note}", file=sys.stderr, flush=True)
    port = free_port()
    threads = rank_threads(int(os.environ.get("OMP_NUM_THREADS", "1")), ranks)
    procs: dict[int, int] = {}  # pid -> rank
    for rank, (read_fd, write_fd) in enumerate(channels):
        env = {**os.environ, **torchrun_env(rank, ranks, port), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        files = [None, None] if rank == 0 else [path.open("wb") for path in rank_output(output_dir, rank)]
        try:
            proc = subprocess.Popen([sys.executable, "-m", LAUNCHER_MODULE, "--channel", f"{read_fd},{write_fd}"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=files[0], stderr=files[1], pass_fds=(read_fd, write_fd))
        except OSError as exc:
            _log(output_dir, rank=rank, event="not_started", error=str(exc))
            _kill(procs)
            return 1
        finally:
            for handle in files:
                if handle is not None:
                    handle.close()
            os.close(read_fd)  # only the rank holds its channel now: its death closes it
            os.close(write_fd)
        procs[proc.pid] = rank
        _log(output_dir, rank=rank, event="started", pid=proc.pid)
    alive = dict(procs)
    while alive:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in alive:
            continue  # a process a rank left behind and we inherited: not a rank
        rank = alive.pop(pid)
        failed = os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0
        _log(output_dir, rank=rank, event="exited", pid=pid, status=_exit_text(status), failed=failed)
        if failed:
            _kill(alive)
            return 1
    return 0


def _kill(procs: dict[int, int]) -> None:
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        options = dict(zip(argv[::2], argv[1::2]))
        ranks, output_dir = int(options["--ranks"]), Path(options["--output-dir"])
        fds = [int(fd) for fd in options["--channels"].split(",")]
    except (KeyError, ValueError):
        print("usage: python -m trainbridge.sandbox.child.rank_supervisor --ranks N --output-dir DIR --channels R0,W0,R1,W1,...",
              file=sys.stderr)
        return 2
    if len(fds) != 2 * ranks:
        print(f"rank_supervisor: {ranks} ranks need {2 * ranks} channel descriptors, got {len(fds)}", file=sys.stderr)
        return 2
    return run_group(ranks, output_dir, list(zip(fds[::2], fds[1::2])))


if __name__ == "__main__":
    sys.exit(main())
