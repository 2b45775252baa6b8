"""The retrieval agent: which intent to work on next and which recipes to try for it, best first.

rank.py (the knowledge base's candidates and past outcomes for one intent, scored), ranking.py (the
pure scoring functions, every part of a score explained), choose.py (the next intent and its recipe
queue, with the regional-compile last resort). The graph's retrieval node is a thin call into
choose.py.
"""
