"""Semantic matching for function-shaped regions (issue 13, item 4): the first candidate replacement that
computes what the region computes, found by running both.

A ``semantic`` recipe with ``params.candidates`` (replacement expressions, in the recipe's argument
names) and ``params.probe`` (input shapes; or shapes captured from the real step, passed by the caller)
is matched by behaviour, not by spelling: tools/codemods/region_probe.py writes a program that runs the
region and one candidate on the same seeded inputs and compares outputs and input gradients; the
program runs here in a confined child (scrubbed environment, memory cap, no network, its own process
group, NPU emulation on its path for the npu target), never in this process. The recipe's
syntactic ``alternatives`` stay the fast path: `match_region` is only asked when they did not match.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from trainbridge.knowledge.schema import Recipe
from trainbridge.records import SourceSpan
from trainbridge.sandbox.backends import Backend, npu_selection
from trainbridge.sandbox.confinement import child_sandbox
from trainbridge.sandbox.isolation import default_memory_limit_mb, limit_memory, scrubbed_env
from trainbridge.sandbox.npu_emulation import selection_env
from trainbridge.tools.codemods.engine import CodemodRefused, Edit, apply_recipe
from trainbridge.tools.codemods.pattern import PatternError
from trainbridge.tools.codemods.region_probe import ProbeError, build_probe, verdict
from trainbridge.tools.codemods.template import TemplateError

TIMEOUT_S = 120.0
# The probe draws float32 inputs: a right candidate agrees with the region to float32 rounding. (The
# recipe's own numerics class is for the gate's training check, in the program's dtypes: bf16 autocast
# there moves single entries by an ulp.)
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-5
MARK = "TB_PROBE "


@dataclass
class CandidateCheck:
    replacement: str
    equivalent: bool
    detail: str


@dataclass
class SemanticMatch:
    """The outcome: the replacement found equivalent (None when none was), and every check made."""

    function: str
    site: SourceSpan
    replacement: str | None
    checks: list[CandidateCheck] = field(default_factory=list)

    def summary(self) -> str:
        if self.replacement is not None:
            ok = next(c for c in self.checks if c.equivalent)
            return f"{self.function}: {ok.detail} (candidate {len(self.checks)} of the recipe's, {ok.replacement})"
        return f"{self.function}: no candidate computes the same: " + " | ".join(f"{c.replacement}: {c.detail}" for c in self.checks)


def run_probe(program: str, *, root: Path | None, target: str, timeout_s: float = TIMEOUT_S, seed: int = 0) -> list[dict]:
    """Run a probe program in a confined child; its JSON reports, one per candidate it reached (a single
    ``equivalent: False`` report with the reason when the child failed before the first)."""
    env = scrubbed_env({**Backend(target).child_env(), "PYTHONPATH": str(root) if root else ""}, threads=1, seed=seed)
    if target == "npu":
        env = selection_env(npu_selection(), env)
    with tempfile.TemporaryDirectory(prefix="tb-semantic-") as tmp:
        script = Path(tmp) / "probe.py"
        script.write_text(program, encoding="utf-8")
        box = child_sandbox(Path(tmp), root=root, backend=target)
        argv = [*box.prefix, sys.executable, str(script)]
        child = subprocess.Popen(argv, cwd=tmp, env={**env, **box.env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=limit_memory(default_memory_limit_mb()), start_new_session=True)
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            err += f"\nthe probe ran past {timeout_s:.0f} s"
    reports = [json.loads(x[len(MARK):]) for x in out.splitlines() if x.startswith(MARK)]
    if not reports:
        tail = (err.strip().splitlines() or ["no output"])[-1]
        return [{"equivalent": False, "reason": f"the probe failed (exit {child.returncode}): {tail[:300]}"}]
    return reports


def match_region(source: str, span: SourceSpan, recipe: Recipe, *, target: str, root: Path | None = None,
                 captured: dict | None = None, timeout_s: float = TIMEOUT_S) -> SemanticMatch:
    """Run every candidate of the recipe next to the function holding ``span`` (one child); the first
    equivalent one, in the recipe's order, wins.

    Raises ProbeError when the region cannot be probed (not a function, no shapes)."""
    device = "npu" if target == "npu" else "cpu"
    rtol, atol = PROBE_RTOL, PROBE_ATOL
    probe = build_probe(source, span, recipe, captured=captured, device=device)
    reports = run_probe(probe.program, root=root, target=target, timeout_s=timeout_s)
    by_index = {r["candidate"]: r for r in reports if "candidate" in r}
    failed = next((r for r in reports if "candidate" not in r), {"equivalent": False, "reason": "the probe stopped before it"})
    found = SemanticMatch(function=probe.function, site=probe.site, replacement=None)
    for index, replacement in enumerate(probe.replacements):
        report = by_index.get(index, failed)
        ok, detail = verdict(report, rtol=rtol, atol=atol)
        found.checks.append(CandidateCheck(replacement=replacement, equivalent=ok, detail=detail))
        if ok:
            found.replacement = replacement
            break
    return found


def probes(recipe: Recipe) -> bool:
    """Whether the recipe is matched by behaviour when its syntactic forms miss."""
    params = recipe.match.params
    return recipe.match.kind == "semantic" and bool(params.get("probe") or params.get("candidates"))


def recipe_target(recipe: Recipe) -> str:
    return "npu" if any(str(t.value) == "npu" for t in recipe.targets) else "cpu"


def apply_semantically(source: str, span: SourceSpan, recipe: Recipe, *, root: Path | None = None,
                       captured: dict | None = None) -> tuple[Edit | None, str]:
    """(the edit, a note) with the first equivalent candidate written in; (None, why) when none is or
    the region cannot be probed."""
    try:
        found = match_region(source, span, recipe, target=recipe_target(recipe), root=root, captured=captured)
    except (ProbeError, PatternError, TemplateError, cst.ParserSyntaxError) as exc:
        return None, f"the region cannot be probed: {exc}"
    if found.replacement is None:
        return None, found.summary()
    params = {k: v for k, v in recipe.match.params.items() if k not in ("alternatives", "probe", "candidates")}  # decided
    if params.get("define") and not _uses_definitions(str(params["define"]), found.replacement):
        del params["define"]  # the helpers serve other candidates: keep the diff to what this one calls
    chosen = recipe.model_copy(update={"replacement": found.replacement,
                                       "match": recipe.match.model_copy(update={"params": params})})
    try:
        edit = apply_recipe(source, chosen, span)
    except CodemodRefused as refused:
        return None, f"{found.summary()}, but the rewrite was refused: {refused.reason}"
    return edit, "semantic match: " + found.summary()


def _uses_definitions(define: str, replacement: str) -> bool:
    names = [node.name for node in ast.parse(textwrap.dedent(define)).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    return not names or any(re.search(rf"\b{re.escape(name)}\b", replacement) for name in names)
