"""The LLM coder against a real loopback OpenAI-compatible server, through the real ChatOpenAI client.

Every test runs on a real temporary git repository (the user's checkout) and a real run workspace;
a socket guard makes any connection or name lookup beyond loopback fail the test.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import git
import pytest
from pydantic import SecretStr

from trainbridge.agents.coder import llm_client
from trainbridge.agents.coder.candidate import Candidate, CoderRefusal
from trainbridge.agents.coder.learned import LearnedRecipeError, learned_recipe
from trainbridge.agents.coder.llm import llm_candidate
from trainbridge.agents.coder.llm_reply import PatchRejected, locate, parse_reply
from trainbridge.agents.coder.llm_config import LLMConfig, LLMConfigError
from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, SourceSpan
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe
from trainbridge.tools.git_ops import RunWorkspace, open_repo

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


# --- configuration --------------------------------------------------------------------------------


def test_config_from_env():
    assert LLMConfig.from_env({}) is None
    assert LLMConfig.from_env({"OPENAI_API_KEY": "sk-lying-around"}) is None, "a stray key must not switch the LLM on"
    config = LLMConfig.from_env({"TRAINBRIDGE_LLM_BASE_URL": "http://127.0.0.1:8000/v1/", "TRAINBRIDGE_LLM_MODEL": "qwen",
                                 "OPENAI_API_KEY": "sk-fallback", "TRAINBRIDGE_LLM_TIMEOUT": "30",
                                 "TRAINBRIDGE_LLM_MAX_ATTEMPTS": "2"})
    assert (config.base_url, config.model, config.timeout, config.max_attempts) == ("http://127.0.0.1:8000/v1", "qwen", 30, 2)
    assert config.key_value() == "sk-fallback" and "sk-fallback" not in repr(config)
    own = LLMConfig.from_env({"TRAINBRIDGE_LLM_MODEL": "m", "TRAINBRIDGE_LLM_API_KEY": "sk-own", "OPENAI_API_KEY": "sk-other"})
    assert own.key_value() == "sk-own" and own.base_url == "https://api.openai.com/v1"
    assert LLMConfig.from_env({"TRAINBRIDGE_LLM_BASE_URL": "http://10.0.0.2:8000/v1", "TRAINBRIDGE_LLM_MODEL": "m"}).key_value() == "no-key"
    with pytest.raises(LLMConfigError, match="TRAINBRIDGE_LLM_MODEL"):
        LLMConfig.from_env({"TRAINBRIDGE_LLM_BASE_URL": "http://127.0.0.1:8000/v1"})
    assert LLMConfig.from_env({"TRAINBRIDGE_LLM_MODEL": "m", "TRAINBRIDGE_LLM_BASE_URL": "http://h/v1",
                               "TRAINBRIDGE_LLM_RETRIES": "7"}).transport_retries == 7
    with pytest.raises(LLMConfigError, match="TRAINBRIDGE_LLM_RETRIES"):
        LLMConfig.from_env({"TRAINBRIDGE_LLM_MODEL": "m", "TRAINBRIDGE_LLM_BASE_URL": "http://h/v1", "TRAINBRIDGE_LLM_RETRIES": "-1"})
    with pytest.raises(LLMConfigError, match="TRAINBRIDGE_LLM_TIMEOUT"):
        LLMConfig.from_env({"TRAINBRIDGE_LLM_MODEL": "m", "TRAINBRIDGE_LLM_BASE_URL": "http://h/v1", "TRAINBRIDGE_LLM_TIMEOUT": "soon"})
    with pytest.raises(LLMConfigError, match="TRAINBRIDGE_LLM_BASE_URL"):
        LLMConfig.from_env({"TRAINBRIDGE_LLM_MODEL": "m", "TRAINBRIDGE_LLM_BASE_URL": "ftp://h"})
    with pytest.raises(LLMConfigError, match="needs an API key"):
        LLMConfig.from_env({"TRAINBRIDGE_LLM_MODEL": "gpt-x"})
    with pytest.raises(ValueError, match="extra"):
        LLMConfig(model="m", base_url="http://h/v1", temprature=0.1)


def test_unconfigured_path_constructs_no_client(monkeypatch, workspace, user_repo):
    import langchain_openai
    import langchain_openai.chat_models.base as chat_base

    constructed = []

    class Exploding:
        def __init__(self, *args, **kwargs):
            constructed.append(kwargs)
            raise AssertionError("an LLM client was constructed without configuration")

    monkeypatch.setattr(langchain_openai, "ChatOpenAI", Exploding)
    monkeypatch.setattr(chat_base, "ChatOpenAI", Exploding)
    before = snapshot(user_repo)
    config = LLMConfig.from_env({"OPENAI_API_KEY": "sk-lying-around", "HOME": "/tmp"})
    assert config is None
    refusal = llm_candidate(workspace, make_intent(), config)
    assert isinstance(refusal, CoderRefusal) and "no LLM is configured" in refusal.reason
    assert constructed == []
    assert_nothing_landed(workspace, user_repo, before)
    # the same patch point does catch a construction, so the assertion above can fail
    with pytest.raises(AssertionError, match="constructed"):
        llm_client.make_chat(LLMConfig(model="m", base_url="http://127.0.0.1:9/v1"))


# --- a valid patch ----------------------------------------------------------------------------------


def test_valid_patch_is_committed_on_a_candidate_branch(server, workspace, user_repo):
    before = snapshot(user_repo)
    server.script = [(200, VALID_GELU)]
    made = llm_candidate(workspace, make_intent(), config_for(server))
    assert isinstance(made, Candidate), made
    assert made.recipe_id is None and made.branch == "trainbridge/r1.cand/" + made.name and made.files == ["model.py"]
    assert made.sites == [SourceSpan(file="model.py", line_start=8, line_end=8)]
    with git.Repo(user_repo) as repo:
        committed = (repo.commit(made.sha).tree / "model.py").data_stream.read().decode()
        assert repo.commit(made.sha).parents[0].hexsha == before["head"]
        message = repo.commit(made.sha).message
    assert committed == MODEL.replace(GELU_LINE, GELU_FUSED)
    assert "-" + GELU_LINE in made.diff and "+" + GELU_FUSED in made.diff
    assert "fake-coder" in message and "K=1 vs eager ops N=9" in message
    assert snapshot(user_repo) == before, "the user's checkout changed"
    assert workspace.head_sha == before["head"], "the run branch moved before the gate"
    # one request, through the real client, carrying the intent, the numbered region and the rules
    assert len(server.requests) == 1
    request = server.requests[0]
    assert {k.lower(): v for k, v in request["headers"].items()}["authorization"] == "Bearer sk-test-123"
    assert request["body"]["model"] == "fake-coder" and request["body"]["temperature"] == 0
    system, user = (m["content"] for m in server.messages(0))
    assert "faster on the cpu backend" in system and "manual_seed" in system and "<<<<<<< SEARCH" in system
    assert "gelu on target backend cpu" in user and "K=1" in user and "N=9" in user
    assert "model.py lines 6-8" in user and f"    8 | {GELU_LINE}" in user
    assert ">    8 |" in user and "     9 |" not in user.split("Surrounding code")[0]


def test_feedback_goes_into_the_first_prompt(server, workspace):
    server.script = [(200, "I cannot improve this.")]
    refusal = llm_candidate(workspace, make_intent(), config_for(server, max_attempts=1),
                            feedback="reviewer: keep the erf form out of it")
    assert isinstance(refusal, CoderRefusal)
    assert "reviewer: keep the erf form out of it" in server.messages(0)[-1]["content"]


# --- what never lands -------------------------------------------------------------------------------


def test_garbage_replies_never_land_and_each_retry_explains(server, workspace, user_repo):
    before = snapshot(user_repo)
    server.script = [(200, "You should use a fused GELU kernel here."), (200, "<<<<<<< SEARCH\nx\n"),
                     (200, "```\nmodel.py\n<<<<<<< SEARCH\nfoo\n>>>>>>> REPLACE\n```")]
    refusal = llm_candidate(workspace, make_intent(), config_for(server))
    assert isinstance(refusal, CoderRefusal) and refusal.recipe_id == "llm"
    assert "3 attempt(s)" in refusal.reason
    assert "no SEARCH/REPLACE block" in refusal.reason and "never ends" in refusal.reason and "divider" in refusal.reason
    assert len(server.requests) == 3
    retry = server.messages(1)
    assert [m["role"] for m in retry] == ["system", "user", "assistant", "user"]
    assert retry[2]["content"] == "You should use a fused GELU kernel here."
    assert "no SEARCH/REPLACE block" in retry[3]["content"] and "attempt 1 of 3" in retry[3]["content"]
    assert "never ends with >>>>>>> REPLACE" in server.messages(2)[-1]["content"]
    assert_nothing_landed(workspace, user_repo, before)


def test_edit_outside_the_span_is_refused_then_a_confined_retry_lands(server, workspace, user_repo):
    before = snapshot(user_repo)
    outside = block("    loss.backward()", "    loss.backward(retain_graph=False)")
    server.script = [(200, outside), (200, VALID_GELU)]
    made = llm_candidate(workspace, make_intent(), config_for(server))
    assert isinstance(made, Candidate)
    retry = server.messages(1)[-1]["content"]
    assert "model.py lines 25-25" in retry and "outside the editable region (model.py:6-8)" in retry
    assert "loss.backward(retain_graph" not in made.diff and "+" + GELU_FUSED in made.diff
    assert snapshot(user_repo) == before


@pytest.mark.parametrize("reply, expected", [
    (block(GELU_LINE, GELU_LINE + "\n    ...)"), "does not compile"),
    (block(GELU_LINE, "    torch.manual_seed(0)\n" + GELU_FUSED), "seeds or random-number state"),
    (block(GELU_LINE, "    t0 = time.perf_counter()\n" + GELU_FUSED), "timing"),
    (block(GELU_LINE, "    global _CACHE\n" + GELU_FUSED), "global/nonlocal"),
    (block(GELU_LINE, "    @functools.lru_cache\n    def f(): pass\n" + GELU_FUSED), "caching"),
    (block(GELU_LINE, GELU_FUSED.replace("(x,", "(x.detach(),")), "skipped gradient work"),
    (block(GELU_LINE, "    import torch.nn.functional as F\n" + GELU_FUSED), "import statement inside the region"),
    (block(GELU_LINE, "    os.system('true')\n" + GELU_FUSED), "dynamic code, I/O or process access"),
    (block(GELU_LINE, GELU_FUSED) + "<<<<<<< IMPORTS\nimport subprocess\n>>>>>>> IMPORTS\n", "imports from subprocess; only"),
    (block(GELU_LINE, GELU_FUSED) + "<<<<<<< IMPORTS\nfrom torch.utils.data import DataLoader\n>>>>>>> IMPORTS\n",
     "imports from torch.utils.data"),
    (block(GELU_LINE, GELU_FUSED) + "<<<<<<< IMPORTS\nfrom torch import manual_seed\n>>>>>>> IMPORTS\n", "seeds"),
    (block(GELU_LINE, "    return torch_npu.npu_gelu(x)"), "does not have"),
    (block(GELU_LINE, GELU_LINE.replace("    return", "    return x\n    return")), "new return"),
    (block(GELU_LINE, "    exec('y = 1')\n" + GELU_FUSED), "dynamic code"),
    (block(GELU_LINE, "    self_cache = getattr(x, 'cached', None)\n" + GELU_FUSED), "attribute tricks"),
    (block(GELU_LINE, GELU_FUSED, path="train.py"), "not a file this intent may edit"),
    (block(GELU_LINE, GELU_LINE), "changes nothing"),
    (block(GELU_LINE, "\n".join(["    y = x"] * 30) + "\n" + GELU_FUSED), "should not grow it"),
    (block(GELU_LINE.strip(), GELU_FUSED.strip()), "except for indentation"),
    (block("def new_gelu(x):\n" + '    """GPT-2\'s tanh GELU."""\n' + GELU_LINE,
           "def new_gelu(x):\n" + '    """GPT-2\'s tanh GELU."""\n' + GELU_FUSED + "\n    return 1"), "new return"),
])
def test_bad_patches_never_land(server, workspace, user_repo, reply, expected):
    before = snapshot(user_repo)
    server.script = [(200, reply)]
    refusal = llm_candidate(workspace, make_intent(), config_for(server, max_attempts=1))
    assert isinstance(refusal, CoderRefusal), refusal
    assert expected in refusal.reason + " ".join(refusal.close)
    assert len(server.requests) == 1
    assert_nothing_landed(workspace, user_repo, before)


