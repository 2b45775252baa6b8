"""The control channel between the parent and a sandbox child: JSON lines over two pipes.

The parent drives a step-timing child through it: it sends the request, then one command at a time
(`probe`, `step`, `final`, `exit`), and timestamps each command and its reply with its own clock.
The child only ever answers; it never learns the next command before it has answered the last one.
Both sides use this module (it imports nothing but the standard library).
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

MAX_LINE_BYTES = 64 * 1024 * 1024


class ChannelClosed(EOFError):
    """The other side closed its end (the child exited or died)."""


class ChannelTimeout(TimeoutError):
    """No complete message before the deadline."""


class ChannelProtocolError(ValueError):
    """A line that is not a JSON object, or one longer than MAX_LINE_BYTES."""


class Channel:
    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd, self.write_fd = read_fd, write_fd
        self._buffer = bytearray()

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:
            written = os.write(self.write_fd, view)
            view = view[written:]

    def recv(self, deadline: float | None = None) -> dict[str, Any]:
        """The next message; `deadline` on time.monotonic() (None: wait for ever)."""
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                try:
                    message = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ChannelProtocolError(f"not a JSON line: {line[:200]!r}") from exc
                if not isinstance(message, dict):
                    raise ChannelProtocolError(f"not a JSON object: {line[:200]!r}")
                return message
            if len(self._buffer) > MAX_LINE_BYTES:
                raise ChannelProtocolError(f"a line longer than {MAX_LINE_BYTES} bytes")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelTimeout("no message before the deadline")
                ready, _, _ = select.select([self.read_fd], [], [], left)
                if not ready:
                    raise ChannelTimeout("no message before the deadline")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise ChannelClosed("the other side closed the channel")
            self._buffer += chunk

    def pending(self) -> bool:
        """Whether more bytes are waiting (after a reply: the other side sent more than it was asked)."""
        if self._buffer:
            return True
        ready, _, _ = select.select([self.read_fd], [], [], 0)
        return bool(ready)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
