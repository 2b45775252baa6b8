"""The LLM coder against a real loopback OpenAI-compatible server, through the real ChatOpenAI client:
its configuration, a valid patch, and what never lands.

Every test runs on a real temporary git repository (the user's checkout) and a real run workspace;
a socket guard makes any connection or name lookup beyond loopback fail the test (tests/llm_coder_support.py).
"""

from __future__ import annotations

import sys

import git
import pytest

from trainbridge.agents.coder.llm import client as llm_client
from trainbridge.agents.coder.candidate import Candidate, CoderRefusal
from trainbridge.agents.coder.llm.patch import llm_candidate
from trainbridge.agents.coder.llm.config import LLMConfig, LLMConfigError
from trainbridge.records import IntentCategory, SourceSpan
from trainbridge.tools.git.ops import RunWorkspace, open_repo
from trainbridge.tests.llm_coder_support import (  # noqa: F401 (fixtures)
    GELU_FUSED,
    GELU_LINE,
    MODEL,
    RMS_BODY,
    RMS_SPAN,
    VALID_GELU,
    assert_nothing_landed,
    block,
    config_for,
    loopback_only,
    make_intent,
    no_global_git_identity,
    server,
    snapshot,
    user_repo,
    workspace,
)


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


def test_npu_patch_may_only_call_verifiable_fused_apis(server, workspace, user_repo):
    before = snapshot(user_repo)
    server.script = [(200, block(RMS_BODY, "        return torch_npu.npu_secret_norm(x)") +
                      "<<<<<<< IMPORTS\nimport torch_npu\n>>>>>>> IMPORTS\n")]
    refusal = llm_candidate(workspace, make_intent(RMS_SPAN, IntentCategory.rmsnorm), config_for(server, max_attempts=1),
                            target="npu")
    assert isinstance(refusal, CoderRefusal) and "torch_npu.npu_secret_norm" in refusal.reason
    assert_nothing_landed(workspace, user_repo, before)


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
