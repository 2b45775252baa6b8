"""Triton kernels carried to the NPU: each launch `kernel[grid](...)` becomes the PyTorch ops its kernel computes.

Kernels are recognised by what they do, not by name: `triton_math.derive` reads the `@triton.jit` kernel's tl ops
(loads, tl.dot, elementwise math, stores) against the launch's arguments, so a renamed copy in another record ports
the same way. The launch statement is replaced (the launcher keeps its signature, asserts, allocation and return);
its `grid` lambda goes with it. A kernel, jit helper or autotune-config function no longer launched or named anywhere
is deleted; then the `import triton` lines go, or are guarded when the file still reads `triton.__version__` (None
without Triton), so the ported file imports without Triton. A launch whose kernel cannot be derived stays, reported
at its line with why.
"""

from __future__ import annotations

import re

import libcst as cst
from libcst.metadata import PositionProvider

from trainbridge.tools.porting.fp8 import PlannerView
from trainbridge.tools.porting.results import ChangeKind, PortChange, SkipCategory
from trainbridge.tools.porting.rules import dotted
from trainbridge.tools.porting.triton_math import NotDerived, derive

GUARDED_IMPORT = ("try:  # TrainBridge: the NPU port launches no Triton kernel; triton is only read for its version\n"
                  "    import triton\n"
                  "except ImportError:\n"
                  "    from types import SimpleNamespace\n\n"
                  "    triton = SimpleNamespace(__version__=None)  # no Triton here: its version reads None\n")
DERIVED_REVIEW = (
    "derived by TrainBridge from the kernel's tl ops (loads, tl.dot, elementwise math, stores; the block tiling is not "
    "traced): {math}.{docstring}{symmetric} Casts inside the kernel (.to) are not kept: the PyTorch ops compute in "
    "the tensors' dtype (matmuls accumulate in fp32 as tl.dot does). Review that the launch covers the whole tensors")


class _Names(cst.CSTVisitor):
    """Uses of plain names (not attribute members or keyword names), skipping the subtrees in `gone`."""

    def __init__(self, gone: set[int]) -> None:
        super().__init__()
        self.gone = gone
        self.uses: list[tuple[str, cst.Name, str | None]] = []  # (name, node, member read from it)

    def on_visit(self, node: cst.CSTNode) -> bool:
        if id(node) in self.gone:
            return False
        if isinstance(node, cst.Attribute):
            if isinstance(node.value, cst.Name):
                self.uses.append((node.value.value, node.value, node.attr.value))
                return False
            node.value.visit(self)
            return False
        if isinstance(node, cst.Arg):
            node.value.visit(self)
            return False
        if isinstance(node, cst.Name):
            self.uses.append((node.value, node, None))
        return True


def _uses(node: cst.CSTNode, gone: set[int]) -> list[tuple[str, cst.Name, str | None]]:
    names = _Names(gone)
    node.visit(names)
    return names.uses


def _is_triton(planner: PlannerView, function: cst.FunctionDef) -> bool:
    for decorator in function.decorators:
        target = decorator.decorator
        if any(q.split(".")[0] == "triton" for q in planner._qnames(target.func if isinstance(target, cst.Call)
                                                                      else target)):
            return True
    return False


def _triton_imports(planner: PlannerView) -> list[tuple[cst.SimpleStatementLine, list[str]]]:
    """Top-level statements that only import triton modules, with the names they bind."""
    found = []
    for statement in planner.module.body:
        if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
            continue
        small = statement.body[0]
        if isinstance(small, cst.Import) and all(dotted(a.name).split(".")[0] == "triton" for a in small.names):
            found.append((statement, [dotted(a.asname.name) if a.asname else dotted(a.name).split(".")[0]
                                      for a in small.names]))
        elif (isinstance(small, cst.ImportFrom) and not small.relative
              and dotted(small.module).split(".")[0] == "triton"
              and not isinstance(small.names, cst.ImportStar)):
            found.append((statement, [dotted(a.asname.name) if a.asname else dotted(a.name) for a in small.names]))
    return found


def _span(planner: PlannerView, node: cst.FunctionDef | cst.CSTNode) -> tuple[int, int]:
    position = planner.get_metadata(PositionProvider, node)
    first = planner._line(node.decorators[0]) if isinstance(node, cst.FunctionDef) and node.decorators else \
        position.start.line
    return first, position.end.line


def _statement_of(planner: PlannerView, node: cst.CSTNode) -> cst.CSTNode | None:
    while node is not None and not isinstance(node, cst.SimpleStatementLine):
        node = planner._parent(node)
    return node


def _function_of(planner: PlannerView, node: cst.CSTNode) -> cst.FunctionDef | None:
    while node is not None and not isinstance(node, cst.FunctionDef):
        node = planner._parent(node)
    return node


