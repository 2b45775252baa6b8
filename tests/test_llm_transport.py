"""The LLM coder when the server misbehaves: transport retries with backoff in the client (not the
patch budget), rate limits, bad keys, an endpoint beyond loopback.

Every test runs on a real temporary git repository (the user's checkout) and a real run workspace;
a socket guard makes any connection or name lookup beyond loopback fail the test (tests/llm_coder_support.py).
"""

from __future__ import annotations

from pydantic import SecretStr

from trainbridge.agents.coder.candidate import Candidate, CoderRefusal
from trainbridge.agents.coder.llm.patch import llm_candidate
from trainbridge.agents.coder.llm.config import LLMConfig
from trainbridge.tests.llm_coder_support import (  # noqa: F401 (fixtures)
    VALID_GELU,
    assert_nothing_landed,
    config_for,
    loopback_only,
    make_intent,
    no_global_git_identity,
    server,
    snapshot,
    user_repo,
    waits,
    workspace,
)


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
