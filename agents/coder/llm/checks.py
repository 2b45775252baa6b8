"""What an LLM patch may say: rules on the lines it touches and introduces (no timing, seeds, data
pipeline, caching, skipped work, process access; only allowed imports and verifiable NPU APIs), the
scopes around the span kept, and the touched module still importing in a sandbox child."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from trainbridge.agents.coder import prompts
from trainbridge.agents.coder.llm.reply import PatchRejected, LocatedEdit
from trainbridge.sandbox.confinement import child_sandbox
from trainbridge.sandbox.isolation import default_memory_limit_mb, limit_memory, scrubbed_env
from trainbridge.tools.codemods.imports import parse_import_line

IMPORT_CHECK_TIMEOUT_S = 120.0


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


def check_rules(located: Sequence[LocatedEdit], sources: dict[str, str], imports: Sequence[str], target: str,
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


def check_structure(file: str, old: str, new: str, located: Sequence[LocatedEdit]) -> None:
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
    with tempfile.TemporaryDirectory(prefix="tb-import-check-") as tmp:
        box = child_sandbox(Path(tmp), root=root, backend=target)
        try:
            child = subprocess.Popen([*box.prefix, sys.executable, "-c", _IMPORT_CHECK, str(root), file], cwd=root,
                                     env={**env, **box.env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     preexec_fn=limit_memory(default_memory_limit_mb()))
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