def test_seed_lines_in_the_span_cannot_be_touched(server, workspace, user_repo):
    (user_repo / "seeded.py").write_text("import torch\n\n\ndef step(x):\n    torch.manual_seed(1234)\n    return x * 2\n")
    with git.Repo(user_repo) as repo:
        repo.git.add("seeded.py")
        repo.git.commit("-m", "seeded")
    ws = RunWorkspace.create_run(open_repo(user_repo), "r2", workspace_root=workspace.root.parent / "ws2")
    before = snapshot(user_repo)
    span = SourceSpan(file="seeded.py", line_start=4, line_end=6)
    server.script = [(200, block("    torch.manual_seed(1234)\n    return x * 2", "    return x * 2", "seeded.py"))]
    refusal = llm_candidate(ws, make_intent(span, IntentCategory.elementwise_chain), config_for(server, max_attempts=1))
    assert isinstance(refusal, CoderRefusal) and "seeds or random-number state" in refusal.reason
    with git.Repo(user_repo) as repo:
        assert not [h.name for h in repo.heads if ".cand/" in h.name]
    assert snapshot(user_repo) == before


def test_a_patch_that_breaks_the_import_is_refused_in_a_sandbox_child(server, workspace, user_repo, monkeypatch):
    (user_repo / "consts.py").write_text(
        "import math\nimport os\n\nassert 'TRAINBRIDGE_LLM_API_KEY' not in os.environ, 'secret leaked into the child'\n"
        "SCALE = math.sqrt(2.0 / math.pi)\n")
    with git.Repo(user_repo) as repo:
        repo.git.add("consts.py")
        repo.git.commit("-m", "consts")
    monkeypatch.setenv("TRAINBRIDGE_LLM_API_KEY", "sk-must-not-reach-the-child")
    ws = RunWorkspace.create_run(open_repo(user_repo), "r3", workspace_root=workspace.root.parent / "ws3")
    before = snapshot(user_repo)
    span = SourceSpan(file="consts.py", line_start=5, line_end=5)
    broken = block("SCALE = math.sqrt(2.0 / math.pi)", "SCALE = math.sqrt(2.0 / math.tau_half)", "consts.py")
    fine = block("SCALE = math.sqrt(2.0 / math.pi)", "SCALE = 0.7978845608028654", "consts.py")
    server.script = [(200, broken), (200, fine)]
    made = llm_candidate(ws, make_intent(span, IntentCategory.elementwise_chain), config_for(server, max_attempts=2))
    assert isinstance(made, Candidate), made  # the second reply imports, so the scrubbed child saw no key
    retry = server.messages(1)[-1]["content"]
    assert "no longer imports" in retry and "AttributeError" in retry and "tau_half" in retry
    assert "consts" not in sys.modules, "user code was imported in the coder's process"
    assert "+SCALE = 0.7978845608028654" in made.diff
    assert snapshot(user_repo) == before


