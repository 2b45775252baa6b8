"""The loop served by the standard LangGraph server, driven through the LangGraph server API.

- import (fast): importing the graph module named in langgraph.json starts nothing, imports no
  LangGraph and reads no environment (the recorder is shown to catch reads on a module that does);
- langgraph.json (fast): validated by the LangGraph CLI, it names the factory, which builds the same
  nodes as the CLI's graph with the run settings as its declared context;
- settings (fast): a served run saves its settings as run.json and is tied to its thread; missing,
  conflicting or foreign settings are refused with what to send instead;
- end to end (slow): `langgraph dev` on 127.0.0.1 serves the repository's langgraph.json, offline;
  a run with review on the loop workload (tests/loop_fixtures.py) is submitted, its interrupt read
  through langgraph_sdk, the first patch rejected with a reason (`trainbridge review --server`), the
  next approved (a plain langgraph_sdk resume); it finishes with the same branch, verdicts and
  knowledge-base entries as the same run done from the command line (`start_run`, then `trainbridge review`, which
  answers with `answer_review`, in two more processes: tests/review_run_support.py's run, also tests/test_loop.py's).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainbridge.graph.state import RunConfig, RunPaths
from trainbridge.tests.loop_fixtures import git, loop_config, make_loop_repo
from trainbridge.tests.loop_checks import (
    LLM_ENV,
    REJECT_REASON,
    assert_clean_repository,
    child_env,
    cli_argv,
    decision_view,
    harness_children,
    run_commits,
    run_outcomes,
    user_view,
)

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "reviewed"

# Imports a module with os.environ replaced by a recorder; prints what was read, which modules
# came in, and the threads and child processes that exist afterwards.
IMPORT_PROBE = r"""
import json, os, sys, threading
reads = []
class Recording(type(os.environ)):
    def __getitem__(self, key):
        reads.append(key)
        return super().__getitem__(key)
    def __contains__(self, key):
        reads.append(key)
        return super().__contains__(key)
    def get(self, key, default=None):
        reads.append(key)
        return super().get(key, default)
    def __iter__(self):
        reads.append("<all>")
        return super().__iter__()
    def copy(self):
        reads.append("<all>")
        return super().copy()
env = os.environ
os.environ = Recording(env._data, env.encodekey, env.decodekey, env.encodevalue, env.decodevalue)
before = set(sys.modules)
__import__(sys.argv[1])
children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
print(json.dumps({"reads": sorted(set(reads)), "modules": sorted(set(sys.modules) - before),
                  "threads": threading.active_count(), "tasks": len(os.listdir(f"/proc/{os.getpid()}/task")),
                  "children": children}))
