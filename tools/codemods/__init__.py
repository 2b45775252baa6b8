"""Codemods: recipes (data) applied to source with libcst."""
