"""The coder: applies a recipe to an intent's region as a codemod and commits it on a candidate branch."""