def test_import_check_is_inconclusive_when_the_module_never_imported(server, workspace, user_repo):
    (user_repo / "needs_missing.py").write_text("import not_installed_pkg_xyz\n\n\ndef f(x):\n    return x * 1.0\n")
    with git.Repo(user_repo) as repo:
        repo.git.add("needs_missing.py")
        repo.git.commit("-m", "missing dep")
    ws = RunWorkspace.create_run(open_repo(user_repo), "r4", workspace_root=workspace.root.parent / "ws4")
    span = SourceSpan(file="needs_missing.py", line_start=4, line_end=5)
    server.script = [(200, block("    return x * 1.0", "    return x", "needs_missing.py"))]
    made = llm_candidate(ws, make_intent(span, IntentCategory.redundant_cast), config_for(server, max_attempts=1))
    assert isinstance(made, Candidate), made
    with git.Repo(user_repo) as repo:
        assert "inconclusive" in repo.commit(made.sha).message and "not_installed_pkg_xyz" in repo.commit(made.sha).message


# --- the server misbehaves ---------------------------------------------------------------------------


def test_server_errors_are_retried_with_backoff_in_the_client_then_given_up(server, workspace, user_repo, waits):
    """Transport retries belong to the client (with backoff and a limit), not to the patch budget: five
    500s with four retries are one request failure that ends the turn, not three patch attempts."""
    before = snapshot(user_repo)
    server.script = [(500, "upstream exploded")] * 5
    refusal = llm_candidate(workspace, make_intent(), config_for(server, transport_retries=4))
    assert isinstance(refusal, CoderRefusal)
    assert "in 1 attempt(s)" in refusal.reason and "no reply after 5 request(s)" in refusal.reason, refusal.reason
    assert "HTTP 500" in refusal.reason and "TRAINBRIDGE_LLM_RETRIES" in refusal.reason
    assert len(server.requests) == 5 and waits == [1.0, 2.0, 4.0, 8.0]  # exponential backoff between them
    assert_nothing_landed(workspace, user_repo, before)


