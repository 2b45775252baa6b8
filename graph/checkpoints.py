"""Where a run's checkpoints live: a SQLite file in the run's folder (one machine, the default) or a
Postgres database (a team: any machine that reaches the database and the repository can show,
review, resume or report the run).

`--checkpoint postgresql://user@host:5432/db` selects Postgres (langgraph-checkpoint-postgres over
psycopg; `pip install 'trainbridge[team]'`). The URL is saved with the run (run.json and the
checkpointed settings), so it must not carry a password: libpq reads it from PGPASSWORD or
~/.pgpass. One process runs a run at a time: on Postgres a session advisory lock keyed by the run
id says so across machines, and the server drops it when its holder's connection dies (a killed
process), as the kernel drops the local flock.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit
from trainbridge.settings import settings

CHECKPOINT_ENV = "TRAINBRIDGE_CHECKPOINT"  # the default of --checkpoint for status/resume/review/report
POSTGRES_SCHEMES = ("postgresql", "postgres")
INSTALL_HELP = "pip install 'trainbridge[team]' (langgraph-checkpoint-postgres and psycopg)"


class CheckpointError(RuntimeError):
    """The checkpoint store cannot be used; the message says what to do."""


def check_checkpoint_url(url: str | None) -> str | None:
    """None (SQLite in the run's folder) or a Postgres URL without a password; anything else is refused."""
    if url is None or url == "" or url == "sqlite":
        return None
    parts = urlsplit(url)
    if parts.scheme not in POSTGRES_SCHEMES:
        raise ValueError(f"--checkpoint takes a Postgres URL (postgresql://user@host:5432/dbname), not {url!r}; "
                         f"leave it out for the SQLite file in the run's folder")
    if parts.password:
        raise ValueError("the checkpoint URL is saved with the run: leave the password out of it and put it in "
                         "PGPASSWORD or ~/.pgpass (libpq reads both)")
    if not parts.hostname and "host=" not in (parts.query or ""):
        raise ValueError(f"the checkpoint URL {url!r} names no host: postgresql://user@host:5432/dbname")
    return url


def is_postgres(url: str | None) -> bool:
    return url is not None and urlsplit(url).scheme in POSTGRES_SCHEMES


def default_checkpoint(given: str | None) -> str | None:
    """The URL a command was given, else TRAINBRIDGE_CHECKPOINT (read when a command runs, not at import)."""
    return check_checkpoint_url(given if given else settings().CHECKPOINT)


@contextmanager
def open_checkpointer(url: str | None, sqlite_file: Path) -> Iterator[Any]:
    """A LangGraph checkpointer: SqliteSaver on `sqlite_file`, or PostgresSaver on `url` (its tables
    are created on first use; `setup()` is idempotent)."""
    if not is_postgres(url):
        import sqlite3

        from langgraph.checkpoint.sqlite import SqliteSaver

        sqlite_file.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(str(sqlite_file), check_same_thread=False)
        try:
            yield SqliteSaver(connection)
        finally:
            connection.close()
        return
    saver_type = _postgres_saver()
    try:
        manager = saver_type.from_conn_string(url)
        saver = manager.__enter__()
    except Exception as exc:  # psycopg.OperationalError and friends: say where and what to check
        raise CheckpointError(f"cannot reach the checkpoint database {redacted(url)}: {_first_line(exc)} "
                              f"(is the server up, does the database exist, may this user connect?)") from None
    try:
        saver.setup()
        yield saver
    finally:
        manager.__exit__(None, None, None)


@contextmanager
def database_run_lock(url: str | None, run_id: str) -> Iterator[None]:
    """Hold the run across machines (Postgres only; nothing to do for SQLite, whose run folder's flock
    already covers its one machine). Raises CheckpointError naming the holder when another has it."""
    if not is_postgres(url):
        yield
        return
    import psycopg

    key = int.from_bytes(hashlib.sha256(f"trainbridge-run:{run_id}".encode()).digest()[:8], "big", signed=True)
    try:
        connection = psycopg.connect(url, autocommit=True)
    except psycopg.Error as exc:
        raise CheckpointError(f"cannot reach the checkpoint database {redacted(url)}: {_first_line(exc)}") from None
    try:
        held = connection.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
        if not held:
            raise CheckpointError(f"run {run_id!r} is already running on some machine (it holds the run's lock in "
                                  f"{redacted(url)}): wait for it to finish or stop it, then "
                                  f"`trainbridge resume {run_id} --checkpoint {redacted(url)}`")
        yield
    finally:
        connection.close()  # the session's advisory lock goes with it


def database_runs(url: str) -> list[str]:
    """Run ids checkpointed in the Postgres database at `url` (its threads), for `trainbridge status`."""
    import psycopg

    try:
        with psycopg.connect(url, autocommit=True) as connection:
            exists = connection.execute("SELECT to_regclass('checkpoints') IS NOT NULL").fetchone()[0]
            rows = connection.execute("SELECT DISTINCT thread_id FROM checkpoints").fetchall() if exists else []
    except psycopg.Error as exc:
        raise CheckpointError(f"cannot read the checkpoint database {redacted(url)}: {_first_line(exc)}") from None
    return sorted(row[0] for row in rows)


def redacted(url: str) -> str:
    parts = urlsplit(url)
    return url.replace(f":{parts.password}@", ":***@") if parts.password else url


def _postgres_saver():
    try:
        from langgraph.checkpoint.postgres import PostgresSaver
    except ImportError:
        raise CheckpointError(f"Postgres checkpoints need the team extra: {INSTALL_HELP}") from None
    return PostgresSaver


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
