"""Evidence a gate child leaves in its scratch folder, bound to what it says over its own channel.

A child saves its evidence (the probe's first-step gradients, each parameter's change over the timed steps) with
`save_evidence`, which writes the bytes it serialized and returns their SHA-256; the child reports that digest in its
reply on its own control channel. The gate loads the file with `load_evidence`, which refuses bytes whose digest is
not the reported one: a file another process wrote after the child reported it (the other side of a paired round,
copying its own evidence over its partner's) is found out, whatever it holds.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any


class EvidenceMismatch(ValueError):
    """An evidence file's bytes are not the ones its child reported."""


def save_evidence(obj: Any, path: Path) -> str:
    """torch.save `obj` to `path`; the SHA-256 of exactly the bytes written."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def load_evidence(path: Path, sha256: str | None) -> dict:
    """The tensors a child saved at `path`, read once; EvidenceMismatch when their digest is not `sha256` (a child
    that reported none is taken as it is: a harness of before the digests)."""
    import torch

    data = Path(path).read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise EvidenceMismatch(f"{Path(path).name} is not what its child reported over its channel (SHA-256 "
                               f"{hashlib.sha256(data).hexdigest()[:12]}, reported {sha256[:12]}): another process wrote it")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
