"""Where a knowledge base lives: an embedded Chroma directory or a Chroma server, opened with the
settings every TrainBridge client uses (no telemetry, no reset).

    default_kb_dir()                      # $TRAINBRIDGE_KB_DIR, $TRAINBRIDGE_HOME/kb, else the XDG data dir
    open_directory(Path("/data/kb"))      # (client, "/data/kb")
    connect_server("http://kb-host:8000") # (client, "http://kb-host:8000"), after a heartbeat
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import chromadb
from chromadb.config import Settings

from trainbridge.knowledge.store_records import KnowledgeBaseError
from trainbridge.settings import settings


def default_kb_dir() -> Path:
    """$TRAINBRIDGE_KB_DIR, else $TRAINBRIDGE_HOME/kb (beside its runs/), else $XDG_DATA_HOME/trainbridge/kb,
    else ~/.local/share/trainbridge/kb."""
    current = settings()
    return current.KB_DIR.expanduser() if current.KB_DIR is not None else current.data_dir("kb")


def client_settings() -> Settings:
    return Settings(anonymized_telemetry=False, allow_reset=False)


def open_directory(path: str | Path | None) -> tuple[Any, str]:
    """An embedded client on `path` (default: `default_kb_dir()`), created if missing, and its location."""
    directory = (Path(path).expanduser() if path is not None else default_kb_dir()).resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KnowledgeBaseError(
            f"cannot create the knowledge base directory {directory}: {exc.strerror}; "
            "pass another one (--kb-dir or TRAINBRIDGE_KB_DIR)"
        ) from None
    try:
        return chromadb.PersistentClient(path=str(directory), settings=client_settings()), str(directory)
    except Exception as exc:  # noqa: BLE001 - chromadb's own errors (a damaged or foreign database) name no remedy
        raise KnowledgeBaseError(
            f"the knowledge base at {directory} cannot be opened ({type(exc).__name__}: {str(exc)[:300]}): its database "
            "is damaged or not Chroma's. Move the folder aside (its outcomes are lost unless you have an export: "
            "`trainbridge kb export`) and run again to start a fresh one, or pass another with --kb-dir"
        ) from None


def connect_server(url: str, headers: dict[str, str] | None = None) -> tuple[Any, str]:
    """A client on the Chroma server at `url` (``chroma run``), checked with a heartbeat, and its location."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise KnowledgeBaseError(f"--kb-url must look like http://host:port, got {url!r}")
    if parsed.path not in ("", "/"):
        raise KnowledgeBaseError(f"--kb-url takes no path (got {parsed.path!r}): use http://host:port")
    ssl = parsed.scheme == "https"
    port = parsed.port or (443 if ssl else 8000)
    try:
        client = chromadb.HttpClient(host=parsed.hostname, port=port, ssl=ssl, headers=headers,
                                     settings=client_settings())
        client.heartbeat()
    except Exception as exc:  # noqa: BLE001 - any failure here means the server is not usable
        raise KnowledgeBaseError(
            f"cannot reach the Chroma server at {url}: {exc}. Start one with "
            "`chroma run --path DIR --host HOST --port PORT`, or leave out --kb-url to use the "
            "local knowledge base"
        ) from None
    return client, f"{parsed.scheme}://{parsed.hostname}:{port}"
