"""What a `@triton.jit` kernel computes, read from its tl ops, as a PyTorch expression over its launch's arguments.

A small symbolic pass over the kernel body: pointers are traced to the kernel parameter they start from and to the
strides their 2-D offsets multiply (`offs_m[:, None] * stride_r + offs_k[None, :] * stride_c` reads the tensor, the
strides swapped read its transpose); `tl.load` gives a tile of that tensor, `tl.zeros` a zero accumulator,
`tl.dot(a, b, acc)` a matrix product (tiled over K in its loop), elementwise arithmetic and a few tl math functions
what they say; `tl.store` says which tensor receives the value. A second store of `value.T` into the same tensor is
the symmetric-matmul trick (one triangle of blocks computed, mirrored). Masks must be bounds checks (`<` compares,
joined with `&`). Anything else (reductions, atomics, data-dependent branches, ...) is not derived, with the line.

The block/program-id arithmetic is not traced: it only tiles the work. So the derivation is of the math, not of the
tiling; where tiling and math disagree (a kernel that leaves part of its output unwritten) it would be wrong, which is
why every derived launch is flagged for review beside its numerics test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from trainbridge.tools.porting.rules import dotted

# tl function -> torch function (elementwise, same argument order)
ELEMENTWISE = {"exp": "torch.exp", "log": "torch.log", "sqrt": "torch.sqrt", "abs": "torch.abs",
               "maximum": "torch.maximum", "minimum": "torch.minimum", "sigmoid": "torch.sigmoid",
               "rsqrt": "torch.rsqrt", "cos": "torch.cos", "sin": "torch.sin"}
INDEX_OPS = {"program_id", "num_programs", "arange", "cdiv", "swizzle2d", "range", "static_range", "multiple_of",
             "max_contiguous", "constexpr", "static_assert", "device_assert"}
_BINARY = {cst.Add: "+", cst.Subtract: "-", cst.Multiply: "*", cst.Divide: "/"}
_AUG = {cst.AddAssign: "+", cst.SubtractAssign: "-", cst.MultiplyAssign: "*", cst.DivideAssign: "/"}
_STRIDE = re.compile(r"(\w+)\.stride\((-?\d+)\)")


class NotDerived(Exception):
    """The kernel does something this pass does not read; `line` is the kernel line (relative to the file)."""

    def __init__(self, why: str, node: cst.CSTNode | None = None) -> None:
        super().__init__(why)
        self.why, self.node = why, node


# -- expressions ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tile:
    root: str  # kernel pointer parameter
    view: str  # "N": the tensor, "T": its transpose, "flat": 1-D offsets


@dataclass(frozen=True)
class Dot:
    left: object
    right: object


@dataclass(frozen=True)
class Bin:
    op: str
    left: object
    right: object


@dataclass(frozen=True)
class Fn:
    name: str  # torch function
    args: tuple


@dataclass(frozen=True)
class Param:
    name: str


@dataclass(frozen=True)
class Const:
    value: str


@dataclass(frozen=True)
class Zero:
    pass


@dataclass(frozen=True)
class Transposed:
    value: object


@dataclass(frozen=True)
class _Ptr:
    root: str
    strides: tuple[str, str] | None  # (axis-0 stride param, axis-1 stride param); None: 1-D offsets


@dataclass(frozen=True)
class Store:
    root: str
    view: str
    value: object
    node: cst.CSTNode


@dataclass(frozen=True)
class Derived:
    """`code` is the PyTorch statement for the launch; `math` the formula (for the report and docstring check)."""

    code: str
    math: str
    output: str  # the launch argument that receives the result
    symmetric: bool  # the kernel mirrors one triangle: equal to the formula where it is symmetric


def _add(a: object, b: object) -> object:
    if isinstance(a, Zero):
        return b
    if isinstance(b, Zero):
        return a
    return Bin("+", a, b)


# -- the pass --------------------------------------------------------------------------------------------------------

class _Kernel:
    def __init__(self, kernel: cst.FunctionDef, args: dict[str, str]) -> None:
        self.params = [p.name.value for p in kernel.params.params]
        self.args = args  # kernel param -> launch argument code
        self.values: dict[str, object] = {}
        self.ptrs: dict[str, _Ptr] = {}
        self.stores: list[Store] = []
        self.masks: dict[str, bool] = {}  # name -> bound to a bounds check

    # pointers
    def pointer(self, expr: cst.BaseExpression) -> _Ptr | None:
        if isinstance(expr, cst.Name):
            if expr.value in self.ptrs:
                return self.ptrs[expr.value]
            return None
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            base = expr.left
            while isinstance(base, cst.BinaryOperation) and isinstance(base.operator, cst.Add):
                base = base.left
            if not isinstance(base, cst.Name):
                return None
            if base.value in self.ptrs:
                root = self.ptrs[base.value].root
            elif base.value in self.params:
                root = base.value
            else:
                return None
            return _Ptr(root, self._strides(expr))
        return None

    def _strides(self, expr: cst.CSTNode) -> tuple[str, str] | None:
        axes: dict[int, str] = {}

        class Terms(cst.CSTVisitor):
            def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
                if not isinstance(node.operator, cst.Multiply):
                    return
                for index, stride in ((node.left, node.right), (node.right, node.left)):
                    axis = _broadcast_axis(index)
                    if axis is not None and isinstance(stride, cst.Name):
                        axes[axis] = stride.value

        expr.visit(Terms())
        if not axes:
            return None
        if set(axes) != {0, 1}:
            raise NotDerived("a 2-D pointer whose offsets do not multiply one stride per axis", expr)
        return axes[0], axes[1]

    def view(self, ptr: _Ptr, node: cst.CSTNode) -> str:
        if ptr.strides is None:
            return "flat"
        tensor = self.args.get(ptr.root)
        meaning = []
        for stride in ptr.strides:
            match = _STRIDE.fullmatch(self.args.get(stride, "").replace(" ", ""))
            if not match or match.group(1) != tensor:
                raise NotDerived(f"the stride `{stride}` is not launched as `{tensor}.stride(-2)`/`.stride(-1)`, so "
                                 "which way the kernel reads the tensor is unknown", node)
            meaning.append({"-2": "r", "-1": "c"}.get(match.group(2), "?"))
        if meaning == ["r", "c"]:
            return "N"
        if meaning == ["c", "r"]:
            return "T"
        raise NotDerived("the strides a tile is read with are not the tensor's last two", node)

    # values
    def value(self, expr: cst.BaseExpression) -> object:
        """The tensor value of `expr`, or None when it is index arithmetic (ints, offsets, masks)."""
        if isinstance(expr, cst.Name):
            if expr.value in self.values:
                return self.values[expr.value]
            return None
        if isinstance(expr, cst.Call):
            return self.call(expr)
        if isinstance(expr, cst.Attribute) and expr.attr.value == "T":
            inner = self.value(expr.value)
            return None if inner is None else Transposed(inner)
        if isinstance(expr, cst.BinaryOperation):
            left, right = self.value(expr.left), self.value(expr.right)
            if left is None and right is None:
                return None
            op = _BINARY.get(type(expr.operator))
            if op is None:
                operator = cst.Module([]).code_for_node(expr.operator).strip()
                raise NotDerived(f"the operator `{operator}` on a tile", expr)
            return Bin(op, left if left is not None else self.scalar(expr.left),
                       right if right is not None else self.scalar(expr.right))
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
            inner = self.value(expr.expression)
            return None if inner is None else Bin("-", Const("0"), inner)
        return None

    def scalar(self, expr: cst.BaseExpression) -> object:
        if isinstance(expr, cst.Name) and expr.value in self.params:
            return Param(expr.value)
        if isinstance(expr, (cst.Integer, cst.Float)):
            return Const(expr.value)
        raise NotDerived(f"a tile is combined with `{cst.Module([]).code_for_node(expr)}`, a value this pass does not "
                         "trace (only kernel parameters and literals)", expr)

    def call(self, call: cst.Call) -> object:
        func = dotted(call.func)
        args = [a.value for a in call.args if a.keyword is None]
        kwargs = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "to" and not func.startswith("tl."):
            return self.value(call.func.value)  # a cast: the output dtype is the receiving tensor's
        if not func.startswith("tl."):
            if isinstance(call.func, cst.Attribute) and call.func.attr.value in ("load", "store"):
                raise NotDerived(f"`{func}` goes through a tensor descriptor (TMA), which this pass does not read", call)
            if any(self.value(a) is not None for a in args + list(kwargs.values())):
                raise NotDerived(f"`{func or 'a call'}` is called on a tile", call)
            return None
        name = func.split(".")[-1]
        if name == "load":
            ptr = self.pointer(args[0])
            if ptr is None:
                raise NotDerived("a load whose pointer is not traced to a kernel parameter", call)
            self.mask(kwargs.get("mask", args[1] if len(args) > 1 else None))
            return Tile(ptr.root, self.view(ptr, call))
        if name == "zeros":
            return Zero()
        if name == "dot":
            left, right = self.value(args[0]), self.value(args[1])
            acc = self.value(args[2]) if len(args) > 2 else self.value(kwargs["acc"]) if "acc" in kwargs else Zero()
            if left is None or right is None or acc is None:
                raise NotDerived("tl.dot of something that is not a traced tile", call)
            return _add(acc, Dot(left, right))
        if name == "trans":
            return Transposed(self.value(args[0]))
        if name in ELEMENTWISE:
            values = [self.value(a) for a in args]
            if all(v is None for v in values):
                return None
            return Fn(ELEMENTWISE[name], tuple(v if v is not None else self.scalar(a) for v, a in zip(values, args)))
        if name in INDEX_OPS:
            return None
        if name == "store":
            raise NotDerived("tl.store used as a value", call)
        raise NotDerived(f"`tl.{name}` is not read by this pass (elementwise math, tl.dot, loads and stores are)", call)

    def bounds(self, mask: cst.BaseExpression) -> bool:
        """Is `mask` a bounds check: `offs < n` compares (or mask names bound to them) joined with `&`?"""
        if isinstance(mask, cst.BinaryOperation) and isinstance(mask.operator, cst.BitAnd):
            return self.bounds(mask.left) and self.bounds(mask.right)
        if isinstance(mask, cst.Comparison):
            return len(mask.comparisons) == 1 and isinstance(mask.comparisons[0].operator, cst.LessThan)
        return isinstance(mask, cst.Name) and self.masks.get(mask.value, False)

    def mask(self, mask: cst.BaseExpression | None) -> None:
        if mask is not None and not self.bounds(mask):
            raise NotDerived("a mask that is not a bounds check (`offs < n`, joined with `&`)", mask)

    # statements
    def run(self, body: list[cst.CSTNode]) -> None:
        for statement in body:
            if isinstance(statement, cst.SimpleStatementLine):
                for small in statement.body:
                    self.small(small)
            elif isinstance(statement, cst.For):
                self.run(statement.body.body)
            elif isinstance(statement, cst.If):
                if all(isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, cst.Return) for x in s.body)
                       for s in statement.body.body) and statement.orelse is None:
                    continue  # `if <block outside the work>: return`
                raise NotDerived("a branch inside the kernel (only `if ...: return` is read)", statement)
            elif isinstance(statement, cst.While):
                raise NotDerived("a while loop inside the kernel", statement)
            else:
                raise NotDerived("a nested definition or compound statement inside the kernel", statement)

    def small(self, small: cst.BaseSmallStatement) -> None:
        if isinstance(small, cst.Assign):
            if len(small.targets) != 1:
                raise NotDerived("a chained assignment", small)
            target = small.targets[0].target
            if not isinstance(target, cst.Name):
                if self.value(small.value) is not None:
                    raise NotDerived("a tile unpacked into several names", small)
                return
            value = self.value(small.value)
            ptr = self.pointer(small.value) if value is None else None  # `scale + tile` is a value, not a pointer
            if ptr is not None:
                self.ptrs[target.value] = ptr
                return
            self.values.pop(target.value, None)
            if value is not None:
                self.values[target.value] = value
            else:
                self.masks[target.value] = self.bounds(small.value)
        elif isinstance(small, cst.AugAssign):
            target = small.target
            if not isinstance(target, cst.Name):
                return
            if target.value in self.ptrs or (target.value in self.params and self.value(small.value) is None
                                             and isinstance(small.operator, cst.AddAssign)
                                             and target.value not in self.values):
                self.ptrs.setdefault(target.value, _Ptr(target.value, None))  # advancing a pointer
                return
            if target.value in self.values:
                op = _AUG.get(type(small.operator))
                if op is None:
                    raise NotDerived("an augmented assignment this pass does not read", small)
                right = self.value(small.value)
                right = right if right is not None else self.scalar(small.value)
                left = self.values[target.value]
                self.values[target.value] = _add(left, right) if op == "+" else Bin(op, left, right)
        elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            call = small.value
            if dotted(call.func) in ("tl.store",):
                args = [a.value for a in call.args if a.keyword is None]
                kwargs = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
                ptr = self.pointer(args[0] if args else kwargs["pointer"])
                value = self.value(args[1] if len(args) > 1 else kwargs["value"])
                if ptr is None or value is None:
                    raise NotDerived("a store whose pointer or value is not traced", call)
                self.mask(kwargs.get("mask", args[2] if len(args) > 2 else None))
                self.stores.append(Store(ptr.root, self.view(ptr, call), value, call))
            else:
                self.value(call)
        elif isinstance(small, cst.Return):
            return
        elif isinstance(small, (cst.Pass, cst.Expr)):
            return
        else:
            raise NotDerived("a statement this pass does not read", small)


def _broadcast_axis(node: cst.BaseExpression) -> int | None:
    """0 for `x[:, None]`, 1 for `x[None, :]`, else None."""
    if not isinstance(node, cst.Subscript) or len(node.slice) != 2:
        return None
    kinds = []
    for element in node.slice:
        inner = element.slice
        if isinstance(inner, cst.Slice):
            kinds.append(":")
        elif isinstance(inner, cst.Index) and isinstance(inner.value, cst.Name) and inner.value.value == "None":
            kinds.append("None")
        else:
            return None
    return {(":", "None"): 0, ("None", ":"): 1}.get(tuple(kinds))


# -- emission --------------------------------------------------------------------------------------------------------

def _math(expr: object, args: dict[str, str]) -> str:
    """Formula text: `alpha * A @ A.T + beta * A` (the records' docstring style)."""
    if isinstance(expr, Tile):
        return args[expr.root] + (".T" if expr.view == "T" else "")
    if isinstance(expr, Dot):
        return f"{_math(expr.left, args)} @ {_math(expr.right, args)}"
    if isinstance(expr, Bin):
        left, right = expr.left, expr.right
        if expr.op == "*" and isinstance(right, (Param, Const)) and not isinstance(left, (Param, Const)):
            left, right = right, left  # scalars first
        return f"{_math(left, args)} {expr.op} {_math(right, args)}"
    if isinstance(expr, Fn):
        return f"{expr.name.split('.')[-1]}({', '.join(_math(a, args) for a in expr.args)})"
    if isinstance(expr, Param):
        return args[expr.name]
    if isinstance(expr, Const):
        return expr.value
    raise NotDerived("an expression this pass cannot write out")


def _code(expr: object, args: dict[str, str]) -> str:
    if isinstance(expr, Tile):
        return args[expr.root] + (".mT" if expr.view == "T" else "")
    if isinstance(expr, Dot):
        return f"torch.matmul({_code(expr.left, args)}, {_code(expr.right, args)})"
    if isinstance(expr, Bin):
        return f"({_code(expr.left, args)} {expr.op} {_code(expr.right, args)})"
    if isinstance(expr, Fn):
        return f"{expr.name}({', '.join(_code(a, args) for a in expr.args)})"
    if isinstance(expr, Param):
        return args[expr.name]
    if isinstance(expr, Const):
        return expr.value
    raise NotDerived("an expression this pass cannot write out")


def _scaled(expr: object) -> tuple[object, Param | Const] | None:
    """(x, s) for `x * s` / `s * x` with a scalar s."""
    if isinstance(expr, Bin) and expr.op == "*":
        if isinstance(expr.right, (Param, Const)):
            return expr.left, expr.right
        if isinstance(expr.left, (Param, Const)):
            return expr.right, expr.left
    return None


def _statement(value: object, out: str, args: dict[str, str]) -> str:
    if isinstance(value, Dot):
        return f"torch.matmul({_code(value.left, args)}, {_code(value.right, args)}, out={out})"
    if isinstance(value, Bin) and value.op == "+":
        first, second = _scaled(value.left), _scaled(value.right)
        if first and second and isinstance(second[0], Dot):
            first, second = second, first
        if first and second and isinstance(first[0], Dot) and isinstance(second[0], Tile):
            (dot, alpha), (tile, beta) = first, second
            a, b = _code(dot.left, args), _code(dot.right, args)
            return (f"(torch.baddbmm if {a}.ndim == 3 else torch.addmm)({_code(tile, args)}, {a}, {b}, "
                    f"beta={_code(beta, args)}, alpha={_code(alpha, args)}, out={out})")
    return f"{out}.copy_({_code(value, args)})"


def derive(kernel: cst.FunctionDef, args: dict[str, str]) -> Derived:
    """The PyTorch statement equal to launching `kernel` with `args` (kernel param -> launch argument code)."""
    state = _Kernel(kernel, args)
    state.run(list(kernel.body.body))
    if not state.stores:
        raise NotDerived("the kernel stores nothing", kernel)
    roots = {s.root for s in state.stores}
    if len(roots) != 1:
        raise NotDerived(f"the kernel writes {len(roots)} tensors ({', '.join(sorted(roots))}); one is read", kernel)
    main = [s for s in state.stores if not isinstance(s.value, Transposed)]
    mirrors = [s for s in state.stores if isinstance(s.value, Transposed)]
    if len(main) != 1:
        raise NotDerived("the kernel stores more than one value into its output", kernel)
    store = main[0]
    if any(m.value.value != store.value for m in mirrors):
        raise NotDerived("a transposed store of another value than the main one", mirrors[0].node)
    views = {v for v in _views(store.value)}
    if store.view == "flat" and views - {"flat"} or store.view != "flat" and "flat" in views:
        raise NotDerived("1-D and 2-D tiles mixed", store.node)
    if store.view == "T":
        raise NotDerived("the output is written transposed", store.node)
    if _has_dot(store.value) and store.view == "flat":
        raise NotDerived("tl.dot on 1-D tiles", store.node)
    for name in _params(store.value):
        if name not in args:
            raise NotDerived(f"the launch does not pass `{name}`", store.node)
    out = args[store.root]
    return Derived(code=_statement(store.value, out, args), math=_math(store.value, args), output=out,
                   symmetric=bool(mirrors))


def _views(expr: object):
    if isinstance(expr, Tile):
        yield expr.view
    for child in _children(expr):
        yield from _views(child)


def _has_dot(expr: object) -> bool:
    return isinstance(expr, Dot) or any(_has_dot(c) for c in _children(expr))


def _params(expr: object):
    if isinstance(expr, Param):
        yield expr.name
    if isinstance(expr, Tile):
        yield expr.root
    for child in _children(expr):
        yield from _params(child)


def _children(expr: object) -> tuple:
    if isinstance(expr, Dot):
        return expr.left, expr.right
    if isinstance(expr, Bin):
        return expr.left, expr.right
    if isinstance(expr, Fn):
        return expr.args
    if isinstance(expr, Transposed):
        return (expr.value,)
    return ()
