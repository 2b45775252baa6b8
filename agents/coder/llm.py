"""The LLM coder: ask an OpenAI-compatible model for a patch of one intent's region, and trust nothing.

The reply is parsed as aider-style search/replace blocks. A patch lands on a candidate branch only
when every block's SEARCH text occurs exactly once and lies inside the intent's span, the edit
keeps the code outside the span in the same scopes, mentions no timing, seeds, data pipeline,
caching, skipped work or process access, adds only allowed imports, compiles, and the touched
module still imports in a sandbox child (scrubbed environment, own process group, memory cap, no
network where the host allows). A failed check goes back to the model as the next message, up to
`LLMConfig.max_attempts` replies; then the candidate branch is deleted and a `CoderRefusal` lists
every failure. A request without a reply (rate limits, server errors: retried with backoff inside
llm_client.py) ends the turn and uses up no patch attempt. User code is never imported in this
process.

`learned_recipe` turns an accepted LLM patch into a knowledge-base recipe (provenance "learned").
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import libcst as cst
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from pydantic import Field

from trainbridge.agents.coder import prompts
from trainbridge.agents.coder.candidate import Candidate, CoderRefusal, candidate_name
from trainbridge.agents.coder.llm_client import RequestFailed, ask, make_chat
from trainbridge.agents.coder.llm_config import ENV_BASE_URL, ENV_MODEL, LLMConfig
from trainbridge.knowledge.schema import MatchSpec, Numerics, Provenance, Recipe, Target
from trainbridge.records import Intent, Record, SourceSpan
from trainbridge.sandbox.isolation import default_memory_limit_mb, limit_memory, network_isolation, scrubbed_env
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe
from trainbridge.tools.codemods.imports import parse_import_line
from trainbridge.tools.codemods.pattern import METAVAR_PREFIX, equal

LLM_RECIPE_ID = "llm"
CONTEXT_LINES = 25
IMPORT_CHECK_TIMEOUT_S = 120.0
Stage = Literal["request", "format", "confinement", "rules", "compile", "structure", "import", "sandbox"]


class AttemptFailure(Record):
    attempt: int = Field(ge=1)
    stage: Stage
    message: str
    close: list[str] = Field(default_factory=list, description="what came close, for the model and the user")


class PatchRejected(Exception):
    def __init__(self, stage: Stage, message: str, close: list[str] | None = None):
        super().__init__(message)
        self.stage, self.message, self.close = stage, message, close or []


# --- parsing the reply ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EditBlock:
    file: str | None
    search: list[str]
    replace: list[str]


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    blocks: list[EditBlock]
    imports: list[str]


_OPEN = re.compile(r"^\s*<{5,9} ?(SEARCH|IMPORTS)\s*$")
_DIVIDER = re.compile(r"^\s*={5,9}\s*$")
_CLOSE = re.compile(r"^\s*>{5,9} ?(REPLACE|IMPORTS)\s*$")


def parse_reply(text: str) -> ParsedReply:
    """Search/replace blocks (and at most one IMPORTS block) of a reply; prose around them is ignored."""
    lines = text.splitlines()
    blocks: list[EditBlock] = []
    imports: list[str] = []
    last_file: str | None = None
    i = 0
    while i < len(lines):
        opened = _OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        kind, start = opened.group(1), i + 1
        parts: list[list[str]] = [[]]
        i += 1
        while i < len(lines) and not _CLOSE.match(lines[i]):
            if _OPEN.match(lines[i]):
                raise PatchRejected("format", f"the {kind} block opened on reply line {start} is not closed before "
                                    f"another block opens on line {i + 1}")
            if kind == "SEARCH" and _DIVIDER.match(lines[i]):
                parts.append([])
            else:
                parts[-1].append(lines[i])
            i += 1
        if i == len(lines):
            closer = ">>>>>>> REPLACE" if kind == "SEARCH" else ">>>>>>> IMPORTS"
            raise PatchRejected("format", f"the {kind} block opened on reply line {start} never ends with {closer}")
        if _CLOSE.match(lines[i]).group(1) != ("REPLACE" if kind == "SEARCH" else "IMPORTS"):
            raise PatchRejected("format", f"the {kind} block opened on reply line {start} ends with the wrong marker "
                                f"{lines[i].strip()!r}")
        if kind == "IMPORTS":
            imports += [line.strip() for line in parts[0] if line.strip()]
        elif len(parts) != 2:
            raise PatchRejected("format", f"the SEARCH block opened on reply line {start} needs exactly one ======= "
                                f"divider between SEARCH and REPLACE text (found {len(parts) - 1})")
        else:
            last_file = _path_before(lines, start - 1) or last_file
            blocks.append(EditBlock(last_file, parts[0], parts[1]))
        i += 1
    if not blocks:
        raise PatchRejected("format", "the reply contains no SEARCH/REPLACE block; answer with blocks of the form "
                            "<path>, <<<<<<< SEARCH, old lines, =======, new lines, >>>>>>> REPLACE")
    return ParsedReply(blocks, imports)


def _path_before(lines: list[str], index: int) -> str | None:
    for line in reversed(lines[:index]):
        text = line.strip()
        if not text or text.startswith("```"):
            continue
        if _CLOSE.match(line):
            return None
        text = text.strip("`*#: ")
        return text if re.fullmatch(r"[\w./-]+\.py", text) else None
    return None


# --- locating and applying the blocks ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Located:
    file: str
    start: int  # 0-based first line
    end: int  # exclusive
    replace: list[str]


def locate(blocks: Sequence[EditBlock], sources: dict[str, str], spans: Sequence[SourceSpan]) -> list[_Located]:
    """Where each block applies; refuses blocks that are ambiguous, missing or outside the spans."""
    found: list[_Located] = []
    for number, block in enumerate(blocks, 1):
        file = _resolve_file(block.file, sources, number)
        if not any(line.strip() for line in block.search):
            raise PatchRejected("format", f"block {number}: the SEARCH text is empty; copy the lines to replace")
        lines = sources[file].splitlines()
        n = len(block.search)
        if len(block.replace) > 4 * n + 20:
            raise PatchRejected("format", f"block {number}: REPLACE has {len(block.replace)} lines for {n} SEARCH "
                                "line(s); a fused rewrite of the region should not grow it this much")
        hits = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == block.search]
        if not hits:
            raise PatchRejected("confinement", f"block {number}: the SEARCH text does not occur in {file}",
                                _near_misses(block.search, lines, file))
        if len(hits) > 1:
            where = ", ".join(f"line {h + 1}" for h in hits)
            raise PatchRejected("confinement", f"block {number}: the SEARCH text occurs {len(hits)} times in {file} "
                                f"({where}); include more lines of the region to make it unique")
        start = hits[0]
        allowed = [s for s in spans if s.file == file]
        if not any(s.line_start <= start + 1 and start + n <= s.line_end for s in allowed):
            raise PatchRejected("confinement", f"block {number}: the SEARCH text is {file} lines {start + 1}-{start + n}, "
                                f"outside the editable region ({', '.join(str(s) for s in allowed)}); only those "
                                "lines may change")
        for other in found:
            if other.file == file and other.start < start + n and start < other.end:
                raise PatchRejected("confinement", f"block {number} overlaps an earlier block ({file} lines "
                                    f"{other.start + 1}-{other.end})")
        found.append(_Located(file, start, start + n, block.replace))
    return found


def _resolve_file(name: str | None, sources: dict[str, str], number: int) -> str:
    if name is None:
        if len(sources) == 1:
            return next(iter(sources))
        raise PatchRejected("format", f"block {number}: put the file path ({', '.join(sources)}) on the line before "
                            "<<<<<<< SEARCH")
    clean = name.removeprefix("./")
    matches = [f for f in sources if f == clean or f.endswith("/" + clean)]
    if len(matches) != 1:
        raise PatchRejected("confinement", f"block {number}: {name} is not a file this intent may edit "
                            f"({', '.join(sources)})")
    return matches[0]


def _near_misses(search: list[str], lines: list[str], file: str) -> list[str]:
    if all(re.match(r"\s*>?\s*\d+ \| ", line) for line in search if line.strip()):
        return ["the SEARCH lines start with line numbers ('  12 | '); copy the code without them"]
    stripped = [line.strip() for line in search]
    n = len(search)
    for i in range(len(lines) - n + 1):
        if [line.strip() for line in lines[i:i + n]] == stripped:
            return [f"{file} lines {i + 1}-{i + n} match except for indentation; copy the whitespace exactly"]
    first = next(line for line in search if line.strip())
    close = difflib.get_close_matches(first.strip(), [line.strip() for line in lines], n=3, cutoff=0.6)
    return [f"{file} line {i + 1}: {lines[i].strip()}" for i, line in enumerate(lines) if line.strip() in close][:3]


def apply_blocks(source: str, located: Sequence[_Located]) -> str:
    newline = "\r\n" if "\r\n" in source else "\n"
    lines = source.splitlines()
    for edit in sorted(located, key=lambda e: -e.start):
        lines[edit.start:edit.end] = edit.replace
    return newline.join(lines) + (newline if source.endswith(("\n", "\r")) else "")


# --- rules on what a patch may say ---------------------------------------------------------------

# Mentioned anywhere in a block (SEARCH or REPLACE): the region must not touch these at all.
_TOUCH_RULES = (
    (r"\btime\s*\.|\b(perf_counter|perf_counter_ns|monotonic|monotonic_ns|process_time|datetime|timeit)\b",
     "timing (the harness times the step)"),
    (r"\b(manual_seed|manual_seed_all|seed|initial_seed|set_rng_state|get_rng_state|fork_rng|default_generator)\b",
     "seeds or random-number state"),
    (r"\b(DataLoader|Dataset|Sampler|sampler|dataloader|data_loader|get_batch|next_batch|make_batch|batch_fn)\b",
     "the data pipeline or batch function"),
    (r"\btrainbridge\b|\bTRAINBRIDGE_", "TrainBridge's harness"),
)
# Refused when REPLACE says them more often than SEARCH: what a patch must not add.
_INTRODUCE_RULES = (
    (r"(?m)^\s*(global|nonlocal)\b", "a global/nonlocal statement (state kept across steps)"),
    (r"\b(functools|lru_cache|cache|cached_property|memoize)\b", "caching (results reused across steps)"),
    (r"\bself\.\w+(\[[^\]]*\])?\s*(=(?!=)|[-+*/@|&]=)", "an assignment to self.<attribute> (state kept across steps)"),
    (r"\b(hasattr|getattr|setattr|delattr)\b", "attribute tricks (getattr/hasattr/setattr)"),
    (r"\b(no_grad|inference_mode|set_grad_enabled|detach|detach_|requires_grad_)\b|\.data\b",
     "skipped gradient work (no_grad, detach, .data)"),
    (r"\b(return|yield|break|continue)\b", "a new return/yield/break/continue (bypasses computation)"),
    (r"\bsynchronize\b", "device synchronisation (the harness syncs around the timed step)"),
    (r"(?<![\w.])(eval|exec|compile|open|globals|locals|vars|__import__|breakpoint|input)\s*\(|"
     r"\b(importlib|builtins|__builtins__|subprocess|socket|ctypes|pickle|shutil|os|sys)\b",
     "dynamic code, I/O or process access"),
    (r"(?m)^\s*(import|from)\s+\w", "an import statement inside the region (use the IMPORTS block)"),
)


def check_rules(located: Sequence[_Located], sources: dict[str, str], imports: Sequence[str], target: str,
                protected: Sequence[str] = ()) -> None:
    """Refuse blocks that touch the harness's concerns or add state, skips, process access or imports."""
    touch = list(_TOUCH_RULES)
    if protected:
        touch.append((r"\b(" + "|".join(re.escape(p) for p in protected) + r")\b", "a protected name of the workload"))
    for number, edit in enumerate(located, 1):
        old = "\n".join(sources[edit.file].splitlines()[edit.start:edit.end])
        new = "\n".join(edit.replace)
        for pattern, what in touch:
            hit = re.search(pattern, old) or re.search(pattern, new)
            if hit:
                raise PatchRejected("rules", f"block {number} touches {what}: it mentions {hit.group(0).strip()!r} "
                                    "(mentions are refused even in comments); leave such code alone")
        for pattern, what in _INTRODUCE_RULES:
            if len(re.findall(pattern, new)) > len(re.findall(pattern, old)):
                word = re.search(pattern, new).group(0).strip()
                raise PatchRejected("rules", f"block {number} adds {what}: {word!r} (mentions are refused even in comments)")
        _check_npu_names(number, old, new, target)
    for line in imports:
        _check_import(line, target)