class _Launches(cst.CSTVisitor):
    def __init__(self, kernels: dict[str, cst.FunctionDef]) -> None:
        super().__init__()
        self.kernels = kernels
        self.found: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Subscript) and dotted(node.func.value) in self.kernels:
            self.found.append(node)


def plan_triton(planner: PlannerView) -> None:
    """Rewrite the derivable Triton launches of `planner.module` into the plan, delete what is left unused."""
    module, plan = planner.module, planner.plan
    kernels = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef) and _is_triton(planner, s)}
    if not kernels:
        return
    launches = _Launches(kernels)
    module.visit(launches)
    gone: set[int] = set()  # nodes removed or replaced
    ported_lines: set[int] = set()
    ported: set[str] = set()  # kernels with a launch replaced
    for launch in launches.found:
        name = dotted(launch.func.value)
        kernel = kernels[name]
        statement = _statement_of(planner, launch)
        line = planner._line(launch)
        try:
            if statement is None or len(statement.body) != 1 or not isinstance(statement.body[0], cst.Expr) \
                    or statement.body[0].value is not launch:
                raise NotDerived("the launch is not a statement of its own (its result is used)", launch)
            if not _imports_torch(module):
                raise NotDerived("the file has no top-level `import torch` for the PyTorch ops that would replace it",
                                 launch)
            derived = derive(kernel, launch_args(kernel, launch, module))
        except NotDerived as why:
            where = planner._line(why.node) if why.node is not None else planner._line(kernel)
            _explain(planner, line, f"launch of Triton kernel `{name}` (line {planner._line(kernel)}) left as it is: "
                     f"not derived, {why.why} (line {where}). Replace it with PyTorch ops or a torch_npu fused API "
                     "by hand")
            continue
        launcher = _function_of(planner, launch)
        docstring = launcher.get_docstring() if launcher is not None else None
        agrees = formula_agrees(docstring, derived.math)
        said = {True: " The launcher's docstring says the same.", False: f" The launcher's docstring says otherwise "
                f"({(docstring or '').strip()!r}): check which is right.", None: ""}[agrees]
        symmetric = (" The kernel computes one triangle of blocks and mirrors it: equal where the result is symmetric "
                     "(inputs of the form A @ A.T, or a symmetric A)." if derived.symmetric else "")
        note = f"  # TrainBridge: the Triton kernel {name}, as PyTorch ops (port report)"
        new = cst.parse_statement(derived.code + note + "\n").with_changes(leading_lines=statement.leading_lines)
        plan.exprs[id(statement)] = new
        gone.add(id(statement))
        ported_lines.add(line)
        ported.add(name)
        plan.changes.append(PortChange(
            file=planner.relpath, line=line, kind=ChangeKind.triton_launch,
            before=planner._code(launch).split("(")[0] + "(...)", after=derived.code[:200],
            review=DERIVED_REVIEW.format(math=f"{derived.output} = {derived.math}", docstring=said,
                                         symmetric=symmetric)))
        index = launch.func.slice[0].slice if len(launch.func.slice) == 1 else None
        grid = index.value if isinstance(index, cst.Index) else None
        if isinstance(grid, cst.Name) and launcher is not None:
            _drop_grid(planner, launcher, grid.value, gone)
    removed = _drop_unused(planner, kernels, ported, gone)
    _drop_imports(planner, gone)
    spans = [_span(planner, node) for node in removed]
    plan.skipped[:] = [s for s in plan.skipped if not (
        s.category == SkipCategory.triton and (s.line in ported_lines or any(a <= s.line <= b for a, b in spans)))]


def _imports_torch(module: cst.Module) -> bool:
    return any(isinstance(small, cst.Import) and any(dotted(a.name) == "torch" and a.asname is None for a in small.names)
               for statement in module.body if isinstance(statement, cst.SimpleStatementLine)
               for small in statement.body)


def _explain(planner: PlannerView, line: int, reason: str) -> None:
    for index, item in enumerate(planner.plan.skipped):
        if item.category == SkipCategory.triton and item.line == line:
            planner.plan.skipped[index] = item.model_copy(update={"reason": reason})
            return


def _drop_grid(planner: PlannerView, launcher: cst.FunctionDef, grid: str, gone: set[int]) -> None:
    """Remove `grid = lambda ...` from the launcher when the replaced launch was its only use."""
    assignments = [s for s in launcher.body.body if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1
                   and isinstance(s.body[0], cst.Assign) and len(s.body[0].targets) == 1
                   and dotted(s.body[0].targets[0].target) == grid]
    if len(assignments) != 1:
        return
    others = [u for u in _uses(launcher.body, gone | {id(assignments[0])}) if u[0] == grid]
    if not others:
        planner.plan.exprs[id(assignments[0])] = cst.RemovalSentinel.REMOVE
        gone.add(id(assignments[0]))


def _top_def(planner: PlannerView, node: cst.CSTNode) -> cst.CSTNode | None:
    """The top-level statement that holds `node`."""
    while node is not None and planner._parent(node) is not planner.module:
        node = planner._parent(node)
    return node


