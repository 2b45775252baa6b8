"""CLI of the served loop: `trainbridge serve`, and the `--server URL` paths of `run` and `review`.

`serve` runs the standard LangGraph server (`langgraph dev`: in memory, state kept on disk in its
folder) on the graph of graph/server.py, offline: no browser, no analytics, no version check, no
tracing. Everything else speaks the LangGraph server API through graph/cli/server_client.py, as
LangGraph Studio or any langgraph_sdk client can.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from trainbridge.graph.cli.display import ask_decision, print_outcome, say as _say, show_review
from trainbridge.graph.cli.terminal import console
from trainbridge.graph.cli.terminal import error as _error

DEFAULT_PORT = 2024  # langgraph dev's own default
# The server process must not reach the network on its own: these switch off the LangGraph CLI's
# analytics, its PyPI version check and LangSmith tracing; the keys below would start LangSmith
# usage reporting, so the server does not inherit them.
OFFLINE_ENV = {"LANGGRAPH_CLI_NO_ANALYTICS": "1", "LANGGRAPH_NO_VERSION_CHECK": "true", "LANGSMITH_TRACING": "false",
               "LANGCHAIN_TRACING_V2": "false", "LANGCHAIN_TRACING": "false", "LANGSMITH_TRACING_V2": "false"}
NOT_INHERITED = ("LANGSMITH_API_KEY", "LANGCHAIN_API_KEY", "LANGGRAPH_CLOUD_LICENSE_KEY")


# --- serve ---------------------------------------------------------------------------------------


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on. Loopback by default: the development server has no authentication, so reach it from another machine through an SSH tunnel."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port to listen on."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Runs executed at the same time; 1 queues them, so gate timings do not compete for the CPUs."),
) -> None:
    """Serve the loop through the standard LangGraph server API, for `trainbridge run/review --server`, LangGraph Studio and langgraph_sdk clients.

    Runs `langgraph dev` (in-memory server, offline: no browser, analytics, version check or tracing) on the TrainBridge graph, in the
    folder <TRAINBRIDGE_HOME>/server, where it keeps its threads between restarts. Runs keep their files under <TRAINBRIDGE_HOME>/runs as
    local runs do. Stop it with Ctrl-C.
    """
    import importlib.util

    if importlib.util.find_spec("langgraph_api") is None or importlib.util.find_spec("langgraph_cli") is None:
        _error("the LangGraph server is not installed: pip install 'trainbridge[server]' (or: pip install 'langgraph-cli[inmem]')")
        raise typer.Exit(2)
    problem = _port_problem(host, port)
    if problem:
        _error(problem)
        raise typer.Exit(2)
    folder = server_dir()
    config = write_server_config(folder)
    url = f"http://{_url_host(host)}:{port}"
    _connect_help(url, host)
    argv = [sys.executable, "-m", "langgraph_cli", "dev", "--no-browser", "--no-reload", "--host", host, "--port", str(port),
            "--config", str(config), "--n-jobs-per-worker", str(jobs)]
    # the server leads a session of its own: no signal reaches it but the one forwarded here, once (a Ctrl-C sent to
    # `serve` alone, a SIGTERM or SIGHUP left `langgraph dev` serving)
    process = subprocess.Popen(argv, cwd=folder, env=server_env(), start_new_session=True)
    raise typer.Exit(serve_until_stopped(process))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SHUTDOWN_GRACE_S = 20.0  # a server that has not shut down this long after its SIGINT is killed


def serve_until_stopped(process: subprocess.Popen, grace_s: float = SHUTDOWN_GRACE_S) -> int:
    """Wait for the server; on SIGINT, SIGTERM or SIGHUP of this process, ask the server to shut down (SIGINT, its own
    Ctrl-C: a graceful stop), ignore further signals, and kill its whole session if it is still up `grace_s` later.
    The exit status: the server's own when it ended by itself, 0 after a Ctrl-C, 128 + the signal after another."""
    stopped: list[tuple[int, float]] = []

    def stop(signum, frame) -> None:
        if not stopped:
            stopped.append((signum, time.monotonic()))
            console.print(f"stopping the LangGraph server (pid {process.pid})", soft_wrap=True, highlight=False)
            _signal_session(process.pid, signal.SIGINT)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        while True:
            try:
                code = process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stopped and time.monotonic() - stopped[0][1] > grace_s:
                    _error(f"the LangGraph server did not stop within {grace_s:.0f} s: killed")
                    _signal_session(process.pid, signal.SIGKILL)
        _signal_session(process.pid, signal.SIGKILL)  # whatever the server started and left in its session
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not stopped:
        return code if code and code > 0 else 0
    return 0 if stopped[0][0] == signal.SIGINT else 128 + stopped[0][0]


