"""Static source scan: the hand-written patterns TrainBridge can rewrite, found from the source alone.

Used with ``--static`` when there is no runtime evidence, and as a second opinion that pins down
exact line spans for runtime intents. Every finding is an ``Intent`` with
``source=IntentSource.static``, ``evidence.detectors == ["static"]``, a note saying what was
matched and a confidence of 0.3-0.6 (a source match says what code computes, not what it costs).

What is found (see ``patterns.EXPRESSION_PATTERNS`` and ``rules.PROGRAM_RULES``):
rmsnorm, layernorm, rope, swiglu, geglu, silu, gelu (tanh, erf and QuickGELU forms), attention
(matmul / einsum, spread over several statements), softmax, cross_entropy, normalize (L2),
permute_reshape, redundant_cast, optimizer_step (foreach=False; the default implementation at
lower confidence), zero_grad (set_to_none=False or
per-tensor p.grad.zero_()), host_sync (.item()/.cpu()/.tolist() once per training step) and
conv_layout (a conv net without channels_last anywhere in the scanned files).

Real-code forms: rotary as a rotation of the two halves (``rotary``), RMSNorm as
``F.normalize(x) * sqrt(d)``, per-parameter update loops of Muon-style optimizers and gradient
scaling and blocking per-parameter gradient collectives (``loops``; category communication),
optimizers whose fused/foreach is on only for CUDA (through a variable or ``**kwargs``), host
syncs in a step loop that holds a micro-batch or ``for opt in optimizers`` loop. A new
detector's finding that is all a helper function does spans the whole function (``helpers``).

Target-aware findings (``target=``, see ``targets``): for ``npu`` the library calls that
are one kernel on CUDA but not on the NPU (``library``: SDPA / flash-attn / flex attention,
``F.rms_norm`` / ``nn.RMSNorm``, fp32-upcast logits before ``F.cross_entropy``) and elementwise
chains (``chains``: ReLU², soft-capping, blends, scale-and-shift); for ``cuda`` the chains.

Deliberately not reported: a plain ``zero_grad()`` (``set_to_none=True`` is its default since
torch 2.0, so there is nothing to gain), elementwise chains when the target is unknown or the CPU,
and host syncs in code that runs once, every N steps, or in a loop that synchronizes the device
anyway.

Files that do not parse: ``scan_source`` raises ``StaticScanError`` naming the file and line;
``scan_repo`` skips such a file with a logged warning (``on_syntax_error="raise"`` to fail
instead), and ``scan_repo_result`` returns the skipped files with the reason. A detector that
raises on code nobody here has read loses only its own findings at that place: the scan goes on,
and ``scan_repo_result`` returns the failure (``detector_failures``), which ``analyze`` reports.

Which files ``scan_repo`` reads when none are given: every ``*.py`` under the root except hidden
folders, virtual environments, build output and tests (folders ``tests``/``test``, files
``test_*.py``, ``*_test.py``, ``conftest.py``): reference implementations in tests are not
rewrite targets.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.records import Intent

from .ir import build_file_model
from .library import TARGET_RULES
from .loops import LOOP_RULES
from .model import FileModel, StaticScanError
from .match import Ctx, Match, RepoIndex
from .patterns import EXPRESSION_PATTERNS, classify_helper
from .resolve import build_intents
from .rules import PROGRAM_RULES
from .targets import gains_for

__all__ = ["DetectorFailure", "StaticScanError", "StaticScanResult", "SkippedFile", "scan_repo", "scan_repo_result", "scan_source"]

log = logging.getLogger(__name__)

_SKIP_DIRS = frozenset(
    {"__pycache__", "venv", "env", "site-packages", "node_modules", "build", "dist", "tests", "test"}
)


class SkippedFile(BaseModel):
    """A file the scan could not read or parse, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str
    reason: str


