"""Which FlexAttention mask_mods the NPU port can carry, read statically from the mask_mod's source.

A mask_mod `def m(b, h, q_idx, kv_idx)` is carried when its body is assignments of names followed
by `return` of a conjunction (`&` or `and`) of these terms, through those names:
- causal: `q_idx >= kv_idx` (or `kv_idx <= q_idx`);
- sliding window: `q_idx - kv_idx < W` (or `<= W`, a window of W + 1), W free of the four arguments (a
  number, a name, a tensor: read when the mask is built, as create_block_mask does);
- document: `docs[q_idx] == docs[kv_idx]`, docs free of the four arguments (1-D, non-decreasing
  ids such as `(inputs == EOS).cumsum(0)`: runs of equal ids are the documents).
Anything else (`|`, `>`, offsets, other index expressions) is an arbitrary mask_mod: not carried.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst


@dataclass(frozen=True)
class MaskSpec:
    causal: bool
    window: str | None  # source of W in `q_idx - kv_idx < W` (tokens kept, the current one included)
    docs: str | None  # source of the document-id tensor


class NotCarried(Exception):
    """The mask_mod is not one the port can carry; the message says which part."""


def _names_in(node: cst.CSTNode) -> set[str]:
    found: set[str] = set()

    class _Names(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.add(name.value)

        def visit_Attribute(self, attr: cst.Attribute) -> bool:
            attr.value.visit(self)
            return False

    node.visit(_Names())
    return found


def _is(node: cst.CSTNode, name: str) -> bool:
    return isinstance(node, cst.Name) and node.value == name


def _strip(node: cst.BaseExpression) -> cst.BaseExpression:
    return node.with_changes(lpar=[], rpar=[])


def _conjuncts(node: cst.BaseExpression, env: dict[str, cst.BaseExpression], depth: int = 0) -> list[cst.BaseExpression]:
    if depth > 20:
        raise NotCarried("the mask_mod's names refer to each other too deeply")
    if isinstance(node, cst.Name) and node.value in env:
        return _conjuncts(env[node.value], env, depth + 1)
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.BitAnd):
        return _conjuncts(node.left, env, depth + 1) + _conjuncts(node.right, env, depth + 1)
    if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And):
        return _conjuncts(node.left, env, depth + 1) + _conjuncts(node.right, env, depth + 1)
    return [_strip(node)]


class _Reader:
    def __init__(self, module: cst.Module, params: list[str], env: dict[str, cst.BaseExpression]) -> None:
        self.module, self.env = module, env
        self.b, self.h, self.q, self.kv = params
        self.causal = False
        self.window: str | None = None
        self.docs: str | None = None

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node).strip()

    def free(self, node: cst.CSTNode, what: str) -> str:
        used = _names_in(node) & ({self.b, self.h, self.q, self.kv} | self.env.keys())
        if used:
            raise NotCarried(f"the {what} `{self.code(node)}` depends on the mask_mod's own arguments or names ({', '.join(sorted(used))})")
        return self.code(node)

    def term(self, node: cst.BaseExpression) -> None:
        if not isinstance(node, cst.Comparison) or len(node.comparisons) != 1:
            raise NotCarried(f"`{self.code(node)}` is not a causal, sliding-window or document term")
        left, target = node.left, node.comparisons[0]
        op, right = target.operator, target.comparator
        if (isinstance(op, cst.GreaterThanEqual) and _is(left, self.q) and _is(right, self.kv)) or (
                isinstance(op, cst.LessThanEqual) and _is(left, self.kv) and _is(right, self.q)):
            self.causal = True
            return
        diff = _strip(left)
        if (isinstance(op, (cst.LessThan, cst.LessThanEqual)) and isinstance(diff, cst.BinaryOperation)
                and isinstance(diff.operator, cst.Subtract) and _is(diff.left, self.q) and _is(diff.right, self.kv)):
            if self.window is not None:
                raise NotCarried("the mask_mod has two sliding-window terms")
            bound = self.free(right, "window")
            self.window = bound if isinstance(op, cst.LessThan) else f"({bound}) + 1"
            return
        if (isinstance(op, cst.Equal) and isinstance(left, cst.Subscript) and isinstance(right, cst.Subscript)
                and self._index(left) == self.q and self._index(right) == self.kv
                and self.code(left.value) == self.code(right.value)):
            if self.docs is not None:
                raise NotCarried("the mask_mod has two document terms")
            self.docs = self.free(left.value, "document-id tensor")
            return
        raise NotCarried(f"`{self.code(node)}` is not a causal, sliding-window or document term")

    @staticmethod
    def _index(node: cst.Subscript) -> str | None:
        if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Index):
            return None
        value = node.slice[0].slice.value
        return value.value if isinstance(value, cst.Name) else None


def read_mask_mod(module: cst.Module, func: cst.FunctionDef) -> MaskSpec:
    """The causal/window/document mask `func` computes, or NotCarried saying what is in the way."""
    params = [p.name.value for p in func.params.params]
    if len(params) != 4 or func.params.star_arg not in (None, cst.MaybeSentinel.DEFAULT) or func.params.kwonly_params:
        raise NotCarried(f"mask_mod `{func.name.value}` does not take (b, h, q_idx, kv_idx)")
    if func.decorators:
        raise NotCarried(f"mask_mod `{func.name.value}` is decorated")
    body = func.body.body if isinstance(func.body, cst.IndentedBlock) else [func.body]
    env: dict[str, cst.BaseExpression] = {}
    returned = None
    for statement in body:
        smalls = statement.body if isinstance(statement, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) else None
        if smalls is None:
            raise NotCarried(f"mask_mod `{func.name.value}` has a compound statement (if/for/with)")
        for small in smalls:
            if returned is not None:
                raise NotCarried(f"mask_mod `{func.name.value}` has code after its return")
            if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
                env[small.targets[0].target.value] = small.value
            elif isinstance(small, cst.Return) and small.value is not None:
                returned = small.value
            elif not isinstance(small, (cst.Pass, cst.Expr)):
                raise NotCarried(f"mask_mod `{func.name.value}` has a statement other than `name = ...` and `return`")
    if returned is None:
        raise NotCarried(f"mask_mod `{func.name.value}` returns nothing the port can read")
    reader = _Reader(module, params, env)
    for term in _conjuncts(returned, env):
        reader.term(term)
    return MaskSpec(reader.causal, reader.window, reader.docs)