def _drop_unused(planner: PlannerView, kernels: dict[str, cst.FunctionDef], ported: set[str],
                 gone: set[int]) -> list[cst.CSTNode]:
    """Delete the ported kernels, then the jit helpers and triton-only functions only they named, once nothing left
    names them (to a fixpoint). A kernel this file never launches may be launched from another: it stays."""
    imports = {n for _, names in _triton_imports(planner) for n in names}
    candidates = {name: kernels[name] for name in ported}
    triton_defs = {id(k) for k in kernels.values()}
    for statement in planner.module.body:
        name = getattr(statement, "name", None)
        if not isinstance(statement, cst.FunctionDef) or name.value in candidates or not (
                id(statement) in triton_defs or any(n in imports for n, _, _ in _uses(statement.body, set()))):
            continue
        # a jit helper or a triton-only function (the autotune configs) named only from inside the kernels
        refs = [ref for n, ref, _ in _uses(planner.module, set()) if n == name.value]
        owners = [_top_def(planner, ref) for ref in refs]
        if any(o is not statement for o in owners) and all(o is statement or id(o) in triton_defs for o in owners):
            candidates[name.value] = statement
    removed: list[cst.CSTNode] = []
    changed = True
    while changed:
        changed = False
        uses = _uses(planner.module, gone)
        for name, node in list(candidates.items()):
            if id(node) in gone:
                continue
            inside = {id(n) for _, n, _ in _uses(node, gone)}
            if any(n == name and id(ref) not in inside for n, ref, _ in uses):
                continue
            gone.add(id(node))
            removed.append(node)
            planner.plan.exprs[id(node)] = cst.RemovalSentinel.REMOVE
            why = ("every launch of it was replaced by PyTorch ops" if name in ported else
                   "only the deleted Triton kernels named it")
            planner.plan.changes.append(PortChange(
                file=planner.relpath, line=_span(planner, node)[0], kind=ChangeKind.triton_removed,
                before=f"def {name}(...)", after="", review=f"`{name}` deleted: {why}, and nothing left names it"))
            changed = True
    return removed


def _drop_imports(planner: PlannerView, gone: set[int]) -> None:
    """Remove the triton imports nothing left uses; guard `import triton` where only `triton.__version__` is read."""
    imports = _triton_imports(planner)
    if not imports:
        return
    import_ids = {id(s) for s, _ in imports}
    bound = {n for _, names in imports for n in names}
    uses = [u for u in _uses(planner.module, gone | import_ids) if u[0] in bound]
    if any(not (name == "triton" and member == "__version__") for name, _, member in uses):
        return  # a kernel or other use of triton is left: the imports stay, reported
    plain = next((s for s, names in imports if names == ["triton"] and isinstance(s.body[0], cst.Import)), None)
    if uses and plain is None:
        return
    for statement, _ in imports:
        before = planner._code(statement.body[0]).strip()
        if uses and statement is plain:
            planner.plan.exprs[id(statement)] = cst.parse_statement(GUARDED_IMPORT).with_changes(
                leading_lines=statement.leading_lines)
            after = "try: import triton / except ImportError: triton = SimpleNamespace(__version__=None)"
        else:
            planner.plan.exprs[id(statement)] = cst.RemovalSentinel.REMOVE
            after = ""
        planner.plan.changes.append(PortChange(file=planner.relpath, line=planner._line(statement),
                                               kind=ChangeKind.triton_import, before=before, after=after))
        gone.add(id(statement))
    lines = {planner._line(s) for s, _ in imports}
    planner.plan.skipped[:] = [s for s in planner.plan.skipped
                               if not (s.category == SkipCategory.triton and s.line in lines)]


def launch_args(kernel: cst.FunctionDef, launch: cst.Call, module: cst.Module) -> dict[str, str]:
    """Kernel param -> the code of the argument the launch passes for it (positional in parameter order)."""
    params = [p.name.value for p in kernel.params.params]
    args: dict[str, str] = {}
    for index, arg in enumerate(launch.args):
        if arg.star:
            raise NotDerived("the launch unpacks *args/**kwargs", launch)
        name = arg.keyword.value if arg.keyword is not None else (params[index] if index < len(params) else None)
        if name is not None:
            args[name] = module.code_for_node(arg.value).strip()
    return args


def formula_agrees(docstring: str | None, math: str) -> bool | None:
    """Does the launcher's docstring formula (`... compute C = <formula>`) say `math`? None when it has none."""
    if not docstring:
        return None
    match = re.search(r"=\s*([^\n=]+)$", docstring.strip(), re.MULTILINE)
    if not match:
        return None
    norm = lambda s: re.sub(r"[\s()]", "", s).replace(".mT", ".T")  # noqa: E731
    return norm(match.group(1)) == norm(math)