def _check_npu_names(number: int, old: str, new: str, target: str) -> None:
    if target != "npu":
        if len(re.findall(r"\btorch_npu\b", new)) > len(re.findall(r"\btorch_npu\b", old)):
            raise PatchRejected("rules", f"block {number} uses torch_npu, which the {target} backend does not have")
        return
    unknown = sorted(set(re.findall(r"\btorch_npu\.(\w+)", new)) - set(prompts.NPU_FUSED_APIS) - {"npu", "optim"}
                     - set(re.findall(r"\btorch_npu\.(\w+)", old)))
    if unknown:
        raise PatchRejected("rules", f"block {number} calls torch_npu.{', torch_npu.'.join(unknown)}, which TrainBridge "
                            f"cannot verify; use one of {', '.join(prompts.NPU_FUSED_APIS)}")


def _check_import(line: str, target: str) -> None:
    try:
        spec = parse_import_line(line)
    except ValueError as exc:
        raise PatchRejected("rules", f"IMPORTS: {exc}") from None
    allowed = prompts.ALLOWED_IMPORT_MODULES[target]
    if spec.module not in allowed:
        raise PatchRejected("rules", f"IMPORTS: {line!r} imports from {spec.module}; only {', '.join(allowed)} may be imported")
    for pattern, what in _TOUCH_RULES:
        if re.search(pattern, line):
            raise PatchRejected("rules", f"IMPORTS: {line!r} touches {what}")
    if spec.module == "torch_npu" and (spec.asname or (spec.obj and spec.obj not in prompts.NPU_FUSED_APIS)):
        raise PatchRejected("rules", f"IMPORTS: {line!r}: import torch_npu plainly and call torch_npu.<op>")


