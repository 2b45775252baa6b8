"""Codemods: recipes (data) applied to source with libcst.

engine.py (`apply_recipe(source, recipe, span) -> Edit`, or `CodemodRefused` with the reason and the
near misses; the expression, call, semantic, statements and decorate match kinds), pattern.py
(metavariable patterns matched ignoring formatting), statements.py (statement sequences, the
``$_[E]`` hole, liveness checks), template.py (rendering replacements), definitions.py (module-level
helper code a recipe carries in ``params.define``), imports.py (recipe import lines), scopes.py
(the function, method or module ``forward`` that holds a span, at any depth), calls.py (the
``call`` kind: keyword checks, ``overridable`` keywords, ``**kwargs`` removal), kwargs.py (which
keys a ``**name`` argument can hold, read from the code that builds it).
"""
