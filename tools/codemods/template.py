"""Render a recipe's replacement template with the code its match bound."""

from __future__ import annotations

import re

import libcst as cst

from trainbridge.tools.codemods.pattern import Bindings

_PLACEHOLDER = re.compile(r"\$(?:\{([_a-zA-Z]\w*)\}|([_a-zA-Z]\w*))")
# Bound code that can sit anywhere an atom can (before '.', '[', '(' or as an operand) unparenthesised.
_ATOMIC = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float, cst.SimpleString,
           cst.Tuple, cst.List, cst.Dict, cst.Set)


# Bound code that needs parentheses even as a whole call argument or list element.
_NEEDS_PARENS = (cst.GeneratorExp, cst.Yield, cst.NamedExpr, cst.StarredElement, cst.Lambda)


def _delimited(text: str, start: int, end: int) -> bool:
    """Whether the placeholder at text[start:end] is a whole argument / element / keyword value:
    preceded by '(', '[', ',' or a keyword's '=' and followed by ')', ']' or ','."""
    before = text[:start].rstrip()
    after = text[end:].lstrip()
    opened = before.endswith(("(", "[", ",")) or (re.search(r"[(,]\s*\w+\s*=$", before) is not None)
    return opened and after.startswith((")", "]", ","))


class TemplateError(ValueError):
    """The rendered replacement is not valid Python."""


def substitute(template: str, bindings: Bindings, module: cst.Module, raw: dict[str, str] | None = None) -> str:
    source = template.replace("$$", "\0DOLLAR\0")

    def code(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in bindings:
            raise TemplateError(f"placeholder ${name} is not bound by the match")
        node = bindings[name]
        text = module.code_for_node(node).strip()
        if isinstance(node, _ATOMIC) or (node.lpar if hasattr(node, "lpar") else False):
            return text
        if _delimited(source, match.start(), match.end()) and not isinstance(node, _NEEDS_PARENS):
            return text
        return f"({text})"

    text = _PLACEHOLDER.sub(code, source)
    for token, value in (raw or {}).items():
        text = text.replace(token, value)
    text = re.sub(r"\(\s*,\s*", "(", text)  # an empty $args before other arguments
    return text.replace("\0DOLLAR\0", "$")


def render_expression(template: str, bindings: Bindings, module: cst.Module, raw: dict[str, str] | None = None) -> cst.BaseExpression:
    text = substitute(template, bindings, module, raw)
    try:
        return cst.parse_expression(text)
    except cst.ParserSyntaxError as exc:
        raise TemplateError(f"replacement renders to invalid Python {text!r}: {exc.message}") from None


def render_statements(template: str, bindings: Bindings, module: cst.Module,
                      raw: dict[str, str] | None = None) -> list[cst.BaseStatement]:
    text = substitute(template, bindings, module, raw)
    try:
        return list(cst.parse_module(text.rstrip() + "\n").body)
    except cst.ParserSyntaxError as exc:
        raise TemplateError(f"replacement renders to invalid Python {text!r}: {exc.message}") from None