"""


@pytest.fixture(autouse=True)
def no_llm(monkeypatch):
    for name in LLM_ENV:
        monkeypatch.delenv(name, raising=False)


def probe_import(module: str) -> dict:
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE, module], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_graph_module_starts_nothing_and_reads_no_environment():
    served = probe_import("trainbridge.graph.server")
    assert served["reads"] == [], served["reads"]
    assert served["threads"] == 1 and served["tasks"] == 1 and served["children"] == []
    ours = {m for m in served["modules"] if m.split(".")[0] == "trainbridge"}
    assert ours == {"trainbridge", "trainbridge.graph", "trainbridge.graph.server"}, ours
    others = [m for m in served["modules"] if m.split(".")[0] not in sys.stdlib_module_names | {"trainbridge"}]
    assert others == [], others  # no LangGraph, pydantic, chromadb or torch: only the standard library
    # the recorder does see reads: LangGraph itself reads its settings when imported
    langgraph = probe_import("langgraph.graph")
    assert "LANGGRAPH_DEFAULT_RECURSION_LIMIT" in langgraph["reads"]


def test_langgraph_json_names_the_factory_of_the_same_graph():
    from langgraph_cli.config import validate_config_file

    from trainbridge.graph.builder import build_graph
    from trainbridge.graph.server import GRAPH_ID, make_graph

    config = validate_config_file(ROOT / "langgraph.json")
    spec = config["graphs"][GRAPH_ID]
    module, variable = (spec["path"] if isinstance(spec, dict) else spec).split(":")
    assert (module, variable) == ("trainbridge.graph.server", "make_graph")
    assert config["dependencies"] == ["."]

    graph = make_graph()
    assert graph.name == GRAPH_ID and graph.checkpointer is None  # the server brings its checkpointer
    assert set(graph.builder.nodes) == set(build_graph().nodes)
    assert set(graph.builder.branches) == set(build_graph().branches)
    schema = graph.get_context_jsonschema()
    assert list(schema["properties"]) == ["run"] and schema.get("required", []) == []
    run_fields = schema["$defs"]["RunConfig"]
    assert {"repo", "run_id"} <= set(run_fields["required"]) and "review" in run_fields["properties"]


def test_served_settings_are_saved_and_tied_to_their_thread(tmp_path, monkeypatch):
    from langgraph.types import Command

    from trainbridge.graph.server import ServedRunError, served_by, served_run

    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LANGGRAPH_API_URL", "http://127.0.0.1:2024")  # what `langgraph dev` tells its graphs
    config = RunConfig(repo=str(tmp_path / "repo"), run_id="served", review=True, kb_dir=str(tmp_path / "kb"))
    settings = {"run": config.model_dump(mode="json")}
    thread = {"configurable": {"thread_id": "thread-1"}}

    with pytest.raises(ServedRunError, match="no run named"):
        served_run({}, thread, {}, None)
    with pytest.raises(ServedRunError, match="not valid"):
        served_run({}, thread, {"run": {"repo": "x", "run_id": "served", "bugdet_s": 3}}, None)
    with pytest.raises(ServedRunError, match="no settings for run 'served'"):
        served_run({"run_id": "served"}, thread, {}, None)

    # a new run: the id comes from the settings, run.json and the thread are written
    first_input, context = served_run(None, thread, settings, None)
    assert first_input == {"run_id": "served"} and context.config == config
    paths = RunPaths("served")
    assert context.paths.dir == paths.dir
    assert RunConfig.model_validate_json(paths.config.read_text()) == config
    assert served_by(paths.dir) == {"thread_id": "thread-1", "url": "http://127.0.0.1:2024"}

    # a resume on the thread needs no settings (the server copies context into configurable: read too)
    resume = Command(resume={"schema": 1, "action": "approve"})
    same_input, again = served_run(resume, thread, {}, "served")
    assert same_input is resume and again.config == config
    assert served_run(resume, {"configurable": {"thread_id": "thread-1", **settings}}, None, "served")[1].config == config

    with pytest.raises(ServedRunError, match="other settings"):
        served_run(resume, thread, {"run": {**settings["run"], "gate_rounds": 3}}, "served")
    assert served_run(None, thread, {}, "served")[0] is None  # continue after a failure: from the last checkpoint
    with pytest.raises(ServedRunError, match="names runs"):
        served_run({"run_id": "other"}, thread, {}, "served")
    with pytest.raises(ServedRunError, match="already holds run 'served'"):
        served_run({}, thread, {}, "served")  # a new input would start the loop over on the same worktrees
    with pytest.raises(ServedRunError, match="belongs to server thread thread-1"):
        served_run({"run_id": "served"}, {"configurable": {"thread_id": "thread-2"}}, settings, None)

    # a run the CLI started on this machine stays the CLI's
    RunPaths("local").dir.mkdir(parents=True)
    RunPaths("local").config.write_text(config.model_copy(update={"run_id": "local"}).model_dump_json())
    with pytest.raises(ServedRunError, match="trainbridge resume local"):
        served_run({"run_id": "local"}, thread, {}, None)


def test_run_and_review_with_an_unreachable_server_say_what_to_do(tmp_path):
    port = free_port()  # nothing listens there
    env = child_env(tmp_path / "home")
    for argv in (["review", "some-run", "--server", f"http://127.0.0.1:{port}", "--action", "approve"],
                 ["run", str(tmp_path), "--server", f"http://127.0.0.1:{port}"]):
        done = subprocess.run([*cli_argv(), *argv], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"no LangGraph server answers at http://127.0.0.1:{port}" in done.stderr and "trainbridge serve" in done.stderr
        assert "Traceback" not in done.stderr


def test_serve_refuses_a_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([*cli_argv(), "serve", "--port", str(port)], capture_output=True, text=True,
                              env=child_env(tmp_path / "home"), timeout=300)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr


# --------------------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class OutboundSentinel:
    """A listener that the server's environment names as its HTTP(S) proxy: any request the server
    tried to send off this machine through a proxy-aware client would connect here and be counted."""

    def __init__(self):
        self.attempts: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.attempts.append(conn.recv(200))
                except OSError:
                    self.attempts.append(b"?")

    def env(self) -> dict[str, str]:
        proxies = {name: self.url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")}
        return {**proxies, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    def close(self):
        self.sock.close()


@pytest.fixture
def server(tmp_path):
    """`langgraph dev` on 127.0.0.1 serving the repository's langgraph.json as is, offline, in a temp dir."""
    from trainbridge.graph.cli.serve import server_env

    home, cwd = tmp_path / "server-home", tmp_path / "server-cwd"
    cwd.mkdir()
    sentinel = OutboundSentinel()
    port = free_port()
    log = tmp_path / "server.log"
    handle = log.open("w", encoding="utf-8")
    env = {**server_env(child_env(home)), **sentinel.env()}
    proc = subprocess.Popen([sys.executable, "-m", "langgraph_cli", "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1",
                             "--port", str(port), "--config", str(ROOT / "langgraph.json")],
                            cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    seen_children: dict[int, str] = {}
    try:
        print(f"\nlanggraph dev ready in {wait_ready(url, proc, log):.1f} s")
        yield SimpleNamespace(url=url, home=home, runs=home / "runs", log=log, sentinel=sentinel, proc=proc,
                              watch=lambda: seen_children.update(harness_children(proc.pid)))
    finally:
        seen_children.update(harness_children(proc.pid))
        for pid in seen_children:  # sandbox children run in their own sessions: end any still running
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        handle.close()
        sentinel.close()


def wait_ready(url: str, proc: subprocess.Popen, log: Path, limit_s: float = 180) -> float:
    """Seconds until the server at `url` answers /ok (fails with the log's tail if it exits or hangs)."""
    started = time.monotonic()
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}/ok", timeout=2) as answer:
                if json.load(answer) == {"ok": True}:
                    return time.monotonic() - started
        except OSError:
            pass
        assert time.monotonic() - started < limit_s, f"the server is not ready after {limit_s} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


