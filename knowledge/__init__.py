"""The rewrite knowledge base.

schema.py (Recipe, Outcome, YAML loading), embeddings.py (offline hashed embeddings for Chroma),
ranking.py (how recipes are scored for an intent), jsonl.py (the export format), store.py
(`KnowledgeBase` over Chroma), cli.py (`trainbridge kb ...`), recipes/ (seed recipes, YAML data).
Importing this package imports nothing heavy; import the submodule you need.
"""
