"""The rewrite knowledge base.

schema.py (Recipe, Outcome, YAML loading), embeddings.py (offline hashed embeddings for Chroma),
jsonl.py (the export format), store.py
(`KnowledgeBase` over Chroma; how recipes are ranked for an intent is the retrieval
agent's, agents/retrieval/), cli.py (`trainbridge kb ...`), recipes/ (seed recipes, YAML data).
Importing this package imports nothing heavy; import the submodule you need.
"""