class DetectorFailure(BaseModel):
    """A detector that raised: its findings at that place are lost, the rest of the scan is not."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    detector: str
    file: str | None = Field(default=None, description="where it failed (None: a rule over the whole repository)")
    line: int | None = Field(default=None, description="the first place in `file` it failed")
    error: str
    places: int = Field(default=1, description="how many places of `file` it failed at (the first one is described)")

    def describe(self) -> str:
        where = f" on {self.file}:{self.line}" if self.file and self.line else f" on {self.file}" if self.file else ""
        more = f" and {self.places - 1} more place(s) of that file" if self.places > 1 else ""
        return (f"static detector {self.detector} failed{where}{more} ({self.error}); its findings there are missing, "
                "the scan went on")


class StaticScanResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    intents: list[Intent]
    skipped: list[SkippedFile] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list, description="the repo-relative files that were scanned")
    detector_failures: list[DetectorFailure] = Field(default_factory=list)


def _failed(detector: str, exc: Exception, file: str | None = None, line: int | None = None) -> DetectorFailure:
    failure = DetectorFailure(detector=detector, file=file, line=line, error=f"{type(exc).__name__}: {exc}"[:300])
    log.warning("%s", failure.describe())
    return failure


def _expression_matches(index: RepoIndex, file: FileModel, gains: frozenset[str], failures: list[DetectorFailure],
                        configured_activations: bool = False) -> list[Match]:
    """Every expression pattern at every call of `file`; a pattern that raises loses that one place (`failures`)."""
    matches = []
    failed: dict[str, tuple[Exception, int, int]] = {}  # per detector: its first exception, line, and how many places
    patterns = [(i, p) for i, p in enumerate(EXPRESSION_PATTERNS) if p.gain is None or p.gain in gains]
    for scope in file.scopes:
        for root in scope.roots:
            for expr in root.walk():
                if expr.kind != "call":  # every operation is a call; names are followed by the patterns
                    continue
                for priority, p in patterns:
                    ctx = Ctx(index, file, scope, configured_activations=configured_activations)
                    try:
                        found = p.match(ctx, expr)
                        if found:
                            match = Match.from_ctx(p.category, ctx, expr, found, priority)
                            match.whole_function = p.whole_function
                            match.fallback = getattr(p, "fallback", False)
                            matches.append(match)
                    except Exception as exc:  # unseen code: one pattern at one place, never the whole scan
                        failed[str(p.category)] = failed.get(str(p.category)) or (exc, expr.start, 0)
                        first, line, places = failed[str(p.category)]
                        failed[str(p.category)] = (first, line, places + 1)
    for detector, (exc, line, places) in failed.items():
        failures.append(_failed(detector, exc, file.relpath, line).model_copy(update={"places": places}))
    return matches


def _rule_matches(rule, models: list[FileModel], failures: list[DetectorFailure]) -> list[Match]:
    try:
        return list(rule(models))
    except Exception as exc:  # a repository-wide rule: its findings are lost, the other detectors' are not
        failures.append(_failed(getattr(rule, "__name__", repr(rule)), exc))
        return []


def scan_models_result(files: dict[str, FileModel], target: str | None = None, *,
                       configured_activations: bool = False) -> tuple[list[Intent], list[DetectorFailure]]:
    """`scan_models`, with the detectors that raised (each loses its own findings at that place only).
    `configured_activations`: a library's scan, where an activation chosen by configuration matches any kind."""
    gains = gains_for(target)
    index = RepoIndex(files, classify_helper)
    models = list(files.values())
    matches: list[Match] = []
    failures: list[DetectorFailure] = []
    for file in models:
        matches += _expression_matches(index, file, gains, failures, configured_activations)
    for rule in PROGRAM_RULES + LOOP_RULES:
        matches += _rule_matches(rule, models, failures)
    for gain, rule in TARGET_RULES:
        if gain in gains:
            matches += _rule_matches(rule, models, failures)
    return build_intents(matches), failures


def scan_models(files: dict[str, FileModel], target: str | None = None) -> list[Intent]:
    """Intents of already-parsed files (keys: repo-relative POSIX paths).

    ``target`` ('npu', 'cuda', 'cpu' or None) adds the findings that are a gain only there
    (targets.GAINS); None reports the target-independent ones. A detector that raises is logged and
    loses only its own findings at that place (`scan_models_result` returns them).
    """
    return scan_models_result(files, target)[0]


def scan_source(code: str, relpath: str, target: str | None = None, *, library: bool = False) -> list[Intent]:
    """Intents of one file's source. Raises StaticScanError when it does not parse. `library`: a library file the
    step ran (agents/analyst/library_scan.py), whose configured activations (`ACT2FN[...]`) match any kind there.

    Rules that look at the whole repository (conv_layout's "channels_last anywhere", helper
    functions imported from other files) see only this file.
    """
    return scan_models_result({relpath: build_file_model(code, relpath)}, target, configured_activations=library)[0]


def _discover(root: Path) -> list[Path]:
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p in _SKIP_DIRS for p in parts[:-1]):
            continue
        name = parts[-1]
        if name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py":
            continue
        found.append(path)
    return found


def _relpath(root: Path, path: Path) -> str:
    full = path if path.is_absolute() else root / path
    try:
        return full.resolve().relative_to(root).as_posix()
    except ValueError:
        raise ValueError(f"{path} is not inside the repository {root}: pass files under the scanned root") from None


def scan_repo_result(
    root: Path,
    files: list[Path] | None = None,
    *,
    on_syntax_error: Literal["skip", "raise"] = "skip",
    target: str | None = None,
) -> StaticScanResult:
    """Scan ``files`` (absolute or relative to ``root``; default: the repository's sources) for ``target``."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"repository root {root} is not a directory")
    paths = _discover(root) if files is None else [Path(f) for f in files]
    models: dict[str, FileModel] = {}
    skipped: list[SkippedFile] = []
    for path in paths:
        rel = _relpath(root, path)
        full = root / rel
        try:
            code = full.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            if on_syntax_error == "raise":
                raise StaticScanError(rel, None, f"cannot read it ({exc})") from exc
            skipped.append(SkippedFile(file=rel, reason=f"cannot read it: {exc}"))
            log.warning("static scan skipped %s: cannot read it (%s)", rel, exc)
            continue
        try:
            models[rel] = build_file_model(code, rel)
        except StaticScanError as exc:
            if on_syntax_error == "raise":
                raise
            skipped.append(SkippedFile(file=rel, reason=str(exc)))
            log.warning("static scan skipped %s", exc)
    intents, failures = scan_models_result(models, target)
    return StaticScanResult(intents=intents, skipped=skipped, files=sorted(models), detector_failures=failures)


def scan_repo(
    root: Path,
    files: list[Path] | None = None,
    *,
    on_syntax_error: Literal["skip", "raise"] = "skip",
    target: str | None = None,
) -> list[Intent]:
    """Intents of a repository's sources; see the module docstring for what is read and skipped."""
    return scan_repo_result(root, files, on_syntax_error=on_syntax_error, target=target).intents
