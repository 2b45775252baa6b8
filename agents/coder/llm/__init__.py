"""The LLM coder: the request, the reply's parsing, the checks a patch passes, and the patch turn."""
