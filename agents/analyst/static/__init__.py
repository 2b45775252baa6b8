"""The static source scan: hand-written patterns and target-aware library calls, found from the source.

Entry points are in ``scan`` (``scan_repo``, ``scan_repo_result``, ``scan_source``); ``model`` and
``ir`` lower libcst trees into the normalised expression model; ``match`` and ``forms`` are the
matching primitives; ``norms``, ``activations``, ``attention``, ``rotary``, ``layout`` and ``chains``
hold the expression patterns (registered in ``patterns``); ``rules``, ``loops`` and ``library`` the
program-level rules; ``targets`` says which findings are a gain on which backend; ``resolve`` turns
matches into intents.
"""