def add_imports(source: str, lines: Sequence[str]) -> str:
    if not lines:
        return source
    context = CodemodContext()
    for line in lines:
        spec = parse_import_line(line)
        AddImportsVisitor.add_needed_import(context, spec.module, spec.obj, spec.asname)
    return AddImportsVisitor(context).transform_module(cst.parse_module(source)).code


# --- structure and import checks -----------------------------------------------------------------


def _scopes(source: str) -> list[str]:
    """For each line (index = line number), the qualified name of the innermost def/class around it."""
    scopes = [""] * (source.count("\n") + 2)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                for line in range(first, (child.end_lineno or child.lineno) + 1):
                    scopes[line] = name
                visit(child, name)
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return scopes


def check_structure(file: str, old: str, new: str, located: Sequence[_Located]) -> None:
    """Lines outside the edited ones must stay in the same function/class (an edit must not re-indent them)."""
    before, after = _scopes(old), _scopes(new)
    edits = sorted((e for e in located if e.file == file), key=lambda e: e.start)
    old_lines = old.splitlines()
    for index, text in enumerate(old_lines):
        if any(e.start <= index < e.end for e in edits) or not text.strip():
            continue
        shift = sum(len(e.replace) - (e.end - e.start) for e in edits if e.end <= index)
        if before[index + 1] != after[index + 1 + shift]:
            raise PatchRejected("structure", f"{file} line {index + 1} ({text.strip()[:60]!r}) would move from "
                                f"{before[index + 1] or 'module level'} to {after[index + 1 + shift] or 'module level'}: "
                                "the patch changes code outside the region (check the indentation)")


