"""Where the optional LLM coder talks to: an OpenAI-compatible endpoint, a model, a key, limits.

Nothing here reads the environment or builds a client on import. `LLMConfig.from_env(env)` reads
the mapping it is given (pass ``os.environ`` at the entry point) and returns None when no LLM is
configured, so that every part of TrainBridge works from recipes alone. An API key on its own
(``OPENAI_API_KEY`` is often set for other tools) does not switch the LLM on: the user opts in by
naming a model or an endpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

ENV_BASE_URL = "TRAINBRIDGE_LLM_BASE_URL"
ENV_MODEL = "TRAINBRIDGE_LLM_MODEL"
ENV_API_KEY = "TRAINBRIDGE_LLM_API_KEY"
ENV_FALLBACK_API_KEY = "OPENAI_API_KEY"
ENV_TIMEOUT = "TRAINBRIDGE_LLM_TIMEOUT"
ENV_MAX_ATTEMPTS = "TRAINBRIDGE_LLM_MAX_ATTEMPTS"
ENV_RETRIES = "TRAINBRIDGE_LLM_RETRIES"
DEFAULT_BASE_URL = "https://api.openai.com/v1"


class LLMConfigError(ValueError):
    """The LLM settings are present but unusable; the message names the variable to fix."""


class LLMConfig(BaseModel):
    """An OpenAI-compatible chat endpoint for the coder. The key never appears in repr or logs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(default=DEFAULT_BASE_URL, description="OpenAI-compatible API root, e.g. http://host:8000/v1")
    model: str = Field(min_length=1)
    api_key: SecretStr | None = Field(default=None, description="None for local servers that take no key")
    timeout: float = Field(default=120.0, gt=0, le=3600, description="seconds per request")
    max_attempts: int = Field(default=3, ge=1, le=10, description="model replies tried per intent before giving up")
    transport_retries: int = Field(default=4, ge=0, le=20, description="retries of one request after a 429, 5xx, timeout "
                                   "or dropped connection (llm/client.py); they use up no patch attempt")
    backoff_s: float = Field(default=1.0, ge=0, le=60, description="wait before the first retry; doubles per retry")
    temperature: float | None = Field(default=0.0, ge=0, le=2, description="None: let the server choose")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parsed = urlparse(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"base_url {value!r} must be an http(s) URL such as http://127.0.0.1:8000/v1")
        return value.rstrip("/")

    def key_value(self) -> str:
        """The key to send. Keyless local servers get a placeholder (the OpenAI client insists on one)."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if urlparse(self.base_url).hostname == urlparse(DEFAULT_BASE_URL).hostname:
            raise LLMConfigError(f"{self.base_url} needs an API key: set {ENV_API_KEY} (or {ENV_FALLBACK_API_KEY}).")
        return "no-key"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LLMConfig | None:
        """Settings from `env`; None when neither a model nor an endpoint is named.

        Raises `LLMConfigError` when the LLM is half-configured or a value is malformed.
        """
        base_url = (env.get(ENV_BASE_URL) or "").strip()
        model = (env.get(ENV_MODEL) or "").strip()
        if not base_url and not model:
            return None
        if not model:
            raise LLMConfigError(f"{ENV_BASE_URL} is set but {ENV_MODEL} is not: name the model the endpoint "
                                 f"serves (e.g. {ENV_MODEL}=qwen2.5-coder-32b), or unset {ENV_BASE_URL}.")
        key = (env.get(ENV_API_KEY) or env.get(ENV_FALLBACK_API_KEY) or "").strip()
        data: dict[str, object] = {"model": model}
        if base_url:
            data["base_url"] = base_url
        if key:
            data["api_key"] = key
        for name, field in ((ENV_TIMEOUT, "timeout"), (ENV_MAX_ATTEMPTS, "max_attempts"), (ENV_RETRIES, "transport_retries")):
            if (env.get(name) or "").strip():
                data[field] = env[name].strip()
        try:
            config = cls.model_validate(data)
        except ValidationError as exc:
            names = {"base_url": ENV_BASE_URL, "model": ENV_MODEL, "timeout": ENV_TIMEOUT,
                     "max_attempts": ENV_MAX_ATTEMPTS, "api_key": ENV_API_KEY, "transport_retries": ENV_RETRIES}
            lines = [f"{names.get(str(err['loc'][0]), err['loc'][0])}: {err['msg'].removeprefix('Value error, ')}"
                     for err in exc.errors(include_url=False)]
            raise LLMConfigError("Invalid LLM settings:\n" + "\n".join(lines)) from None
        config.key_value()  # a cloud endpoint without a key fails here, not at the first request
        return config
