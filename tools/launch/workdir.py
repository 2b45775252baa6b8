"""Whether a training script is written to run from its own folder (`trainbridge.toml`'s `workdir`), read from its
files: minGPT's projects/chargpt/chargpt.py opens `open('input.txt')`, the file its user puts beside it. Used by
`trainbridge init` (tools/launch/discovery.py) and by a script-mode run given no workdir (sandbox/script/run.py).
Nothing runs here.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainbridge.tools.launch.not_inputs import not_an_input
from trainbridge.tools.launch.script_facts import ScriptFacts


def own_folder(root: Path, rel: str, script: ScriptFacts) -> tuple[str, str] | None:
    """(its folder, why) when the script `rel`, in a subfolder, is written to run from there: it opens a relative path
    that is beside it and not at the root (minGPT's projects/chargpt/chargpt.py reads `open('input.txt')`, the file the
    user puts beside it), and no path it names is at the root only. Paths joined to `__file__` and outputs do not
    count. `root` is where its files are looked for: the repository, or a run's mirror of it."""
    folder = Path(rel).parent
    if folder == Path("."):
        return None
    beside: tuple[str, int, str] | None = None
    for text, line in script.path_strings:
        if text in script.beside_file:  # found from `__file__`: wherever it runs from
            continue
        clean = text.removeprefix("./").rstrip("/")
        if not clean or clean.startswith(("/", "~")) or ".." in clean.split("/") or not_an_input(clean) is not None:
            continue
        here, there = os.path.lexists(root / folder / clean), os.path.lexists(root / clean)
        if there and not here:  # `data/train.bin` read from the root
            return None
        if here and not there and beside is None:
            beside = (text, line, (folder / clean).as_posix())
    if beside is None:
        return None
    text, line, path = beside
    return folder.as_posix(), (f"it opens {text!r} ({rel}:{line}), which is beside it ({path}) and not at the root: it runs "
                               f"from {folder.as_posix()}/ (workdir)")