def _signal_session(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def server_dir() -> Path:
    """Where `trainbridge serve` keeps its configuration and the server's state (next to the runs)."""
    from trainbridge.graph.state import runs_root

    folder = runs_root().parent / "server"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_server_config(folder: Path) -> Path:
    """The langgraph.json of the served graph (the installed package's; the repository's own is for checkouts and deployments)."""
    from trainbridge.graph.server import GRAPH_ID

    path = folder / "langgraph.json"
    # "." (this folder) only satisfies the CLI: the graph comes from the installed package
    config = {"dependencies": ["."], "graphs": {GRAPH_ID: "trainbridge.graph.server:make_graph"}, "env": {}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def server_env(base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The server's environment: this one (TRAINBRIDGE_HOME, LLM settings...) made offline."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in NOT_INHERITED}
    return {**env, **OFFLINE_ENV}


def _port_problem(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port, or stop what uses it"
    return None


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _connect_help(url: str, host: str) -> None:
    console.print(f"TrainBridge LangGraph server: {url} (graph `trainbridge`; state in {server_dir()})", soft_wrap=True, highlight=False)
    console.print(f"  start a run:      trainbridge run --server {url} REPO --review", soft_wrap=True, highlight=False)
    console.print(f"  answer a review:  trainbridge review --server {url} RUN_ID", soft_wrap=True, highlight=False)
    console.print(f"  LangGraph Studio: https://smith.langchain.com/studio/?baseUrl={url}", soft_wrap=True, highlight=False)
    console.print("  Python:           langgraph_sdk.get_sync_client(url=...); see README, 'Running on a server'", soft_wrap=True, highlight=False)
    if _is_loopback(host):
        console.print(f"  from another machine: ssh -N -L {url.rsplit(':', 1)[1]}:127.0.0.1:{url.rsplit(':', 1)[1]} <this host>, "
                      f"then use the same URL there", soft_wrap=True, highlight=False)
    else:
        console.print(f"[yellow]listening on {host}: anyone who reaches this port can start runs (code execution) on this machine; "
                      f"prefer the loopback default and an SSH tunnel[/]", soft_wrap=True)


# --- run --server / review --server ----------------------------------------------------------------


def run_on_server(url: str, config) -> None:
    """`trainbridge run --server URL`: submit, then follow the run until it pauses for review or stops."""
    from trainbridge.graph.cli.server_client import connect, submit_run

    with _server_errors(url):
        client = connect(url)
        _say(f"run {config.run_id} on {url} (repository {config.repo} as seen by the server; target {config.target})")
        outcome = _detachable(url, config.run_id, lambda: submit_run(client, config, on_progress=_say))
    report_served(url, outcome)


def review_on_server(url: str, ref: str, action: Optional[str], reason: Optional[str], patch_file: Optional[Path]) -> None:
    """`trainbridge review --server URL RUN`: show the waiting patch, send the decision, follow the run."""
    from trainbridge.graph.cli.server_client import answer_review, connect, resolve_thread, thread_outcome

    with _server_errors(url):
        client = connect(url)
        thread_id = resolve_thread(client, ref)
        now = thread_outcome(client, thread_id)
        if now.waiting_for_review is None:
            state = "finished" if now.finished else f"{now.status}, at {now.state.get('node')}"
            _error(f"run {now.run_id or ref} (thread {thread_id}) is not waiting for a review ({state})")
            raise typer.Exit(2)
        show_review(now.waiting_for_review)
        decision = ask_decision(now.waiting_for_review, action, reason, patch_file)
        try:
            outcome = _detachable(url, now.run_id or ref, lambda: answer_review(client, thread_id, decision, on_progress=_say))
        except ValueError as exc:  # the decision does not fit the review schema
            _error(str(exc))
            raise typer.Exit(2) from None
    report_served(url, outcome)


def report_served(url: str, outcome) -> None:
    """Where a served run stands, and the command that continues it."""
    name = outcome.run_id or outcome.thread_id
    if outcome.error:
        _error(f"run {name} stopped on the server (thread {outcome.thread_id}): {outcome.error}")
        raise typer.Exit(1)
    if not print_outcome(name, outcome.waiting_for_review, outcome.state, outcome.finished,
                         review_command=f"trainbridge review --server {url} {name}", where="on the server's machine",
                         show_report=False):
        console.print(f"run {name} is {outcome.status} on the server (thread {outcome.thread_id}), last node "
                      f"{outcome.state.get('node')}", soft_wrap=True)


def served_run_status(run_id: str, checkpoint: str | None = None) -> dict | None:
    """For `trainbridge status/report` on the server's machine: a served run's status (the shape of runs.run_status),
    asked of the server that holds it; None for a run that is not served."""
    from trainbridge.graph.runs import RunError, load_config
    from trainbridge.graph.server import served_by
    from trainbridge.graph.cli.server_client import ServerError, connect, thread_outcome

    config, paths = load_config(run_id, checkpoint=checkpoint)
    served = served_by(paths.dir)
    if served is None:
        return None
    thread_id, url = served.get("thread_id"), served.get("url")
    if not url:
        raise RunError(f"run {run_id} is served by a LangGraph server (thread {thread_id}) that did not record its address: "
                       f"ask it with `trainbridge review --server URL {thread_id}`")
    try:
        outcome = thread_outcome(connect(url), thread_id)
    except ServerError:
        raise RunError(f"run {run_id} is served by the LangGraph server at {url} (thread {thread_id}), which does not answer: "
                       f"start it again with `trainbridge serve` (it keeps its threads); the run's files are in {paths.dir}") from None
    return {"run_id": run_id, "config": config.model_dump(mode="json"), "state": outcome.state, "next": outcome.next,
            "finished": outcome.finished, "waiting_for_review": outcome.waiting_for_review, "server": url, "thread_id": thread_id}


def _detachable(url: str, name: str, request):
    try:
        return request()
    except KeyboardInterrupt:
        console.print(f"\ndetached: run {name} goes on on the server; when it pauses, answer with: trainbridge review --server {url} {name}",
                      soft_wrap=True)
        raise typer.Exit(130) from None


@contextmanager
def _server_errors(url: str) -> Iterator[None]:
    """Server trouble as one line that says what to do (no traceback)."""
    import httpx

    from trainbridge.graph.cli.server_client import ServerError

    try:
        yield
    except ServerError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        hint = " (the run is busy: wait until it pauses or stops)" if status == 409 else ""
        _error(f"the server at {url} refused the request ({status}): {exc.response.text[:500]}{hint}")
        raise typer.Exit(2) from None
    except httpx.HTTPError as exc:
        _error(f"lost the LangGraph server at {url}: {exc}; the run goes on there if the server does "
               f"(see it with: trainbridge review --server {url} RUN_ID)")
        raise typer.Exit(1) from None