def test_a_rate_limit_waits_as_the_server_asks_and_costs_no_patch_attempt(server, workspace, waits):
    server.script = [(429, "slow down"), (503, "overloaded"), (200, "no blocks here"), (200, VALID_GELU)]
    server.retry_after = {0: "7"}
    made = llm_candidate(workspace, make_intent(), config_for(server, max_attempts=2))
    assert isinstance(made, Candidate), made  # two transport failures, then two patch attempts: the second lands
    assert waits == [7.0, 2.0] and len(server.requests) == 4
    assert server.messages(1) == server.messages(0) and len(server.messages(3)) == 4  # retried as is; then the feedback


def test_a_500_then_a_valid_reply_lands(server, workspace, waits):
    server.script = [(500, "blip"), (200, VALID_GELU)]
    made = llm_candidate(workspace, make_intent(), config_for(server))
    assert isinstance(made, Candidate)
    assert len(server.messages(1)) == 2, "a transport failure is retried with the same messages"


def test_a_bad_key_gives_up_at_once(server, workspace, user_repo):
    before = snapshot(user_repo)
    server.script = [(401, "invalid api key")]
    refusal = llm_candidate(workspace, make_intent(), config_for(server))
    assert isinstance(refusal, CoderRefusal) and "HTTP 401" in refusal.reason and "API key" in refusal.reason
    assert len(server.requests) == 1
    assert_nothing_landed(workspace, user_repo, before)