_IMPORT_CHECK = r"""
import importlib, importlib.util, sys
from pathlib import Path
root, rel = sys.argv[1], sys.argv[2]
path = Path(root, rel)
sys.path[:0] = [root, str(path.parent)]
parts = list(Path(rel).with_suffix("").parts)
if parts and parts[-1] == "__init__":
    parts.pop()
if parts and all(p.isidentifier() for p in parts):
    importlib.import_module(".".join(parts))
else:
    spec = importlib.util.spec_from_file_location("_trainbridge_checked", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
"""


def import_in_sandbox(root: Path, file: str, target: str, timeout_s: float = IMPORT_CHECK_TIMEOUT_S) -> str | None:
    """Import `file` of the tree at `root` in a confined child; None when it imports, else the error's tail."""
    env = scrubbed_env({}, threads=1, seed=0)
    if target == "npu":
        env = _npu_env(env)
    isolation = network_isolation()
    try:
        child = subprocess.Popen([*isolation.prefix, sys.executable, "-c", _IMPORT_CHECK, str(root), file], cwd=root,
                                 env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True, preexec_fn=limit_memory(default_memory_limit_mb()))
    except OSError as exc:
        return f"could not start the import check: {exc}"
    try:
        _, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return f"importing {file} did not finish within {timeout_s:g} s"
    if child.returncode == 0:
        return None
    return "\n".join(err.strip().splitlines()[-12:]) or f"the import check exited with code {child.returncode}"


def _npu_env(env: dict[str, str]) -> dict[str, str]:
    from trainbridge.sandbox.npu_emulation._selection import NpuSelection, select_torch_npu, selection_env

    if importlib.util.find_spec("torch_npu") is None:
        selection = NpuSelection(mode="emulated", cause="not_installed", reason="torch_npu is not installed",
                                 python=sys.executable)
    else:
        selection = select_torch_npu(env=env)
    return selection_env(selection, env)


# --- the prompt ----------------------------------------------------------------------------------


def _numbered(lines: list[str], first: int, last: int, marked: tuple[int, int] | None = None) -> str:
    out = []
    for number in range(first, last + 1):
        mark = ">" if marked and marked[0] <= number <= marked[1] else " "
        out.append(f"{mark}{number:5d} | {lines[number - 1]}")
    return "\n".join(out)


