"""One door to git: nothing in the package runs git except the runner in tools/git/runner.py.

That runner turns hooks, commit signing, housekeeping and the user's output-shaping config (diff
prefixes, colour, external diff drivers) off, and RunWorkspace adds the trainbridge/ prefix check and
the workspace lock. A git command started anywhere else would bypass all of that. The check reads the
source with `ast`: a list literal whose first item is "git" (an argv for subprocess or GitPython), or
GitPython itself (`import git`), anywhere but the runner fails the test.

Not scanned, and why: tests/ and benchmarks/ play the user (they make the users' repositories the
runs then work on, and read TrainBridge's own checkout); the torch_npu emulation runs no git.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path("tools/git/runner.py")
NOT_SCANNED = {"tests", "benchmarks", "examples", ".venv"}


def git_calls(path: Path) -> list[str]:
    """`file:line what` for every place in `path` that could run git on its own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts and isinstance(node.elts[0], ast.Constant) \
                and node.elts[0].value == "git":
            found.append(f"{path}:{node.lineno} argv starting with 'git'")
        elif isinstance(node, ast.Import) and any(a.name == "git" or a.name.startswith("git.") for a in node.names):
            found.append(f"{path}:{node.lineno} import git (GitPython)")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "git":
            found.append(f"{path}:{node.lineno} from {node.module} import ...")
    return found


def package_files(root: Path = ROOT) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py")) if p.relative_to(root).parts[0] not in NOT_SCANNED]


def test_only_the_runner_runs_git():
    outside = [hit for path in package_files() if path.relative_to(ROOT) != RUNNER for hit in git_calls(path)]
    assert not outside, ("git run around tools/git_runner.run_git (hooks, signing, prefix check, lock bypassed):\n"
                         + "\n".join(outside))


def test_the_runner_is_where_git_runs():
    assert git_calls(ROOT / RUNNER), "the scan finds nothing in the runner itself: it no longer sees git calls"


def test_the_scan_finds_each_way_of_running_git(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import subprocess\nimport git\nfrom git import Repo\n"
                       "subprocess.run(['git', 'update-ref', 'refs/heads/main', 'x'])\n"
                       "for argv in (('git', 'init'),):\n    pass\n", encoding="utf-8")
    kinds = [hit.split(" ", 1)[1] for hit in git_calls(planted)]
    assert sorted(kinds) == ["argv starting with 'git'", "argv starting with 'git'", "from git import ...",
                             "import git (GitPython)"]


def test_importing_the_graph_imports_no_gitpython():
    """GitPython runs `git version` and reads the cwd when imported; the LangGraph server builds the
    graph inside its event loop and answers a blocking call with a 500 (seen on /assistants/.../schemas
    when own_rewrites.py imported the runner at module level). The runner imports it on first use."""
    import subprocess
    import sys

    code = ("import sys, trainbridge.graph.builder, trainbridge.graph.server, trainbridge.tools.git.ops\n"
            "sys.exit('git' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, "importing the graph imported GitPython\n" + done.stderr
