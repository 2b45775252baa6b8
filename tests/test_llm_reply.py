"""Parsing an LLM reply into SEARCH/REPLACE blocks and locating them inside the editable region.

The loopback guard of tests/llm_coder_support.py applies here too.
"""

from __future__ import annotations

import pytest

from trainbridge.agents.coder.llm.reply import PatchRejected, locate, parse_reply
from trainbridge.records import SourceSpan
from trainbridge.tests.llm_coder_support import block, loopback_only, no_global_git_identity  # noqa: F401 (fixtures)


# --- parsing and confinement units ---------------------------------------------------------------------


def test_parse_reply_reads_paths_fences_and_imports():
    reply = ("Two edits:\n\n```python\nsrc/m.py\n<<<<<<< SEARCH\na = 1\n=======\na = 2\n>>>>>>> REPLACE\n```\n"
             "<<<<<<< SEARCH\nb = 1\n=======\n>>>>>>> REPLACE\n"
             "<<<<<<< IMPORTS\nimport torch.nn.functional as F\n\n>>>>>>> IMPORTS\n")
    parsed = parse_reply(reply)
    assert [(b.file, b.search, b.replace) for b in parsed.blocks] == [("src/m.py", ["a = 1"], ["a = 2"]),
                                                                      ("src/m.py", ["b = 1"], [])]
    assert parsed.imports == ["import torch.nn.functional as F"]
    with pytest.raises(PatchRejected, match="exactly one ======="):
        parse_reply("<<<<<<< SEARCH\na\n=======\nb\n=======\nc\n>>>>>>> REPLACE\n")


def test_locate_refuses_ambiguous_and_outside_blocks():
    source = "def f(x):\n    y = x + 1\n    return y\n\n\ndef g(x):\n    y = x + 1\n    return y\n"
    span = SourceSpan(file="m.py", line_start=6, line_end=8)
    blocks = parse_reply(block("    y = x + 1", "    y = x.add(1)", "m.py")).blocks
    with pytest.raises(PatchRejected, match="occurs 2 times"):
        locate(blocks, {"m.py": source}, [span])
    unique = parse_reply(block("def g(x):\n    y = x + 1", "def g(x):\n    y = x.add(1)", "m.py")).blocks
    assert locate(unique, {"m.py": source}, [span])[0].start == 5
    first = parse_reply(block("def f(x):\n    y = x + 1", "def f(x):\n    y = x.add(1)", "m.py")).blocks
    with pytest.raises(PatchRejected, match="lines 1-2, outside the editable region"):
        locate(first, {"m.py": source}, [span])
    numbered = parse_reply(block("    7 |     y = x + 1", "    y = 2", "m.py")).blocks
    with pytest.raises(PatchRejected) as caught:
        locate(numbered, {"m.py": source}, [span])
    assert "line numbers" in caught.value.close[0]