def build_messages(intent: Intent, sources: dict[str, str], spans: Sequence[SourceSpan], target: str,
                   feedback: str | None) -> list[Any]:
    evidence = intent.evidence
    region, context = [], []
    for span in spans:
        lines = sources[span.file].splitlines()
        region.append(f"{span.file} lines {span.line_start}-{span.line_end}"
                      + (f" (in {span.function})" if span.function else "") + ":\n"
                      + _numbered(lines, span.line_start, span.line_end))
        first, last = max(1, span.line_start - CONTEXT_LINES), min(len(lines), span.line_end + CONTEXT_LINES)
        header = [line for line in lines[:first - 1] if re.match(r"(import|from)\s+\w", line)]
        context.append(f"{span.file} (lines marked > are the region):\n"
                       + ("".join(f"       | {line}\n" for line in header) + "       | ...\n" if header else "")
                       + _numbered(lines, first, last, (span.line_start, span.line_end)))
    details = [f"Compiler kernels: {', '.join(evidence.kernels[:5])}" if evidence.kernels else "",
               f"Eager ops: {', '.join(evidence.target_op_names[:15])}" if evidence.target_op_names else "",
               f"Detectors: {', '.join(evidence.detectors)}" if evidence.detectors else "",
               *(f"Note: {note}" for note in evidence.notes[:5])]
    time = f", {evidence.target_time_us:.0f} us per step" if evidence.target_time_us is not None else ""
    system = prompts.SYSTEM_PROMPT.format(target=target, allowed_apis=prompts.ALLOWED_APIS[target],
                                          allowed_imports=", ".join(prompts.ALLOWED_IMPORT_MODULES[target]),
                                          example=prompts.EXAMPLE_BLOCK)
    user = prompts.USER_PROMPT.format(
        intent_id=intent.id, category=intent.category, target=target, time=time,
        kernels="?" if evidence.reference_kernels is None else evidence.reference_kernels,
        ops="?" if evidence.target_ops is None else evidence.target_ops,
        evidence_details="\n".join(d for d in details if d), regions=", ".join(str(s) for s in spans),
        region_listing="\n\n".join(region), context_listing="\n\n".join(context),
        feedback=prompts.FEEDBACK_SECTION.format(feedback=feedback) if feedback else "")
    return [SystemMessage(system), HumanMessage(user)]


# --- the coder -----------------------------------------------------------------------------------


def llm_candidate(workspace, intent: Intent, config: LLMConfig | None, *, feedback: str | None = None,
                  chat: Any = None, target: str | Target = "cpu", attempt: int = 0,
                  protected_names: Sequence[str] = ()) -> Candidate | CoderRefusal:
    """Ask the model for a patch of the intent's region, check it, commit it on a candidate branch."""
    if config is None:
        return CoderRefusal(recipe_id=LLM_RECIPE_ID, reason=f"no LLM is configured (set {ENV_MODEL} and, for a "
                            f"non-OpenAI endpoint, {ENV_BASE_URL}); only recipes apply")
    target = str(target)
    name = candidate_name(intent, LLM_RECIPE_ID, attempt)
    cand = workspace.start_candidate(name)
    sources = {s.file: (Path(cand.path) / s.file).read_text(encoding="utf-8") for s in intent.spans
               if (Path(cand.path) / s.file).is_file()}
    spans = [s for s in intent.spans if s.file in sources and s.line_end <= len(sources[s.file].splitlines())]
    if not spans:
        workspace.reject_candidate(name)
        return CoderRefusal(recipe_id=LLM_RECIPE_ID, reason=f"none of the intent's spans ({', '.join(map(str, intent.spans))}) "
                            "exists in the run branch")
    sources = {f: text for f, text in sources.items() if any(s.file == f for s in spans)}
    try:
        return _attempts(workspace, intent, config, name, sources, spans, target, feedback, chat, protected_names)
    except BaseException:
        workspace.reject_candidate(name)  # an unexpected error leaves no half-made candidate behind
        raise


