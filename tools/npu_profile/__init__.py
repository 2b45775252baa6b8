"""The NPU profiler's files: capture settings, parsing its output folder into a target profile."""
