"""The LLM coder: ask an OpenAI-compatible model for a patch of one intent's region, and trust nothing.

The reply is parsed as aider-style search/replace blocks. A patch lands on a candidate branch only
when every block's SEARCH text occurs exactly once and lies inside the intent's span, the edit
keeps the code outside the span in the same scopes, mentions no timing, seeds, data pipeline,
caching, skipped work or process access, adds only allowed imports, compiles, and the touched
module still imports in a sandbox child (scrubbed environment, own process group, memory cap, no
network where the host allows). A failed check goes back to the model as the next message, up to
`LLMConfig.max_attempts` replies; then the candidate branch is deleted and a `CoderRefusal` lists
every failure. A request without a reply (rate limits, server errors: retried with backoff inside
llm/client.py) ends the turn and uses up no patch attempt. User code is never imported in this
process.

Parsing and locating the reply: llm/reply.py; the checks: llm/checks.py; the request: llm/client.py;
`learned_recipe` (an accepted LLM patch as a knowledge-base recipe): learned.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from trainbridge.agents.coder import prompts
from trainbridge.agents.coder.candidate import Candidate, CoderRefusal, candidate_name
from trainbridge.agents.coder.llm.checks import add_imports, check_rules, check_structure, import_in_sandbox
from trainbridge.agents.coder.llm.client import RequestFailed, ask, make_chat
from trainbridge.agents.coder.llm.config import ENV_BASE_URL, ENV_MODEL, LLMConfig
from trainbridge.agents.coder.llm.reply import AttemptFailure, PatchRejected, LocatedEdit, apply_blocks, locate, parse_reply
from trainbridge.knowledge.schema import Target
from trainbridge.records import Intent, SourceSpan

LLM_RECIPE_ID = "llm"
CONTEXT_LINES = 25


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
                 protected: Sequence[str]) -> tuple[dict[str, str], list[LocatedEdit], list[str]]:
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