def _attempts(workspace, intent: Intent, config: LLMConfig, name: str, sources: dict[str, str],
              spans: list[SourceSpan], target: str, feedback: str | None, chat: Any,
              protected_names: Sequence[str]) -> Candidate | CoderRefusal:
    chat = chat if chat is not None else make_chat(config)
    messages = build_messages(intent, sources, spans, target, feedback)
    failures: list[AttemptFailure] = []
    baseline_imports: dict[str, str | None] = {}
    for number in range(1, config.max_attempts + 1):
        try:
            reply = ask(chat, messages, config)  # transport retries happen in there, not here
        except RequestFailed as failed:
            failures.append(AttemptFailure(attempt=number, stage="request", message=failed.message))
            break
        try:
            patched, located, imports = _check_patch(reply, sources, spans, target, protected_names)
            cand = workspace.start_candidate(name)  # a clean worktree at the run head for every attempt
            _check_in_sandbox(workspace, name, Path(cand.path), sources, patched, target, baseline_imports)
        except PatchRejected as rejected:
            failures.append(AttemptFailure(attempt=number, stage=rejected.stage, message=rejected.message,
                                           close=rejected.close))
            hints = "".join(f"\n  close: {c}" for c in rejected.close)
            messages = [*messages, AIMessage(reply), HumanMessage(prompts.RETRY_PROMPT.format(
                attempt=number, max_attempts=config.max_attempts, failure=f"[{rejected.stage}] {rejected.message}{hints}",
                regions=", ".join(str(s) for s in spans)))]
            continue
        sites = [SourceSpan(file=e.file, line_start=e.start + 1, line_end=e.end) for e in located]
        result = workspace.commit_candidate(name, _commit_message(intent, config, sites, imports, number, baseline_imports))
        return Candidate(name=name, intent_id=intent.id, category=str(intent.category), recipe_id=None,
                         branch=result.branch, sha=result.sha, base_sha=result.base_sha,
                         diff=workspace.candidate_diff(name), files=result.files, sites=sites, worktree=str(cand.path))
    workspace.reject_candidate(name)
    summary = " | ".join(f"attempt {f.attempt} [{f.stage}]: {f.message}" for f in failures)
    return CoderRefusal(recipe_id=LLM_RECIPE_ID, reason=f"the LLM ({config.model}) gave no usable patch in "
                        f"{len(failures)} attempt(s): {summary}", close=[c for f in failures for c in f.close][:5])


def _check_patch(reply: str, sources: dict[str, str], spans: Sequence[SourceSpan], target: str,
                 protected: Sequence[str]) -> tuple[dict[str, str], list[_Located], list[str]]:
    parsed = parse_reply(reply)
    located = locate(parsed.blocks, sources, spans)
    check_rules(located, sources, parsed.imports, target, protected)
    patched: dict[str, str] = {}
    for file in sorted({e.file for e in located}):
        edits = [e for e in located if e.file == file]
        new = apply_blocks(sources[file], edits)
        if new == sources[file]:
            continue
        try:
            compile(new, file, "exec")
        except SyntaxError as exc:
            raise PatchRejected("compile", f"the patched {file} does not compile: {exc.msg} at line {exc.lineno}: "
                                f"{(exc.text or '').strip()}") from None
        check_structure(file, sources[file], new, edits)
        patched[file] = add_imports(new, parsed.imports)
    if not patched:
        raise PatchRejected("format", "the patch changes nothing (every REPLACE equals its SEARCH)")
    return patched, located, parsed.imports


def _check_in_sandbox(workspace, name: str, root: Path, sources: dict[str, str], patched: dict[str, str], target: str,
                      baseline: dict[str, str | None]) -> None:
    """Write the patch, import each touched module in a child, and make sure nothing else changed."""
    for file, text in patched.items():
        (root / file).write_text(text, encoding="utf-8")
    for file in patched:
        error = import_in_sandbox(root, file, target)
        if error is None:
            continue
        if file not in baseline:  # did it import before the patch? (checked once, only when needed)
            (root / file).write_text(sources[file], encoding="utf-8")
            baseline[file] = import_in_sandbox(root, file, target)
            (root / file).write_text(patched[file], encoding="utf-8")
        if baseline[file] is None or baseline[file].splitlines()[-1:] != error.splitlines()[-1:]:
            raise PatchRejected("import", f"the patched {file} no longer imports:\n{error}")
    changed = set(re.findall(r"^diff --git a/(\S+) b/", workspace.candidate_diff(name, include_uncommitted=True), re.M))
    if changed - set(patched):
        raise PatchRejected("sandbox", f"importing the patched module changed other files ({', '.join(sorted(changed - set(patched)))}); "
                            "the patch must not write files")