def listening_on(port: int) -> set[str]:
    """The local addresses with a listening TCP socket on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_serve_starts_the_langgraph_server_on_loopback_offline_and_says_how_to_connect(tmp_path):
    from langgraph_sdk import get_sync_client

    home = tmp_path / "home"
    sentinel = OutboundSentinel()
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w", encoding="utf-8") as handle:
        proc = subprocess.Popen([*cli_argv(), "serve", "--port", str(port)], env={**child_env(home), **sentinel.env()},
                                cwd=tmp_path, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, log)
            assert listening_on(port) == {"127.0.0.1"}  # loopback only
            client = get_sync_client(url=url)
            [assistant] = client.assistants.search(graph_id="trainbridge")
            schemas = client.assistants.get_schemas(assistant["assistant_id"])
            assert list(schemas["context_schema"]["properties"]) == ["run"]
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            sentinel.close()
    output = log.read_text()
    assert f"TrainBridge LangGraph server: {url}" in output
    assert f"trainbridge run --server {url} REPO --review" in output and f"trainbridge review --server {url} RUN_ID" in output
    assert f"https://smith.langchain.com/studio/?baseUrl={url}" in output and "ssh -N -L" in output
    assert json.loads((home / "server" / "langgraph.json").read_text())["graphs"] == {"trainbridge": "trainbridge.graph.server:make_graph"}
    assert sentinel.attempts == [], sentinel.attempts  # no analytics, version check or tracing left the machine


def interrupt_of(state: dict) -> dict | None:
    values = [i["value"] for task in state.get("tasks") or [] for i in task.get("interrupts") or []]
    return values[0] if values else None


def outcome_view(kb_dir: str) -> list[tuple]:
    """The knowledge base's outcomes of the run, without the noise of measured ratios."""
    return sorted((o.id, o.recipe_id, o.intent_id, str(o.category), o.verdict.split(":")[0],
                   o.verdict if o.verdict.startswith("rejected_in_review") else None) for o in run_outcomes(kb_dir, RUN_ID))


def same_patch(payload: dict) -> tuple:
    intent = payload["intent"]
    return (payload["schema"], payload["kind"], payload["run_id"], payload["candidate"], payload["recipe_id"], payload["diff"],
            payload["files"], intent["id"], intent["category"], json.dumps(intent["spans"]))


