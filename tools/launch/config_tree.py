"""A minGPT-style config tree as settings one can override: `get_config()` returns `C` with
`C.trainer = Trainer.get_default_config()` and `C.trainer.learning_rate = 5e-4`, and the script merges
`--trainer.max_iters=10` arguments into it (`config.merge_from_args(sys.argv[1:])`). The values are followed into the
repository's modules that build the sub-trees. Read from files (tools/launch/script_facts.py), nothing runs.

    config_tree_settings(root, "projects/chargpt/chargpt.py", facts, facts_of)
      -> [("batch_size", "64", "mingpt/trainer.py:24", "--trainer.batch_size"), ...]
"""

from __future__ import annotations

from pathlib import Path

from trainbridge.tools.launch.script_facts import ScriptFacts, module_file


_CONFIG_DEPTH = 4  # sub-trees followed into other builders at most


def config_tree_settings(root: Path, rel: str, script: ScriptFacts, facts_of) -> list[tuple[str, str, str, str]]:
    """The values of a minGPT-style config tree the script reads `--a.b=value` arguments into: what its `get_config()`
    assigns, and what the builders it mounts assign (`C.trainer = Trainer.get_default_config()` of mingpt/trainer.py
    gives `--trainer.max_iters`, `--trainer.batch_size`, ...); a later assignment replaces the mounted default."""
    if script.config_args_line is None:
        return []
    top = [name for name in script.config_builders if "." not in name and name in script.called]
    if not top:
        return []
    found: dict[str, tuple[str, str, str, str]] = {}

    def expand(file: str, facts: ScriptFacts, builder: str, prefix: tuple[str, ...], depth: int) -> None:
        for path, value, line, mounted in facts.config_builders.get(builder, []):
            full = prefix + path
            if mounted:
                located = _builder_file(root, file, facts, mounted, facts_of)
                if located is not None and depth < _CONFIG_DEPTH:
                    expand(*located, full, depth + 1)
                continue
            if value.endswith("()"):  # `C.system = CN()`: an empty sub-tree
                continue
            key = "--" + ".".join(full)
            found.pop(key, None)
            found[key] = (full[-1], value, f"{file}:{line}", key)

    expand(rel, script, "get_config" if "get_config" in top else top[0], (), 0)
    return list(found.values())


def _builder_file(root: Path, file: str, facts: ScriptFacts, mounted: str, facts_of) -> tuple[str, ScriptFacts, str] | None:
    """Where `Trainer.get_default_config` (as `file` calls it) is defined: this file, or a module of the repository
    that binds the name `Trainer` in `file`'s imports. (file, its facts, the builder's name there)."""
    first, _, rest = mounted.partition(".")
    if mounted in facts.config_builders:
        return file, facts, mounted
    for module in facts.bound.get(first, []):
        imported = module_file(root, file, module)
        other = facts_of(imported) if imported else None
        if other is None:
            continue
        for name in (mounted, rest):  # `Trainer.get_default_config` in trainer.py, or `module.get_config` of a module
            if name and name in other.config_builders:
                return imported, other, name
    return None