def _commit_message(intent: Intent, config: LLMConfig, sites: list[SourceSpan], imports: list[str], attempt: int,
                    baseline: dict[str, str | None]) -> str:
    evidence = intent.evidence
    k = "?" if evidence.reference_kernels is None else evidence.reference_kernels
    n = "?" if evidence.target_ops is None else evidence.target_ops
    lines = [f"trainbridge: LLM rewrite of {intent.category} at {', '.join(str(s) for s in sites)}", "",
             f"Intent {intent.id} ({intent.category}); evidence: reference kernels K={k} vs eager ops N={n} per step.",
             f"Patch by LLM {config.model} (provenance llm), reply {attempt} of at most {config.max_attempts}; "
             "confined to the intent's span, compiles, imports in the sandbox.",
             f"Imports added: {', '.join(imports) or 'none'}."]
    for file, error in baseline.items():
        if error is not None:
            lines.append(f"Import check of {file} inconclusive: it does not import before the patch either "
                         f"({error.splitlines()[-1][:200]}).")
    return "\n".join(lines)


# --- learning a recipe from an accepted patch ----------------------------------------------------


class LearnedRecipeError(ValueError):
    """The accepted patch has a shape no recipe kind can express; the message says which."""


_SIGNIFICANT = (cst.BaseExpression, cst.BaseStatement, cst.BaseSmallStatement, cst.BaseSuite, cst.Arg, cst.Param,
                cst.Parameters, cst.AssignTarget, cst.BaseElement, cst.SubscriptElement, cst.BaseSlice,
                cst.ComparisonTarget, cst.Decorator)


def _change_path(old: cst.CSTNode, new: cst.CSTNode) -> list[tuple[cst.CSTNode, cst.CSTNode]]:
    """The chain of node pairs from (old, new) down to the smallest one that holds the whole change."""
    path = [(old, new)]
    while type(old) is type(new):
        pairs, same_shape = [], True
        for field in dataclasses.fields(old):
            a, b = getattr(old, field.name), getattr(new, field.name)
            if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
                a, b = [x for x in a if isinstance(x, _SIGNIFICANT)], [x for x in b if isinstance(x, _SIGNIFICANT)]
                same_shape &= len(a) == len(b)
                pairs += [(x, y) for x, y in zip(a, b) if not equal(x, y)]
            elif isinstance(a, _SIGNIFICANT) and isinstance(b, _SIGNIFICANT) and not equal(a, b):
                pairs.append((a, b))
        if not same_shape or len(pairs) != 1:
            break
        old, new = pairs[0]
        path.append((old, new))
    return path


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body)


def _dollar(code: str) -> str:
    return code.replace("$", "$$")


def _generalise(module: cst.Module, expr: cst.BaseExpression, params: list[str]) -> tuple[str, list[str]]:
    """`expr` as template text: parameters become $name, self.<attr> becomes $self_<attr>."""
    attributes: list[str] = []

    class Rename(cst.CSTTransformer):
        def leave_Attribute(self, original, updated):
            if isinstance(original.value, cst.Name) and original.value.value == "self":
                attributes.append(original.attr.value)
                return cst.Name(METAVAR_PREFIX + "self_" + original.attr.value)
            return updated

        def leave_Name(self, original, updated):
            return cst.Name(METAVAR_PREFIX + original.value) if original.value in params else updated

    code = module.code_for_node(expr.visit(Rename()))
    return re.sub(re.escape(METAVAR_PREFIX) + r"(\w+)", r"$\1", _dollar(code)), sorted(set(attributes))


