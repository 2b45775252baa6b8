"""Port one Python source file from CUDA to the NPU (`port_source`)."""

from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import MetadataWrapper

from trainbridge.tools.porting.apply import Applier, ensure_torch_npu_import
from trainbridge.tools.porting.attention import insert_helpers, plan_attention
from trainbridge.tools.porting.planner import Planner
from trainbridge.tools.porting.results import ChangeKind, PortChange, PortResult, SkipCategory, Skipped


def _error_line(code: str, exc: cst.ParserSyntaxError) -> int:
    """Python's own line for the syntax error (libcst's `raw_line` can point past it)."""
    try:
        ast.parse(code)
    except SyntaxError as syntax:
        return max(1, syntax.lineno or 1)
    return max(1, exc.raw_line)


def port_source(code: str, relpath: str) -> PortResult:
    """The NPU port of `code` (the file `relpath`), what changed and what could not be ported.

    Deterministic and idempotent: porting the result again changes nothing. A file that does not
    parse is returned unchanged with a `parse_error` item.
    """
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError as exc:
        line = _error_line(code, exc)
        return PortResult(file=relpath, source=code, changed=False, skipped=[Skipped(
            file=relpath, line=line, category=SkipCategory.parse_error,
            code=(code.splitlines()[line - 1].strip() if line <= len(code.splitlines()) else "")[:200],
            reason=f"the file does not parse as Python 3 ({exc.message}); it was left untouched: fix it, or port "
                   "it by hand", blocking=True)])
    wrapper = MetadataWrapper(module)
    planner = Planner(relpath, wrapper.module, code)
    wrapper.visit(planner)
    plan = planner.plan
    attention = plan_attention(wrapper, relpath, code, plan)  # FlexAttention / flash-attn -> npu_fusion_attention
    ported = wrapper.module.visit(Applier(plan))
    ported, anchor_line = ensure_torch_npu_import(wrapper.module, ported, plan)
    ported = insert_helpers(ported, attention)
    changes = sorted(plan.changes, key=lambda c: c.line)
    if anchor_line is not None:
        changes.insert(0, PortChange(file=relpath, line=anchor_line, kind=ChangeKind.import_torch_npu, before="",
                                     after="import torch_npu"))
    new_code = ported.code
    skipped = sorted(plan.skipped, key=lambda s: (s.line, s.category))
    return PortResult(file=relpath, source=new_code, changed=new_code != code, changes=changes, skipped=skipped)
