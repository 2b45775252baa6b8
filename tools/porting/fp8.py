"""FP8 matmuls carried to the NPU: the `torch._scaled_mm` ops become bf16 matmuls (a precision change).

torch_npu 2.14 has no FP8 matmul. A function that calls `torch._scaled_mm` (in the Modded-NanoGPT records, the
`@torch.library.custom_op("nanogpt::mm")` forward and its `nanogpt::mm_backward`) keeps its signature, its outputs
and its autograd registration, so every caller is untouched; inside it, and inside the `register_fake` of such an
op, the FP8 casts become bfloat16 casts and each `_scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=d)` becomes
`torch.mm(a, b).to(d) * (sa * sb)` (the scales are kept: the operands were divided by them). bf16 carries more
mantissa than e4m3/e5m2 and FP32's range, so the product moves toward the full-precision one: the change is flagged
for review as a precision change. FP8 that is not in such a function stays reported (SkipCategory.fp8).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import libcst as cst

from trainbridge.tools.porting.results import ChangeKind, PortChange, SkipCategory
from trainbridge.tools.porting.rules import dotted, dotted_expr


class PlannerView(Protocol):
    """What the FP8 and Triton passes use of `planner.Planner` (called from its leave_Module; not imported here,
    since the planner imports these passes)."""

    module: cst.Module
    plan: Any  # planner.Plan
    relpath: str

    def _line(self, node: cst.CSTNode) -> int: ...
    def _qnames(self, node: cst.CSTNode) -> set[str]: ...
    def _parent(self, node: cst.CSTNode) -> cst.CSTNode | None: ...
    def _code(self, node: cst.CSTNode) -> str: ...
    def _skip(self, node: cst.CSTNode, category: SkipCategory, reason: str, *, blocking: bool = True,
              line: int | None = None) -> None: ...
    def get_metadata(self, key: Any, node: cst.CSTNode, default: Any = ...) -> Any: ...

SCALED_MM = "torch._scaled_mm"
_FP8_DTYPE = re.compile(r"torch\.float8_\w+")
_SCALED_MM_PARAMS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
PRECISION_REVIEW = (
    "precision change: the NPU (torch_npu 2.14) has no FP8 matmul, so this FP8 (e4m3/e5m2) operand or product is "
    "bf16 now; bf16 keeps more mantissa than FP8, so results move toward the full-precision product and the loss "
    "curve differs from the GPU record's. Review the scales (still applied) and the run's loss")


def _is_fp8_dtype(qnames: set[str]) -> bool:
    return any(_FP8_DTYPE.fullmatch(q) for q in qnames)


class _Collect(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.functions: list[cst.FunctionDef] = []  # every def, nested ones included
        self.calls: list[cst.Call] = []
        self.refs: list[cst.CSTNode] = []  # Name/Attribute nodes

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)

    def visit_Name(self, node: cst.Name) -> None:
        self.refs.append(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.refs.append(node)


def _walk(node: cst.CSTNode) -> _Collect:
    collect = _Collect()
    node.visit(collect)
    return collect


def _custom_op_name(planner: PlannerView, function: cst.FunctionDef) -> str | None:
    """"ns::op" of `@torch.library.custom_op("ns::op", ...)` on `function`, else None."""
    for decorator in function.decorators:
        target = decorator.decorator
        if isinstance(target, cst.Call) and "torch.library.custom_op" in planner._qnames(target.func) and target.args:
            first = target.args[0].value
            if isinstance(first, cst.SimpleString) and isinstance(first.evaluated_value, str):
                return first.evaluated_value
    return None


def _fake_of(planner: PlannerView, function: cst.FunctionDef) -> str | None:
    """The op a `@<op>.register_fake` / `@torch.library.register_fake("ns::op")` function fakes: its Python name or
    "ns::op"."""
    for decorator in function.decorators:
        target = decorator.decorator
        func = target.func if isinstance(target, cst.Call) else target
        if isinstance(func, cst.Attribute) and func.attr.value == "register_fake" and not isinstance(target, cst.Call):
            return dotted(func.value)
        if isinstance(target, cst.Call) and "torch.library.register_fake" in planner._qnames(func) and target.args:
            first = target.args[0].value
            if isinstance(first, cst.SimpleString) and isinstance(first.evaluated_value, str):
                return first.evaluated_value
    return None


def _bf16_mm(updated: cst.Call, module: cst.Module) -> cst.BaseExpression:
    args: dict[str, str] = {}
    for index, arg in enumerate(updated.args):
        name = arg.keyword.value if arg.keyword is not None else _SCALED_MM_PARAMS[index]
        args[name] = module.code_for_node(arg.value).strip()
    code = f"torch.mm({args['self']}, {args['mat2']})"
    if "out_dtype" in args:
        code += f".to({args['out_dtype']})"
    code = f"{code} * ({args['scale_a']} * {args['scale_b']})"
    if "bias" in args and args["bias"] != "None":
        code += f" + {args['bias']}"
    return cst.parse_expression(f"({code})")


def _portable(call: cst.Call) -> str | None:
    """None when `torch._scaled_mm(...)` has a bf16 form; else why not."""
    given = set()
    for index, arg in enumerate(call.args):
        if arg.star:
            return "its arguments are unpacked (*args/**kwargs), so the scales cannot be told apart"
        given.add(arg.keyword.value if arg.keyword is not None else
                  (_SCALED_MM_PARAMS[index] if index < len(_SCALED_MM_PARAMS) else "?"))
    if not {"self", "mat2", "scale_a", "scale_b"} <= given:
        return "it does not name both operands and both scales"
    if "scale_result" in given:
        return "it asks for an FP8 output (scale_result), which bf16 cannot stand in for"
    return None


def plan_fp8(planner: PlannerView) -> None:
    """Rewrite the FP8 ops of `planner.module` into the plan; drop their fp8 skips, keep the rest."""
    module, plan = planner.module, planner.plan
    functions = _walk(module).functions
    parents = {id(inner): outer for outer in functions for inner in _walk(outer).functions if inner is not outer}
    owners: dict[str, cst.FunctionDef] = {}  # op (Python name and "ns::op") -> function calling _scaled_mm
    scopes: list[cst.FunctionDef] = []
    for function in functions:
        if id(function) in parents:  # nested: its outermost def is the scope
            continue
        matmuls = [call for call in _walk(function).calls if SCALED_MM in planner._qnames(call.func)]
        refused = [(call, why) for call in matmuls if (why := _portable(call)) is not None]
        for call, why in refused:  # the whole function (and its fake) stays FP8: half a port would mix dtypes
            planner._skip(call, SkipCategory.fp8, f"torch._scaled_mm left as it is, with the FP8 casts of `"
                          f"{function.name.value}`: {why}. Replace it with a bf16 matmul by hand (torch_npu 2.14 has "
                          "no FP8 matmul)")
        if matmuls and not refused:
            scopes.append(function)
            owners[function.name.value] = function
            if (op := _custom_op_name(planner, function)) is not None:
                owners[op] = function
    if not scopes:
        return
    scopes += [f for f in functions if id(f) not in parents and f not in scopes and _fake_of(planner, f) in owners]
    handled_lines: set[int] = set()
    for scope in scopes:
        walked = _walk(scope)
        for call in (c for c in walked.calls if SCALED_MM in planner._qnames(c.func)):
            line = planner._line(call)
            plan.exprs[id(call)] = lambda updated, module=module: _bf16_mm(updated, module)
            after = module.code_for_node(_bf16_mm(call, module))
            plan.changes.append(PortChange(file=planner.relpath, line=line, kind=ChangeKind.fp8_matmul,
                                           before=planner._code(call).split("(")[0] + "(...)", after=after[:200],
                                           review=PRECISION_REVIEW))
            handled_lines.add(line)
        for ref in walked.refs:
            if not _is_fp8_dtype(planner._qnames(ref)):
                continue
            plan.exprs[id(ref)] = dotted_expr("torch.bfloat16")
            line = planner._line(ref)
            plan.changes.append(PortChange(file=planner.relpath, line=line, kind=ChangeKind.fp8_dtype,
                                           before=planner._code(ref), after="torch.bfloat16", review=PRECISION_REVIEW))
            handled_lines.add(line)
    plan.skipped[:] = [s for s in plan.skipped if not (s.category == SkipCategory.fp8 and s.line in handled_lines
                                                       and "left as it is" not in s.reason)]
