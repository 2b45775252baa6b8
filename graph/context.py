"""Services a run's nodes use (knowledge base, git workspace, progress output), rebuilt per process.

They are not part of the checkpointed state: a resumed run builds them again from `run.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

from trainbridge.graph.state import RunConfig, RunPaths


@dataclass
class RunContext:
    config: RunConfig
    paths: RunPaths
    say: Callable[[str], None] = field(default=lambda message: None)
    llm: object | None = None  # an LLMConfig when an endpoint is configured (read by the entry point); None: recipes only

    @cached_property
    def kb(self):
        from trainbridge.knowledge.store import KnowledgeBase

        kb = KnowledgeBase.connect(self.config.kb_url) if self.config.kb_url else KnowledgeBase(self.config.kb_dir)
        if self.config.extra_recipe_dir:
            kb.load_seeds(self.config.extra_recipe_dir)
        return kb

    @cached_property
    def user_repo(self):
        from trainbridge.tools.git.ops import open_repo

        return open_repo(Path(self.config.repo))

    def workspace(self, base: str = "HEAD"):
        from trainbridge.tools.git.ops import RunWorkspace

        root = Path(self.config.workspace_dir) if self.config.workspace_dir else self.paths.workspace
        return RunWorkspace.create_run(self.user_repo, self.config.run_id, base, workspace_root=root)
