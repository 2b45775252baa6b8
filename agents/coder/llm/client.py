"""Talking to the OpenAI-compatible endpoint: one request, with the transport's own retries.

Rate limits (429), server errors (5xx), request timeouts (408), conflicts (409), dropped
connections and timeouts are retried here, with exponential backoff (`LLMConfig.backoff_s`,
doubling, at most `MAX_BACKOFF_S`, or the server's Retry-After when it sends one) up to
`LLMConfig.transport_retries` times. They never use up one of the coder's patch attempts (those are
for replies the checks refused). A request that still fails, or fails in a way retrying cannot fix
(a bad key, an unknown model), raises `RequestFailed`, which ends the coder's turn for the intent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainbridge.agents.coder.llm.config import ENV_API_KEY, ENV_FALLBACK_API_KEY, ENV_RETRIES, LLMConfig

MAX_BACKOFF_S = 30.0
_sleep = time.sleep  # tests replace it to record the backoff instead of waiting
RETRIED_STATUS = (408, 409, 429)  # and every 5xx


class RequestFailed(Exception):
    """The endpoint gave no reply: `message` says why and what to check; `requests` were sent."""

    def __init__(self, message: str, requests: int) -> None:
        super().__init__(message)
        self.message, self.requests = message, requests


def make_chat(config: LLMConfig) -> Any:
    """The chat client for `config` (only ever built when an LLM is configured). Its own retries are
    off: `ask` retries, with backoff, so that every retry is visible and limited in one place."""
    from langchain_openai import ChatOpenAI

    options: dict[str, Any] = {"model": config.model, "base_url": config.base_url, "api_key": config.key_value(),
                               "timeout": config.timeout, "max_retries": 0}
    if config.temperature is not None:
        options["temperature"] = config.temperature
    return ChatOpenAI(**options)


def ask(chat: Any, messages: list[Any], config: LLMConfig, *, sleep: Callable[[float], None] | None = None) -> str:
    """The model's reply text to `messages`; RequestFailed when there is none after the retries."""
    import openai

    failures: list[str] = []
    for number in range(config.transport_retries + 1):
        if number:
            (sleep or _sleep)(_delay(config, number, failures[-1]))
        try:
            reply = chat.invoke(messages)
        except openai.APIStatusError as exc:
            detail = f"HTTP {exc.status_code} from {config.base_url}: {str(exc.message)[:300]}"
            if exc.status_code in (401, 403):
                raise RequestFailed(f"{detail}. Check the API key ({ENV_API_KEY} or {ENV_FALLBACK_API_KEY}).", number + 1) from None
            if exc.status_code in RETRIED_STATUS or exc.status_code >= 500:
                failures.append(_with_retry_after(detail, exc))
                continue
            raise RequestFailed(f"{detail}. Check the model name {config.model!r} and that the endpoint is "
                                "OpenAI-compatible.", number + 1) from None
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:  # refused, reset, timed out
            failures.append(f"request to {config.base_url} failed: {type(exc).__name__}: {exc}{_root_cause(exc)}")
            continue
        except openai.APIError as exc:  # a malformed response: the endpoint is not what it claims
            raise RequestFailed(f"request to {config.base_url} failed: {type(exc).__name__}: {exc}{_root_cause(exc)}",
                                number + 1) from None
        content = reply.content
        if isinstance(content, list):
            content = "".join(part if isinstance(part, str) else str(part.get("text", "")) for part in content)
        return str(content)
    summary = "; ".join(dict.fromkeys(f.split(" [retry-after")[0] for f in failures))
    raise RequestFailed(f"no reply after {len(failures)} request(s) with backoff ({summary}). The endpoint is down or "
                        f"rate-limiting: try later, or allow more retries with {ENV_RETRIES}.", len(failures))


def _delay(config: LLMConfig, retry: int, last_failure: str) -> float:
    if " [retry-after " in last_failure:
        return min(MAX_BACKOFF_S, float(last_failure.rsplit(" [retry-after ", 1)[1].rstrip("]")))
    return min(MAX_BACKOFF_S, config.backoff_s * 2 ** (retry - 1))


def _with_retry_after(detail: str, exc: Any) -> str:
    value = (getattr(getattr(exc, "response", None), "headers", None) or {}).get("retry-after")
    try:
        return f"{detail} [retry-after {max(0.0, float(value))}]" if value is not None else detail
    except ValueError:  # an HTTP date: use our own backoff
        return detail


def _root_cause(exc: BaseException) -> str:
    root, seen = exc, {id(exc)}
    while (root.__cause__ or root.__context__) is not None and id(root.__cause__ or root.__context__) not in seen:
        root = root.__cause__ or root.__context__
        seen.add(id(root))
    return f" (cause: {type(root).__name__}: {root})" if root is not exc else ""
