"""The rewrite knowledge base.

schema.py (Recipe, Outcome, YAML loading), embeddings.py (offline hashed embeddings for Chroma),
jsonl.py (the export format), store.py (`KnowledgeBase` over Chroma), location.py (an embedded
directory or a server), chroma_tables.py (the two collections and their rows), ranking_query.py
(the retrieval agent's query; how recipes are ranked from it is the retrieval agent's,
agents/retrieval/), store_records.py (typed results), cli.py (`trainbridge kb ...`), recipes/ (seed
recipes, YAML data). Importing this package imports nothing heavy; import the submodule you need.
"""