def test_the_guard_refuses_an_endpoint_beyond_loopback(workspace, loopback_only, waits):
    config = LLMConfig(base_url="http://203.0.113.7:8000/v1", model="m", api_key=SecretStr("k"), timeout=5, max_attempts=1)
    refusal = llm_candidate(workspace, make_intent(), config)
    seen = list(loopback_only)
    loopback_only.clear()  # expected here; every other test ends with the list empty
    assert isinstance(refusal, CoderRefusal) and "ConnectionError" in refusal.reason and "test guard" in refusal.reason
    assert len(waits) == 4  # a refused connection is a transport failure: retried by the client, with backoff
    assert seen and all("203.0.113.7" in str(where) for where in seen)


# --- parsing and confinement units ---------------------------------------------------------------------


def test_parse_reply_reads_paths_fences_and_imports():
    reply = ("Two edits:\n\n```python\nsrc/m.py\n<<<<<<< SEARCH\na = 1\n=======\na = 2\n>>>>>>> REPLACE\n```\n"
             "<<<<<<< SEARCH\nb = 1\n=======\n>>>>>>> REPLACE\n"
             "<<<<<<< IMPORTS\nimport torch.nn.functional as F\n\n>>>>>>> IMPORTS\n")
    parsed = parse_reply(reply)
    assert [(b.file, b.search, b.replace) for b in parsed.blocks] == [("src/m.py", ["a = 1"], ["a = 2"]),
                                                                      ("src/m.py", ["b = 1"], [])]
    assert parsed.imports == ["import torch.nn.functional as F"]
    with pytest.raises(PatchRejected, match="exactly one ======="):
        parse_reply("<<<<<<< SEARCH\na\n=======\nb\n=======\nc\n>>>>>>> REPLACE\n")


