"""TrainBridge: compiler-guided, measurement-gated rewrites of PyTorch training programs.

The repository root is this import package; its folders are the architecture:
agents/ (analyst, retrieval, coder, profiler), graph/ (state, loop, CLI),
knowledge/ (recipes, Chroma store), tools/ (parsers, codemods, git, reports),
sandbox/ (child-process runner, step harness, backends, NPU emulation).
"""

__version__ = "0.1.0"
