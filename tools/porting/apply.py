"""Pass 2 of a port: apply a `Plan` to the tree, then make sure `import torch_npu` is there once."""

from __future__ import annotations

import re

import libcst as cst

from trainbridge.tools.porting.planner import Plan
from trainbridge.tools.porting.rules import dotted, is_npu_string

TORCH_NPU_IMPORT = "import torch_npu  # noqa: F401  (registers the npu device, torch.npu and hccl)\n"


class Applier(cst.CSTTransformer):
    """Rewrites exactly the nodes the plan names; everything else (formatting, comments) is kept."""

    def __init__(self, plan: Plan) -> None:
        super().__init__()
        self.plan = plan

    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode):
        updated = super().on_leave(original_node, updated_node)
        key = id(original_node)
        plan = self.plan
        if key in plan.exprs:  # a node, a removal/flatten sentinel, or a function of the updated node
            replacement = plan.exprs[key]
            return replacement(updated) if callable(replacement) else replacement
        if key in plan.names and isinstance(updated, cst.Name):
            return updated.with_changes(value=plan.names[key])
        if key in plan.attrs and isinstance(updated, cst.Attribute):
            return updated.with_changes(attr=updated.attr.with_changes(value=plan.attrs[key]))
        if key in plan.strings and isinstance(updated, (cst.SimpleString, cst.FormattedStringText)):
            return updated.with_changes(value=plan.strings[key])
        return updated


class _NpuReferences(cst.CSTVisitor):
    """Syntactic check of a ported module: does it use anything that `import torch_npu` provides?"""

    def __init__(self) -> None:
        super().__init__()
        self.uses_npu = False
        self.has_import = False

    def visit_Import(self, node: cst.Import) -> bool:
        if any(dotted(a.name) == "torch_npu" for a in node.names):
            self.has_import = True
        if any(dotted(a.name).startswith("torch_npu.") for a in node.names):
            self.uses_npu = True
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        module = dotted(node.module) if node.module else ""
        names = [] if isinstance(node.names, cst.ImportStar) else [a.name.value for a in node.names
                                                                    if isinstance(a.name, cst.Name)]
        if module.split(".")[0] == "torch_npu" or (module == "torch" and "npu" in names):
            self.uses_npu = True
        return False

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value in ("npu", "is_npu", "HCCL"):
            self.uses_npu = True

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = node.evaluated_value
        if isinstance(value, str) and is_npu_string(value):
            self.uses_npu = True

    def visit_FormattedStringText(self, node: cst.FormattedStringText) -> None:
        if re.fullmatch(r"npu(:\d*)?", node.value):
            self.uses_npu = True


def _imports_torch(statement: cst.CSTNode) -> bool:
    if not isinstance(statement, cst.SimpleStatementLine):
        return False
    for small in statement.body:
        if isinstance(small, cst.Import) and any(dotted(a.name).split(".")[0] == "torch" for a in small.names):
            return True
        if isinstance(small, cst.ImportFrom) and not small.relative and dotted(small.module).split(".")[0] == "torch":
            return True
    return False


def _is_preamble(index: int, statement: cst.CSTNode) -> bool:
    """Module docstring or `from __future__ import ...`: must stay above any import we add."""
    if not isinstance(statement, cst.SimpleStatementLine):
        return False
    small = statement.body[0]
    if index == 0 and isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString)):
        return True
    return isinstance(small, cst.ImportFrom) and dotted(small.module) == "__future__"


def ensure_torch_npu_import(original: cst.Module, updated: cst.Module, plan: Plan) -> tuple[cst.Module, int | None]:
    """Add `import torch_npu` when the ported module uses the NPU and lacks it; returns (module, anchor line).

    It goes right after the first top-level torch import, or just before that import when the import
    itself needs torch_npu loaded (`from torch import npu`); without a torch import, after the
    docstring and `from __future__` imports.
    """
    check = _NpuReferences()
    updated.visit(check)
    if not check.uses_npu or check.has_import:
        return updated, None
    body = list(updated.body)
    first = next((i for i, s in enumerate(original.body) if _imports_torch(s)), None)
    if first is not None:
        index = first if id(original.body[first]) in plan.needs_npu_first else first + 1
        anchor = original.body[first]
    else:
        index = next((i for i, s in enumerate(original.body) if not _is_preamble(i, s)), len(body))
        anchor = original.body[index] if index < len(body) else None
    new_statement = cst.parse_statement(TORCH_NPU_IMPORT)
    if index < len(body) and (first is None or index == first):  # take over the blank lines/comments above
        new_statement = new_statement.with_changes(leading_lines=body[index].leading_lines)
        body[index] = body[index].with_changes(leading_lines=())
    body.insert(index, new_statement)
    line = plan.statement_lines.get(id(anchor)) if anchor is not None else None
    return updated.with_changes(body=body), line or 1