def test_locate_refuses_ambiguous_and_outside_blocks():
    source = "def f(x):\n    y = x + 1\n    return y\n\n\ndef g(x):\n    y = x + 1\n    return y\n"
    span = SourceSpan(file="m.py", line_start=6, line_end=8)
    blocks = parse_reply(block("    y = x + 1", "    y = x.add(1)", "m.py")).blocks
    with pytest.raises(PatchRejected, match="occurs 2 times"):
        locate(blocks, {"m.py": source}, [span])
    unique = parse_reply(block("def g(x):\n    y = x + 1", "def g(x):\n    y = x.add(1)", "m.py")).blocks
    assert locate(unique, {"m.py": source}, [span])[0].start == 5
    first = parse_reply(block("def f(x):\n    y = x + 1", "def f(x):\n    y = x.add(1)", "m.py")).blocks
    with pytest.raises(PatchRejected, match="lines 1-2, outside the editable region"):
        locate(first, {"m.py": source}, [span])
    numbered = parse_reply(block("    7 |     y = x + 1", "    y = 2", "m.py")).blocks
    with pytest.raises(PatchRejected) as caught:
        locate(numbered, {"m.py": source}, [span])
    assert "line numbers" in caught.value.close[0]


# --- learned recipes -----------------------------------------------------------------------------------


def test_learned_expression_recipe_reproduces_the_accepted_patch(server, workspace, user_repo):
    server.script = [(200, VALID_GELU)]
    intent = make_intent()
    made = llm_candidate(workspace, intent, config_for(server))
    assert isinstance(made, Candidate)
    workspace.accept_candidate(made.name)
    recipe = learned_recipe(made, intent, repo_root=user_repo, target="cpu", model="fake-coder")
    assert recipe.provenance.kind == "learned" and recipe.match.kind == "expression"
    assert recipe.match.params["pattern"] == GELU_LINE.strip().removeprefix("return ")
    assert recipe.replacement == GELU_FUSED.strip().removeprefix("return ")
    assert recipe.category == IntentCategory.gelu and [str(t) for t in recipe.targets] == ["cpu"]
    assert f"commit {made.sha}" in recipe.provenance.sources and "aten::tanh" in recipe.keywords
    # the same code elsewhere (another copy, reformatted) is rewritten by the recipe alone
    elsewhere = "import math\nimport torch\n\ndef act(x):\n    return 0.5*x*(1.0 + torch.tanh(math.sqrt(2.0/math.pi)*(x + 0.044715*torch.pow(x, 3.0))))\n"
    edit = apply_recipe(elsewhere, recipe, SourceSpan(file="other.py", line_start=4, line_end=5))
    assert 'return torch.nn.functional.gelu(x, approximate="tanh")' in edit.source
    # literal names: a differently named variable is not matched
    renamed = elsewhere.replace("x", "h")
    with pytest.raises(CodemodRefused, match="no expression"):
        apply_recipe(renamed, recipe, SourceSpan(file="other.py", line_start=4, line_end=5))