def learned_recipe(candidate: Candidate, intent: Intent, *, repo_root: str | Path, target: str | Target,
                   model: str | None = None, numerics: Numerics | None = None) -> Recipe:
    """A recipe (provenance "learned") that redoes an accepted LLM patch wherever the same code appears.

    Generality: a patch that changes one expression becomes an ``expression`` recipe whose pattern is
    the old expression with every name kept literal (it matches that exact code, in any formatting);
    a patch that replaces a whole function body (top-level function or a class's ``forward``) by one
    ``return`` becomes a ``semantic`` recipe with the parameters and ``self`` attributes as
    placeholders, anchored on the old body's largest expression. Anything else is refused. The
    recipe is checked to reproduce the accepted patch on the original file.
    """
    from trainbridge.tools.git_ops import run_git

    if len(candidate.files) != 1 or not candidate.files[0].endswith(".py"):
        raise LearnedRecipeError(f"candidate {candidate.name} changes {candidate.files}; a recipe covers one Python file")
    file = candidate.files[0]
    old_text, new_text = (run_git(Path(repo_root), "cat-file", "blob", f"{sha}:{file}", strip=False)
                          for sha in (candidate.base_sha, candidate.sha))
    old_mod, new_mod = cst.parse_module(old_text), cst.parse_module(new_text)
    added = sorted({new_mod.code_for_node(s).strip() for s in new_mod.body if _is_import(s)}
                   - {old_mod.code_for_node(s).strip() for s in old_mod.body if _is_import(s)})
    path = _change_path(old_mod.with_changes(body=[s for s in old_mod.body if not _is_import(s)]),
                        new_mod.with_changes(body=[s for s in new_mod.body if not _is_import(s)]))
    exprs = [(a, b) for a, b in path if isinstance(a, cst.BaseExpression) and isinstance(b, cst.BaseExpression)]
    common = {"category": intent.category, "targets": [Target(str(target))], "imports": added,
              "numerics": numerics or Numerics(class_="tolerance", rtol=1e-3, atol=1e-5, loss_rtol=1e-4),
              "keywords": list(dict.fromkeys([*intent.evidence.target_op_names, *intent.evidence.kernels]))[:20],
              "pitfalls": [f"Learned from one accepted LLM patch at {', '.join(map(str, candidate.sites))}; "
                           "verified only there."],
              "provenance": Provenance(kind="learned", sources=[f"commit {candidate.sha}"],
                                       notes=f"LLM candidate {candidate.name}" + (f" by {model}" if model else ""))}
    rid = f"learned-{intent.category}-{candidate.sha[:10]}".lower().replace("_", "-")
    if exprs and not isinstance(exprs[-1][0], (cst.Name, cst.Attribute)):
        old, new = exprs[-1]
        pattern, replacement = old_mod.code_for_node(old).strip(), new_mod.code_for_node(new).strip()
        recipe = Recipe(id=rid, title=f"Learned: {_short(pattern)} -> {_short(replacement)}",
                        match=MatchSpec(kind="expression", params={"pattern": _dollar(pattern)}),
                        replacement=_dollar(replacement), **common)
    else:
        recipe = _semantic_recipe(old_mod, new_mod, path, rid, common)
    _check_reproduces(recipe, old_text, new_text, [s for s in intent.spans if s.file == file] or candidate.sites)
    return recipe


def _semantic_recipe(old_mod: cst.Module, new_mod: cst.Module, path: list, rid: str, common: dict) -> Recipe:
    functions = [(a, b) for a, b in path if isinstance(a, cst.FunctionDef)]
    classes = [a for a, _ in path if isinstance(a, cst.ClassDef)]
    refuse = LearnedRecipeError("the patch is neither one changed expression nor a function body replaced by one "
                                "return; no recipe kind expresses it")
    if len(functions) != 1 or len(classes) > 1:
        raise refuse
    old_fn, new_fn = functions[0]
    body = [s for s in new_fn.body.body if not (isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.Expr)
                                                 and isinstance(s.body[0].value, cst.SimpleString))]
    if len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine) or not isinstance(body[0].body[0], cst.Return) \
            or body[0].body[0].value is None:
        raise refuse
    scope = "module_forward" if classes else "function"
    if scope == "module_forward" and old_fn.name.value != "forward":
        raise LearnedRecipeError(f"the patch rewrites {classes[0].name.value}.{old_fn.name.value}; only forward methods "
                                 "and top-level functions can be semantic recipes")
    params = [p.name.value for p in old_fn.params.params][1 if classes else 0:]
    replacement, attributes = _generalise(new_mod, body[0].body[0].value, params)
    old_values = [s.value for line in old_fn.body.body if isinstance(line, cst.SimpleStatementLine)
                  for s in line.body if isinstance(s, (cst.Assign, cst.Return, cst.AugAssign)) and s.value is not None]
    anchors = [_generalise(old_mod, v, params)[0] for v in
               sorted(old_values, key=lambda v: -len(old_mod.code_for_node(v)))[:1]]
    params_spec = {"scope": scope, "signature": params, "attributes": attributes, "alternatives": anchors}
    return Recipe(id=rid, title=f"Learned: {old_fn.name.value} body -> {_short(replacement)}",
                  match=MatchSpec(kind="semantic", params=params_spec), replacement=replacement, **common)


def _short(code: str) -> str:
    flat = " ".join(code.split())
    return flat if len(flat) <= 60 else flat[:57] + "..."


def _check_reproduces(recipe: Recipe, old_text: str, new_text: str, spans: Sequence[SourceSpan]) -> None:
    reasons = []
    for span in spans:
        try:
            redone = apply_recipe(old_text, recipe, span).source
        except CodemodRefused as refused:
            reasons.append(str(refused))
            continue
        if ast.dump(ast.parse(redone)) == ast.dump(ast.parse(new_text)):
            return
        reasons.append(f"applied at {span} it gives different code")
    raise LearnedRecipeError(f"the learned recipe {recipe.id} does not reproduce the accepted patch: {'; '.join(reasons)}")
