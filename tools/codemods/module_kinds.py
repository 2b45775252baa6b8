"""What module a pattern's metavariable calls: ``self.ln_2(h)`` is a LayerNorm when ``self.ln_2 = LayerNorm(d)``.

A recipe whose replacement reads a module's attributes (``$norm.weight``, ``$norm.eps``) is only right for
one kind of module: `add-rms-norm-npu` turns ``h = x + d; ... norm(h)`` into ``npu_add_rms_norm``, which is
wrong for a LayerNorm that also has ``weight`` and ``eps``. A recipe says which kinds it needs with
``params.modules`` (metavariable -> the class names it accepts, matched case-insensitively as a part of
the constructor's name: ``RMSNorm`` accepts ``nn.RMSNorm``, ``LlamaRMSNorm``, ``MyRMSNorm``). The module is
found where the file constructs it (``self.<attr> = Cls(...)`` or ``name = Cls(...)``); every construction of
that name must be an accepted kind, and a name the file never constructs is refused: what it is cannot be
told from the source.
"""

from __future__ import annotations

import libcst as cst

from trainbridge.tools.codemods.pattern import Bindings


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr.value}" if inner else ""
    return ""


def constructors(module: cst.Module, target: str) -> list[str]:
    """The dotted callee of every ``<target> = Callee(...)`` in the file (``target``: ``self.ln_2`` or ``norm``)."""
    found: list[str] = []

    class Visitor(cst.CSTVisitor):
        def _take(self, targets, value) -> None:
            if isinstance(value, cst.Call) and any(_dotted(t) == target for t in targets):
                found.append(_dotted(value.func) or module.code_for_node(value.func))

        def visit_Assign(self, node: cst.Assign) -> None:
            self._take([t.target for t in node.targets], node.value)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            self._take([node.target], node.value)

    module.visit(Visitor())
    return found


def modules_mismatch(module: cst.Module, bindings: Bindings, kinds: dict) -> str | None:
    """Why a module bound in ``bindings`` is not of a kind ``kinds`` (``params.modules``) accepts, or None."""
    for name, accepted in kinds.items():
        bound = bindings.get(name)
        if bound is None:
            continue
        accepted = [accepted] if isinstance(accepted, str) else list(accepted)
        code = module.code_for_node(bound).strip()
        target = _dotted(bound) if isinstance(bound, (cst.Name, cst.Attribute)) else ""
        made_by = constructors(module, target) if target else []
        if not made_by:
            return (f"{code} is not constructed in this file, so whether it is a {' or '.join(accepted)} "
                    "cannot be told from the source")
        wrong = [c for c in made_by if not any(a.lower() in c.rsplit(".", 1)[-1].lower() for a in accepted)]
        if wrong:
            return f"{code} is a {wrong[0]}, not a {' or '.join(accepted)}"
    return None