@pytest.mark.slow
def test_served_run_reviewed_through_the_server_api_matches_the_cli_run(server, tmp_path, reviewed_cli_run):
    from langgraph_sdk import get_sync_client

    from trainbridge.graph.server import served_by
    from trainbridge.graph.cli.server_client import ServerError, submit_run

    # the same run from the command line (`start_run` in one process, `trainbridge review` rejecting and approving in
    # two more: tests/review_run_support.py, whose run tests/test_loop.py checks), its status after each process
    cli = reviewed_cli_run
    assert cli.paused and cli.again and cli.final, cli.first.stdout[-3000:]
    first_patch, second_patch, local_state = cli.paused["waiting_for_review"], cli.again["waiting_for_review"], cli.final["state"]
    assert first_patch and second_patch and cli.final["finished"]

    # the same run on the server: submitted with the client helper `trainbridge run --server` uses
    served = tmp_path / "served"
    repo = make_loop_repo(served / "repo")
    before = user_view(repo)
    config = loop_config(repo, RUN_ID, served, review=True, gate_rounds=2)
    client = get_sync_client(url=server.url)
    progress: list[str] = []
    started = time.monotonic()
    paused = submit_run(client, config, on_progress=progress.append)
    server.watch()
    assert paused.error is None, f"{paused.error}\n{server.log.read_text()[-4000:]}"
    assert "measuring the baseline step" in progress and any(m.startswith("candidate ") for m in progress), progress
    with pytest.raises(ServerError, match="already has run 'reviewed'"):
        submit_run(client, config)

    # the interrupt, as any langgraph_sdk client sees it
    thread_id = paused.thread_id
    state = client.threads.get_state(thread_id)
    payload = interrupt_of(state)
    assert state["next"] == ["review"] and payload is not None
    assert same_patch(payload) == same_patch(first_patch)
    assert payload["measured"]["verdicts"] == [] and payload["measured"]["baseline_step_s"] > 0
    assert payload["respond_with"]["reject"] == {"schema": 1, "action": "reject", "reason": "..."}
    assert RunConfig.model_validate_json((server.runs / RUN_ID / "run.json").read_text()) == config
    assert served_by(server.runs / RUN_ID) == {"thread_id": thread_id, "url": server.url}

    # reject with a reason from the command line (`trainbridge review --server`, by run id)
    rejected = subprocess.run([*cli_argv(), "review", RUN_ID, "--server", server.url, "--action", "reject", "--reason", REJECT_REASON],
                              capture_output=True, text=True, env=child_env(tmp_path / "reviewer"), timeout=600)
    server.watch()
    assert rejected.returncode == 0, rejected.stdout + rejected.stderr
    assert f"candidate {payload['candidate']}" in rejected.stderr and "+    return torch.nn.functional.gelu" in rejected.stdout
    assert f"paused for review of candidate {second_patch['candidate']}" in rejected.stderr, rejected.stderr
    assert f"trainbridge review --server {server.url} {RUN_ID}" in rejected.stderr

    # the next patch, with the figures so far; approve it with a plain langgraph_sdk resume
    state = client.threads.get_state(thread_id)
    payload = interrupt_of(state)
    assert same_patch(payload) == same_patch(second_patch)
    so_far = [(v["candidate"], v["reason"], v["message"]) for v in payload["measured"]["verdicts"] if v["candidate"]]
    assert so_far == [(first_patch["candidate"], "rejected_in_review", REJECT_REASON)]
    client.runs.wait(thread_id, "trainbridge", command={"resume": {"schema": 1, "action": "approve"}})
    server.watch()
    state = client.threads.get_state(thread_id)
    print(f"served run: {time.monotonic() - started:.1f} s")
    assert state["next"] == [] and interrupt_of(state) is None, state["next"]
    final = state["values"]

    # the same decisions, knowledge-base entries and branch as the command line's run
    assert decision_view(final["verdicts"]) == decision_view(local_state["verdicts"])
    assert [v["reason"] for v in final["verdicts"] if v["candidate"]] == ["rejected_in_review", "numerics_mismatch"]
    assert final["stop_reason"] == local_state["stop_reason"] == "no intents left"
    assert final["candidates_tried"] == local_state["candidates_tried"] == 2
    assert outcome_view(config.kb_dir) == outcome_view(cli.config.kb_dir) and len(outcome_view(config.kb_dir)) == 2
    branch = f"trainbridge/{RUN_ID}"
    assert [(c["tree"], c["subject"]) for c in run_commits(repo, final["base_sha"], branch)] == \
           [(c["tree"], c["subject"]) for c in run_commits(cli.repo, local_state["base_sha"], branch)]
    assert git(repo, "rev-parse", f"{branch}^{{tree}}") == git(cli.repo, "rev-parse", f"{branch}^{{tree}}")
    assert_clean_repository(repo, RUN_ID)
    assert user_view(repo) == before
    assert Path(final["report_paths"][0]).is_file() and str(server.runs / RUN_ID / "report") in final["report_paths"][0]

    # on the server's machine, `trainbridge status` and `report` find the run and ask its server
    status = subprocess.run([*cli_argv(), "status", RUN_ID], capture_output=True, text=True, env=child_env(server.home), timeout=300)
    assert status.returncode == 0, status.stderr
    assert f"run {RUN_ID}: finished" in status.stdout and f"served by the LangGraph server at {server.url} (thread {thread_id})" in status.stdout
    assert "candidates tried 2, accepted 0" in status.stdout
    report = subprocess.run([*cli_argv(), "report", RUN_ID], capture_output=True, text=True, env=child_env(server.home), timeout=300)
    assert report.returncode == 0 and "rejected_in_review" in report.stdout and "numerics_mismatch" in report.stdout, report.stderr

    # the served run wrote its progress to the server log, and the server sent nothing off the machine
    assert f"run {RUN_ID}: measuring the baseline step" in server.log.read_text()
    assert server.sentinel.attempts == [], server.sentinel.attempts