def test_learned_semantic_recipe_from_an_npu_forward_rewrite(server, workspace, user_repo):
    fused = "        return torch_npu.npu_rms_norm(x, self.weight, epsilon=self.eps)[0]"
    server.script = [(200, block(RMS_BODY, fused) + "<<<<<<< IMPORTS\nimport torch_npu\n>>>>>>> IMPORTS\n")]
    intent = make_intent(RMS_SPAN, IntentCategory.rmsnorm)
    made = llm_candidate(workspace, intent, config_for(server), target="npu")
    assert isinstance(made, Candidate), made  # imported in a child against the torch_npu emulation
    assert "+import torch_npu" in made.diff and "+" + fused in made.diff
    recipe = learned_recipe(made, intent, repo_root=user_repo, target="npu")
    assert recipe.match.kind == "semantic" and recipe.imports == ["import torch_npu"]
    assert recipe.match.params["scope"] == "module_forward" and recipe.match.params["signature"] == ["x"]
    assert recipe.match.params["attributes"] == ["eps", "weight"]
    assert recipe.replacement == "torch_npu.npu_rms_norm($x, $self_weight, epsilon=$self_eps)[0]"
    # a differently named RMSNorm with the same body form gets the same rewrite
    other = ("import torch\n\n\nclass Norm(torch.nn.Module):\n    def __init__(self, d):\n        super().__init__()\n"
             "        self.eps = 1e-5\n        self.weight = torch.nn.Parameter(torch.ones(d))\n\n"
             "    def forward(self, h):\n        variance = h.pow(2).mean(-1, keepdim=True)\n"
             "        h = h * torch.rsqrt(variance + self.eps)\n        return self.weight * h\n")
    edit = apply_recipe(other, recipe, SourceSpan(file="n.py", line_start=10, line_end=13))
    assert "return torch_npu.npu_rms_norm(h, self.weight, epsilon=self.eps)[0]" in edit.source


def test_npu_patch_may_only_call_verifiable_fused_apis(server, workspace, user_repo):
    before = snapshot(user_repo)
    server.script = [(200, block(RMS_BODY, "        return torch_npu.npu_secret_norm(x)") +
                      "<<<<<<< IMPORTS\nimport torch_npu\n>>>>>>> IMPORTS\n")]
    refusal = llm_candidate(workspace, make_intent(RMS_SPAN, IntentCategory.rmsnorm), config_for(server, max_attempts=1),
                            target="npu")
    assert isinstance(refusal, CoderRefusal) and "torch_npu.npu_secret_norm" in refusal.reason
    assert_nothing_landed(workspace, user_repo, before)


def test_learned_recipe_refuses_patches_no_recipe_kind_expresses(server, workspace, user_repo):
    two = block("        variance = x.pow(2).mean(-1, keepdim=True)\n        x = x * torch.rsqrt(variance + self.eps)",
                "        variance = x.square().mean(-1, keepdim=True)\n        x = x * (variance + self.eps).rsqrt()")
    server.script = [(200, two)]
    intent = make_intent(RMS_SPAN, IntentCategory.rmsnorm)
    made = llm_candidate(workspace, intent, config_for(server))
    assert isinstance(made, Candidate), made
    with pytest.raises(LearnedRecipeError, match="no recipe kind expresses it"):
        learned_recipe(made, intent, repo_root=user_repo, target="cpu")


def test_an_unexpected_error_leaves_no_candidate_behind(workspace, user_repo):
    class BrokenChat:
        def invoke(self, messages):
            raise RuntimeError("the chat object broke")

    before = snapshot(user_repo)
    with pytest.raises(RuntimeError, match="broke"):
        llm_candidate(workspace, make_intent(), LLMConfig(model="m", base_url="http://127.0.0.1:9/v1"), chat=BrokenChat())
    assert_nothing_landed(workspace, user_repo, before)


def test_an_edit_that_reparents_code_after_the_region_is_refused(server, workspace, user_repo):
    before = snapshot(user_repo)
    first_two = "\n".join(RMS_BODY.splitlines()[:2])
    sneaky = first_two + "\n\n    def helper(self):\n        pass"  # line 20's return would now belong to helper
    server.script = [(200, block(first_two, sneaky))]
    refusal = llm_candidate(workspace, make_intent(RMS_SPAN, IntentCategory.rmsnorm), config_for(server, max_attempts=1))
    assert isinstance(refusal, CoderRefusal)
    assert "[structure]" in refusal.reason and "from RMSNorm.forward to RMSNorm.helper" in refusal.reason
    assert_nothing_landed(workspace, user_repo, before)
