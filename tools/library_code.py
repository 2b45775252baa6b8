"""Code outside the user's repository that ops are attributed to: installed libraries (transformers, timm, ...).

A file is library code when it lies under a `site-packages` / `dist-packages` folder and its top-level package is
not transparent. Transparent (an op passes through them to the frame that called them, as before libraries were
located): PyTorch itself and its companions (`torch/nn/functional.py` is how user code runs ops, not a region),
TrainBridge, and everything else outside site-packages (the standard library, frozen modules, generated code).

A library file is named by its path under the import root (`transformers/models/llama/modeling_llama.py`), so the
eager profile and a compile reference captured on another machine name it alike; its module, distribution and
version come from importlib.metadata of this interpreter. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re

from trainbridge.records import LibrarySpan

_SITE_DIRS = re.compile(r"[/\\](?:site|dist)-packages[/\\]")
# top-level packages whose frames are transparent even inside site-packages
TRANSPARENT_PACKAGES = frozenset({"torch", "functorch", "torchgen", "torch_npu", "triton", "trainbridge", "_pytest",
                                  "pluggy", "typing_extensions"})


def library_path(filename: str) -> str | None:
    """`filename` under its import root ('transformers/models/llama/modeling_llama.py') when it is library code,
    else None (user code, PyTorch, TrainBridge, the standard library, `<frozen ...>`)."""
    if not filename or filename.startswith("<"):
        return None
    parts = _SITE_DIRS.split(filename)
    if len(parts) < 2:
        return None
    rel = parts[-1].replace("\\", "/")
    top = rel.split("/", 1)[0]
    top = top[:-3] if top.endswith(".py") else top
    if not top or top in TRANSPARENT_PACKAGES or top.endswith((".dist-info", ".egg-info")) or not rel.endswith(".py"):
        return None
    return rel


def module_name(rel: str) -> str:
    """'transformers/models/llama/modeling_llama.py' -> 'transformers.models.llama.modeling_llama'."""
    dotted = rel[:-3].replace("/", ".") if rel.endswith(".py") else rel.replace("/", ".")
    return dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted


@functools.cache
def distribution_of(top_package: str) -> tuple[str | None, str | None]:
    """The installed distribution that provides `top_package`, and its version (None, None when unknown)."""
    names = _packages_distributions().get(top_package) or []
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return (names[0] if names else None), None


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def library_span(rel: str, line_start: int, line_end: int, function: str | None) -> LibrarySpan:
    """A LibrarySpan of library file `rel` with its module, distribution and version filled in."""
    distribution, version = distribution_of(rel.split("/", 1)[0].removesuffix(".py"))
    return LibrarySpan(file=rel, line_start=line_start, line_end=max(line_start, line_end), module=module_name(rel),
                       function=function, distribution=distribution, version=version)
