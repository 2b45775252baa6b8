"""Shared fixtures of the LLM coder tests (tests/test_llm_*.py): a loopback fake OpenAI-compatible
server answered from a script, a socket guard that fails a test whose requests leave loopback, a real
user repository with a run workspace, and the intent and settings the coder is asked with."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import git
import pytest
from pydantic import SecretStr

from trainbridge.agents.coder.llm import client as llm_client
from trainbridge.agents.coder.llm.config import LLMConfig
from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, SourceSpan
from trainbridge.tools.git.ops import RunWorkspace, open_repo


MODEL = '''\
import math

import torch


def new_gelu(x):
    """GPT-2's tanh GELU."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x


def train_step(model, batch, optimizer):
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    return loss
'''
GELU_LINE = "    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))"
GELU_FUSED = '    return torch.nn.functional.gelu(x, approximate="tanh")'
RMS_BODY = ("        variance = x.pow(2).mean(-1, keepdim=True)\n"
            "        x = x * torch.rsqrt(variance + self.eps)\n"
            "        return self.weight * x")
GELU_SPAN = SourceSpan(file="model.py", line_start=6, line_end=8, function="new_gelu")
RMS_SPAN = SourceSpan(file="model.py", line_start=17, line_end=20, function="forward")


def block(search: str, replace: str, path: str = "model.py") -> str:
    return f"{path}\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE\n"


VALID_GELU = "Use the fused GELU.\n\n```python\n" + block(GELU_LINE, GELU_FUSED) + "```\n"


# --- loopback fake OpenAI server ------------------------------------------------------------------


class FakeOpenAI:
    """POST /v1/chat/completions answered from a script of (status, text); every request is recorded."""

    def __init__(self) -> None:
        self.script: list[tuple[int, str]] = []
        self.requests: list[dict] = []
        self.retry_after: dict[int, str] = {}  # request index -> Retry-After header value
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                status, text = fake.script.pop(0) if fake.script else (500, "the test scripted no more replies")
                if status != 200:
                    retry_after = fake.retry_after.get(len(fake.requests) - 1)
                    return self._send(status, {"error": {"message": text, "type": "server_error", "code": None}},
                                      {"Retry-After": retry_after} if retry_after else {})
                self._send(200, {
                    "id": f"chatcmpl-{len(fake.requests)}", "object": "chat.completion", "created": 1700000000,
                    "model": body.get("model", "?"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
                })

            def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def messages(self, index: int) -> list[dict]:
        return self.requests[index]["body"]["messages"]


@pytest.fixture
def server():
    fake = FakeOpenAI()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


@pytest.fixture
def waits(monkeypatch):
    """The client's backoff waits, recorded instead of slept."""

    recorded: list[float] = []
    monkeypatch.setattr(llm_client, "_sleep", recorded.append)
    return recorded


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Any connection or name lookup beyond loopback is refused and recorded; the test then fails."""
    outside: list[object] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def loopback(host) -> bool:
        if host in ("localhost", None):
            return True
        try:
            return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
        except ValueError:
            return False

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not loopback(address[0]):
            outside.append(address)
            raise ConnectionRefusedError(f"test guard: connection to {address} refused (not loopback)")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if not loopback(host):
            outside.append(host)
            raise socket.gaierror(f"test guard: lookup of {host} refused (not loopback)")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID"):
        monkeypatch.delenv(name, raising=False)
    yield outside
    assert not outside, f"requests left loopback: {outside}"


# --- a real user repository and run workspace -----------------------------------------------------


@pytest.fixture(autouse=True)
def no_global_git_identity(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def user_repo(tmp_path) -> Path:
    root = tmp_path / "user"
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Alice")
        config.set_value("user", "email", "alice@example.com")
    (root / "model.py").write_text(MODEL)
    repo.git.add("-A")
    repo.git.commit("-m", "initial")
    (root / "notes.txt").write_text("untracked scratch\n")  # the user's own uncommitted work
    repo.close()
    return root


@pytest.fixture
def workspace(user_repo, tmp_path) -> RunWorkspace:
    return RunWorkspace.create_run(open_repo(user_repo), "r1", workspace_root=tmp_path / "ws")


def snapshot(root: Path) -> dict:
    with git.Repo(root) as repo:
        return {"head": repo.head.commit.hexsha, "branch": repo.active_branch.name,
                "status": repo.git.status("--porcelain", "--untracked-files=all"),
                "model": (root / "model.py").read_bytes(), "notes": (root / "notes.txt").read_bytes(),
                "user_branches": sorted(h.name for h in repo.heads if not h.name.startswith("trainbridge/"))}


def assert_nothing_landed(workspace: RunWorkspace, user_repo: Path, before: dict) -> None:
    with git.Repo(user_repo) as repo:
        assert repo.git.rev_list("--all").split() == [before["head"]], "a commit was made"
        assert not [h.name for h in repo.heads if ".cand/" in h.name], "a candidate branch was left behind"
    assert workspace.head_sha == before["head"]
    assert not any((workspace.root / "candidates").glob("*")), "a candidate worktree was left behind"
    assert snapshot(user_repo) == before


def make_intent(span: SourceSpan = GELU_SPAN, category: IntentCategory = IntentCategory.gelu) -> Intent:
    return Intent(id=Intent.make_id(category, [span]), category=category, spans=[span], confidence=0.8,
                  source=IntentSource.runtime,
                  evidence=Evidence(reference_kernels=1, target_ops=9, target_time_us=412.0,
                                    kernels=["cpp_fused_add_mul_pow_tanh_0"],
                                    target_op_names=["aten::mul", "aten::pow", "aten::add", "aten::tanh"],
                                    detectors=["static:gelu_tanh"]))


def config_for(server: FakeOpenAI, **overrides) -> LLMConfig:
    return LLMConfig(base_url=server.url, model="fake-coder", api_key=SecretStr("sk-test-123"), timeout=20,
                     **{"max_attempts": 3, **overrides})
