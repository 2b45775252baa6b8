"""Find a repository's training script and the line its authors launch it with, for `trainbridge init`.

    found = discover_launch(Path("~/src/nanogpt").expanduser())
    found.best.launch        # "python train.py config/train_shakespeare_char.py"
    found.best.evidence[0]   # README.md:41, markdown code block
    found.settings           # batch_size = 12 (constant, train.py:19), n_layer = 12, ...
    found.data_paths         # ["data/"]: read by the script, ignored by git

Evidence, strongest first: a command in a README's shell code block, in a shell script, in inline
code of a markdown file; then a Python file that runs as a script (an `if __name__ == "__main__"`
block or module-level code), builds an optimizer and calls `.backward()` (itself, or in a module of
the repository it imports, such as an engine.py; or it calls into a module of the repository that does
both, such as a Trainer object whose run() trains; or a library's trainer runs its loop, such as
`transformers.Trainer(...).train()` or Lightning's `Trainer(...).fit(...)`), with no launch line written anywhere. Without CUDA on
the host, a line naming the CPU (`--device=cpu`) goes before the lines of its score. A line only counts when its script is in the repository and trains; a script that
runs but never steps an optimizer (it evaluates, samples, prepares data) is a near miss, reported
with what it lacks. A line written in a subfolder's README (`python main.py` in word_language_model/)
is named from the root and runs from that folder (`workdir`), as does a script that opens a file
found beside it (tools/launch/workdir.py). Lines that cannot run as written rank lower: values to
fill in (`[PATH_TO_DATA]`), `-h`, and lines without the flag that turns on a script's only optimizer
(`--use-optimizer`). `with_best(found, chosen)` re-reads settings and data for a line other than
the best. Everything is read from files (markdown, shell, Python through `ast`): nothing of the
repository runs here.
"""

from __future__ import annotations

import os
import re
import shlex
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from trainbridge.tools.launch.not_inputs import not_an_input
from trainbridge.tools.git.ignore_rules import IgnoreRules
from trainbridge.tools.launch.lines import ParsedLaunch, lines_in_markdown, lines_in_shell, parse_launch
from trainbridge.tools.launch.config_tree import config_tree_settings
from trainbridge.tools.launch.script_facts import (LIBRARY_SETTING_CALLS, SIZE_NAMES, ScriptFacts, SettingHint, module_file,
                                                   read_script_facts)
from trainbridge.tools.launch.workdir import own_folder

_SKIPPED_DIRS = {".git", ".venv", "venv", "env", "node_modules", "__pycache__", "site-packages", "build", "dist",
                 ".tox", ".mypy_cache", ".pytest_cache", "wandb"}
_MAX_DEPTH = 4
_MAX_FILES = 5000
_DATA_SEARCH_LIMIT = 50_000  # files looked at when a bare data name is searched for below the root


class EvidenceKind(StrEnum):
    markdown_block = "markdown code block"
    shell_script = "shell script"
    markdown_inline = "markdown inline code"
    script_only = "training script (no launch line written)"


_KIND_SCORE = {EvidenceKind.markdown_block: 3.0, EvidenceKind.shell_script: 2.5, EvidenceKind.markdown_inline: 2.0,
               EvidenceKind.script_only: 1.0}


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LaunchEvidence(_Record):
    kind: EvidenceKind
    file: str  # repo-relative
    line: int
    text: str  # the command (or the script's first training line) as written

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


class LaunchCandidate(_Record):
    """One way to launch the training: argv as the authors wrote it, and why it was ranked where it is."""

    launch: str  # argv joined for a shell-free `launch = "..."`
    argv: list[str]
    script: str  # repo-relative path of the training script
    torchrun: bool = False
    nproc: int | None = None
    config_files: list[str] = Field(default_factory=list)  # config-file arguments (nanoGPT style)
    env: dict[str, str] = Field(default_factory=dict)  # leading KEY=value assignments of the line
    evidence: list[LaunchEvidence]
    score: float
    reasons: list[str]
    device: str | None = None  # the device the line names (`--device=cpu`: "cpu"; `--device cuda:0`: "cuda"), if any
    workdir: str | None = None  # the folder it runs from (relative to the root) when not the root: see `_own_folder`


class NearMiss(_Record):
    script: str
    reason: str


class Setting(_Record):
    name: str
    value: str
    kind: str
    where: str  # file:line
    key: str = ""  # the [overrides] key that changes it (the name for a constant)


class Discovery(_Record):
    repo: str
    candidates: list[LaunchCandidate]  # best first
    near_misses: list[NearMiss] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)  # launch lines that were not taken, and why
    settings: list[Setting] = Field(default_factory=list)  # of the best candidate's script, sizes first
    data_paths: list[str] = Field(default_factory=list)  # read by the best script, ignored by git
    data_missing: list[str] = Field(default_factory=list)  # bare names it reads that are nowhere on disk yet
    configurable_by: list[str] = Field(default_factory=list)  # how the best script takes settings
    distributed: bool = False  # the best script initialises torch.distributed / reads RANK
    pythonpath: list[str] = Field(default_factory=list)  # import dirs the best script needs besides its own folder

    @property
    def best(self) -> LaunchCandidate | None:
        return self.candidates[0] if self.candidates else None

    def nothing_found(self) -> str:
        """The message for a repository without a training script: where it looked, what came close."""
        lines = [f"no training script found in {self.repo}: looked for launch lines in README/markdown code "
                 "blocks and shell scripts, and for Python files that run as a script, build an optimizer and "
                 "call .backward()."]
        lines += [f"  near miss: {m.script}: {m.reason}" for m in self.near_misses]
        lines += [f"  not taken: {s}" for s in self.skipped]
        lines.append("Write `launch = \"python <your script> ...\"` into trainbridge.toml yourself, or use entry "
                     "mode (`entry = \"module:function\"`, see the README's 'The workload contract').")
        return "\n".join(lines)


def repository_files(root: Path) -> list[str]:
    """Repo-relative POSIX paths of the files worth reading, sorted, skipping environments and caches."""
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(".")
                         and len(rel.parts) < _MAX_DEPTH)
        found += [(rel / name).as_posix() for name in files if name.endswith((".md", ".sh", ".py"))]
        if len(found) > _MAX_FILES:
            break
    return sorted(found, key=lambda p: (p.count("/"), p))


def discover_launch(repo: Path, *, cuda: bool = True) -> Discovery:
    """Ranked launch candidates of the training in `repo` (a folder), with the settings and data
    paths of the best one. `cuda`: whether this host has CUDA; without it a line that names the CPU
    goes before the lines of the same score that do not (a README's GPU line written before its CPU line)."""
    root = Path(repo).resolve()
    files = repository_files(root)
    facts_of = _facts_reader(root)

    def training_of(rel: str) -> str | None:
        """Why `rel` counts as a training script, or None: it builds an optimizer and calls .backward()
        itself, or calls it through a module of the repository it imports (an engine.py's train_one_epoch), or it
        calls into a module of the repository that does both (a Trainer whose run() builds the optimizer)."""
        script_facts = facts_of(rel)
        if script_facts is None or not script_facts.runs_as_script:
            return None
        if script_facts.optimizer_lines and script_facts.backward_lines:
            return f"{rel} builds an optimizer and calls .backward()"
        if script_facts.library_trainer:  # transformers' Trainer, Lightning's: the library steps the optimizer
            return (f"{rel} runs {script_facts.library_trainer} ({rel}:{script_facts.library_trainer_line}), whose loop builds "
                    "the optimizer and calls .backward()")
        if script_facts.optimizer_lines:
            for module in script_facts.imports:
                imported = module_file(root, rel, module)
                helper = facts_of(imported) if imported else None
                if helper is not None and helper.backward_lines:
                    return f"{rel} builds an optimizer; .backward() is called in {imported}:{helper.backward_lines[0]}"
            return None
        return _trainer_of(root, rel, script_facts, facts_of)

    found: dict[tuple[str, ...], LaunchCandidate] = {}
    skipped: list[str] = []
    for rel in files:
        if rel.endswith(".md"):
            lines = lines_in_markdown((root / rel).read_text(encoding="utf-8", errors="replace"))
        elif rel.endswith(".sh"):
            lines = lines_in_shell((root / rel).read_text(encoding="utf-8", errors="replace"))
        else:
            continue
        for number, command, kind in lines:
            parsed = parse_launch(command)
            if parsed is None:
                continue
            script = _resolve_script(root, rel, parsed.script)
            where = f"{rel}:{number}"
            workdir = None
            if script is not None and script != Path(parsed.script).as_posix().removeprefix("./") \
                    and not (root / parsed.script).is_file():  # `python main.py` in word_language_model/README.md
                workdir = Path(rel).parent.as_posix()
                parsed = _from_root(parsed, script)
            if script is None:
                skipped.append(f"{where} `{command}`: {parsed.script} is not in the repository")
                continue
            script_facts = facts_of(script)
            if script_facts is None or training_of(script) is None:
                why = script_facts.syntax_error or script_facts.why_not_training() if script_facts else "unreadable"
                skipped.append(f"{where} `{command}`: {script} {why}")
                continue
            _add(found, parsed, script, LaunchEvidence(kind=EvidenceKind(kind), file=rel, line=number, text=command),
                 root, facts_of, training_of(script), workdir=workdir)

    near: list[NearMiss] = []
    for rel in files:
        if not rel.endswith(".py"):
            continue
        script_facts = facts_of(rel)
        if script_facts is None or not script_facts.runs_as_script:
            continue
        if training_of(rel) is None:
            if Path(rel).name == "configurator.py" and any(facts_of(c.script).uses_configurator for c in found.values()):
                continue  # exec'd by the training script to read its settings, not a program of its own
            near.append(NearMiss(script=rel, reason=f"runs as a script but {script_facts.why_not_training()}"))
        elif not any(c.script == rel for c in found.values()):
            line = script_facts.main_guard or min(script_facts.backward_lines or script_facts.optimizer_lines or [1])
            if script_facts.needs_torchrun:  # `python x.py` would stop at its os.environ["RANK"]
                parsed = ParsedLaunch(argv=["torchrun", "--standalone", "--nproc_per_node=1", rel], script=rel, script_args=[],
                                      torchrun=True, nproc=1, notes=["it reads RANK/WORLD_SIZE from the environment without a "
                                                                     "default: torchrun sets them (one process here)"])
            else:
                flags = _optimizer_switches(script_facts)[:1]  # a script that trains by hand unless told: turn it on
                parsed = ParsedLaunch(argv=["python", rel, *flags], script=rel, script_args=flags,
                                      notes=[f"{flags[0]} turns its optimizer on" for _ in flags])
            _add(found, parsed, rel, LaunchEvidence(kind=EvidenceKind.script_only, file=rel, line=line,
                                                    text=shlex.join(parsed.argv)), root, facts_of, training_of(rel))

    found = {key: _own_folder(root, candidate, facts_of(candidate.script)) for key, candidate in found.items()}
    candidates = sorted(found.values(), key=lambda c: (-c.score, cuda or c.device != "cpu", c.evidence[0].file.count("/"),
                                                       c.evidence[0].file, c.evidence[0].line))
    if not cuda:
        candidates = [_cpu_first(c, candidates) for c in candidates]
    discovery = Discovery(repo=str(root), candidates=candidates, near_misses=near, skipped=skipped)
    if candidates:
        _describe_best(discovery, root, facts_of)
    return discovery


_DEVICE_OPTIONS = ("device", "accelerator", "device_type", "trainer.accelerator")
_CPU_FLAGS = ("--cpu", "--no-cuda", "--no_cuda", "--use_cpu", "--use-cpu")


def line_device(argv: list[str]) -> str | None:
    """The device a launch line names: "cpu" (`--device=cpu`, `--device cpu`, `--accelerator=cpu`, `--no-cuda`),
    "cuda" (`--device=cuda:0`, `--accelerator gpu`), or None when it leaves the choice to the script."""
    for index, word in enumerate(argv):
        if word in _CPU_FLAGS:
            return "cpu"
        name, equals, value = word.partition("=")
        if name.lstrip("-") not in _DEVICE_OPTIONS:
            continue
        if not equals and index + 1 < len(argv):
            value = argv[index + 1]
        value = value.strip("'\"").lower()
        if value.startswith("cpu"):
            return "cpu"
        if value.startswith(("cuda", "gpu")):
            return "cuda"
    return None


def with_best(found: Discovery, chosen: LaunchCandidate) -> Discovery:
    """`found` with `chosen` first and its settings, data paths and import roots read for it (init's choice of a
    line other than the best: `--script`, or the number typed at the prompt)."""
    if found.best is chosen:
        return found
    root = Path(found.repo)
    discovery = Discovery(repo=found.repo, candidates=[chosen, *(c for c in found.candidates if c is not chosen)],
                          near_misses=found.near_misses, skipped=found.skipped)
    _describe_best(discovery, root, _facts_reader(root))
    return discovery


def _facts_reader(root: Path):
    """`facts_of(rel)`: the ScriptFacts of a file of the repository (None when there is none), read once."""
    facts: dict[str, ScriptFacts] = {}

    def facts_of(rel: str) -> ScriptFacts | None:
        if rel not in facts and (root / rel).is_file():
            facts[rel] = read_script_facts(root, rel)
        return facts.get(rel)

    return facts_of


def _cpu_first(candidate: LaunchCandidate, ranked: list[LaunchCandidate]) -> LaunchCandidate:
    """A CPU line, with the reason it goes before the lines of its score (this host has no CUDA)."""
    if candidate.device != "cpu" or not any(c.score == candidate.score and c.device != "cpu" for c in ranked):
        return candidate
    return candidate.model_copy(update={"reasons": [*candidate.reasons, "it names the CPU and this host has no CUDA: first "
                                                    "among the lines of its score"]})


def _import_roots(root: Path, rel: str, script: ScriptFacts) -> list[str]:
    """`["."]` when the script, in a subfolder, imports a package of the repository that only the root makes importable
    (`projects/chargpt/chargpt.py` importing `mingpt`, which its authors install with `pip install -e .`)."""
    folder = (root / rel).parent
    if folder == root:
        return []
    for module in script.imports:
        top = module.split(".")[0]
        if not top or module.startswith("."):
            continue
        if not (folder / top).exists() and not (folder / f"{top}.py").exists() and \
                ((root / top / "__init__.py").is_file() or (root / f"{top}.py").is_file()):
            return ["."]
    return []


def _trainer_of(root: Path, rel: str, script: ScriptFacts, facts_of) -> str | None:
    """Why `rel` trains through a module of the repository it imports and calls into (`Trainer(...).run()` of a
    trainer.py that builds the optimizer and calls .backward()), or None."""
    for name in sorted(script.called & set(script.bound)):
        for module in script.bound[name]:
            imported = module_file(root, rel, module)
            helper = facts_of(imported) if imported else None
            if helper is not None and helper.optimizer_lines and helper.backward_lines:
                return (f"{rel} calls {name} of {imported}, which builds an optimizer ({imported}:{helper.optimizer_lines[0]}) "
                        f"and calls .backward() ({imported}:{helper.backward_lines[0]})")
    return None


def _from_root(parsed: ParsedLaunch, script: str) -> ParsedLaunch:
    """The line with its script named from the repository's root (`python main.py` of word_language_model/README.md:
    `python word_language_model/main.py`), for a launch line that runs from the folder it was written in."""
    argv = list(parsed.argv)
    index = next((i for i, word in enumerate(argv) if word == parsed.script), None)
    if index is not None:
        argv[index] = script
    return ParsedLaunch(argv=argv, script=script, script_args=parsed.script_args, torchrun=parsed.torchrun, nproc=parsed.nproc,
                        module=parsed.module, env=parsed.env, notes=parsed.notes)


def _own_folder(root: Path, candidate: LaunchCandidate, script: ScriptFacts | None) -> LaunchCandidate:
    """The candidate, run from its script's folder when the script is written to run there (`own_folder`). A line
    written in a subfolder's README already runs from there."""
    if candidate.workdir is not None or script is None:
        return candidate
    found = own_folder(root, candidate.script, script)
    if found is None:
        return candidate
    return candidate.model_copy(update={"workdir": found[0], "reasons": [*candidate.reasons, found[1]]})


def _resolve_script(root: Path, source: str, script: str) -> str | None:
    """The script's repo-relative path: from the root, else from the folder of the file naming it."""
    for base in (root, (root / source).parent):
        path = (base / script).resolve()
        if path.is_file() and path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return None


def _add(found: dict[tuple[str, ...], LaunchCandidate], parsed: ParsedLaunch, script: str, evidence: LaunchEvidence,
         root: Path, facts_of, training: str, *, workdir: str | None = None) -> None:
    key = (*parsed.argv, f"workdir={workdir or ''}")
    if key in found:
        held = found[key]
        bonus = 0.5 if len(held.evidence) < 3 else 0.0
        found[key] = held.model_copy(update={"evidence": [*held.evidence, evidence], "score": held.score + bonus,
                                             "reasons": [*held.reasons, f"also in {evidence.where} (+{bonus:g})"]})
        return
    score = _KIND_SCORE[evidence.kind] + 3.0
    reasons = [f"{evidence.kind} at {evidence.where} (+{_KIND_SCORE[evidence.kind]:g})",
               f"{training} (+3)"]
    if workdir:
        reasons.append(f"written in {evidence.file} as `{evidence.text}`: it runs from {workdir}/ (workdir)")
    if Path(script).stem.startswith("train"):
        score += 0.5
        reasons.append("the script is named train* (+0.5)")
    if Path(evidence.file).name.lower().startswith("readme"):
        score += 0.25
        reasons.append("written in a README (+0.25)")
    placeholders = [arg for arg in parsed.script_args if _placeholder(arg)]
    if placeholders:  # `--word-vectors [PATH_TO_WORD_VECTORS]`, `--dist-url tcp://IP_OF_NODE0:FREEPORT`: not runnable as written
        score -= 2.0
        reasons.append(f"it has values to fill in ({', '.join(placeholders[:3])}) (-2)")
    if any(arg in ("-h", "--help") for arg in parsed.script_args):  # `python main.py -h`: prints the options and exits
        score -= 3.0
        reasons.append("it asks for the help text (-h) and exits before training (-3)")
    switches = _optimizer_switches(facts_of(script))
    if switches:  # `if args.use_optimizer: optimizer = ...`: script mode times optimizer steps
        on = [flag for flag in switches if any(arg == flag or arg.startswith(flag + "=") for arg in parsed.script_args)]
        flagged = facts_of(script).optimizer_flags
        where = f"{script}:{min(flagged.values())}"
        if on:
            score += 0.5
            reasons.append(f"it passes {on[0]}, which turns on the optimizer ({where}) (+0.5)")
        else:
            score -= 1.0
            reasons.append(f"without {' or '.join(switches)} it builds no optimizer ({where} is built only then; it updates "
                           "the parameters by hand, and steps are timed from one optimizer step to the next) (-1)")
    configs = [arg for arg in parsed.script_args if arg.endswith(".py")
               and (facts := facts_of(_resolve_script(root, evidence.file, arg) or "")) is not None
               and facts.only_assignments]
    found[key] = LaunchCandidate(launch=shlex.join(parsed.argv), argv=parsed.argv, script=script,
                                 torchrun=parsed.torchrun, nproc=parsed.nproc, config_files=configs, env=parsed.env,
                                 evidence=[evidence], score=score, reasons=reasons + parsed.notes,
                                 device=line_device(parsed.script_args), workdir=workdir)


_PLACEHOLDER = re.compile(r"[\[\]<>]|PATH_TO|\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b|\b(?:FREEPORT|HOSTNAME|YOUR_\w+)\b")


def _placeholder(arg: str) -> bool:
    """An argument a README leaves for the reader to fill in: `[PATH_TO_DATA]`, `<data-dir>`, `--world_size=WORLD_SIZE`."""
    return bool(_PLACEHOLDER.search(arg.partition("=")[2] if arg.startswith("-") else arg))


def _optimizer_switches(script: ScriptFacts | None) -> list[str]:
    """The options (`--use-optimizer`) that turn on an optimizer the script builds only when asked (its argparse
    options whose destination is the attribute an `if args.<x>:` around the optimizer tests)."""
    if script is None or not script.optimizer_flags:
        return []
    return [hint.key for hint in script.settings if hint.kind == "argparse option" and hint.name in script.optimizer_flags
            and hint.key.startswith("--")]


def _describe_best(discovery: Discovery, root: Path, facts_of) -> None:
    best = discovery.candidates[0]
    script = facts_of(best.script)
    sources = [script] + [f for f in (facts_of(_resolve_script(root, best.evidence[0].file, c) or "")
                                      for c in best.config_files) if f is not None]
    settings: dict[str, Setting] = {}
    for facts in sources:  # a config file's value overrides the script's default, as it does at run time
        for hint in facts.settings:
            settings[hint.name] = _setting(hint, facts.path)
    for facts in sources:  # a dataclass field the script passes explicitly, `GPTConfig(n_layer=12)`: only a call override changes it
        for callee, keyword, value, line in facts.call_keywords:
            field_setting = settings.get(keyword)
            if field_setting is not None and field_setting.key == f"{callee}.{keyword}":
                settings[keyword] = Setting(name=keyword, value=value, kind="call keyword", where=f"{facts.path}:{line}",
                                            key=f"{callee}({keyword})")
            elif field_setting is None and callee in LIBRARY_SETTING_CALLS and keyword in SIZE_NAMES:  # TrainingArguments(max_steps=...)
                settings[keyword] = Setting(name=keyword, value=value, kind="call keyword", where=f"{facts.path}:{line}",
                                            key=f"{callee}({keyword})")
    for name, value, where, key in config_tree_settings(root, best.script, script, facts_of):  # `--trainer.max_iters=...`
        settings[key] = Setting(name=name, value=value, kind="config argument", where=where, key=key)
    order = {name: i for i, name in enumerate(SIZE_NAMES)}
    discovery.settings = sorted(settings.values(), key=lambda s: (order.get(s.name, len(order)), s.where))
    how = []
    if script.uses_configurator:
        how.append("configurator.py: --key=value arguments and config files override the module-level constants")
    if script.uses_argparse:
        how.append("argparse options")
    if script.config_args_line is not None and any(s.kind == "config argument" for s in settings.values()):
        how.append(f"--section.key=value arguments into its config tree ({best.script}:{script.config_args_line}: "
                   "\"--trainer.max_iters\" = 10 under [overrides] appends --trainer.max_iters=10)")
    if any(s.kind == "dataclass field" for s in settings.values()):
        how.append("a hyperparameter dataclass (overrides of its defaults)")
    library = sorted({s.key.split("(")[0] for s in settings.values() if s.key.split("(")[0] in LIBRARY_SETTING_CALLS})
    if library:
        how.append(f"a library's own arguments ({', '.join(f'{call}(...)' for call in library)}: call overrides)")
    discovery.configurable_by = how
    discovery.distributed = script.distributed
    discovery.pythonpath = _import_roots(root, best.script, script)
    rules = IgnoreRules.of(root)
    data: list[str] = []
    missing: list[str] = []
    for facts in sources:
        for text, _line in facts.path_strings:
            if best.workdir and not text.startswith(("/", "~")) and ("/" in text.rstrip("/") or
                                                                     os.path.lexists(root / best.workdir / text)):
                text = os.path.normpath(Path(best.workdir, text)) + ("/" if text.endswith("/") else "")  # from its folder
            path = _ignored_root(text, rules)
            if path is None:
                continue
            for found in _located(root, path, rules, missing):
                if found not in data and not_an_input(found) is None:  # out-*/ckpt.pt: what the script writes
                    data.append(found)
    discovery.data_paths = data
    discovery.data_missing = missing


def _setting(hint: SettingHint, path: str) -> Setting:
    return Setting(name=hint.name, value=hint.value, kind=hint.kind, where=f"{path}:{hint.line}", key=hint.override_key)


def _ignored_root(text: str, rules: IgnoreRules) -> str | None:
    """The shortest prefix of the path `text` that git ignores (or a top folder git ignores things
    inside), e.g. `data/` for `data/shakespeare/train.bin`; None for a path git keeps."""
    clean = text.removeprefix("./")
    if clean.startswith(("/", "~", "http:", "https:")) or ".." in clean.split("/"):
        return None
    parts = [p for p in clean.split("/") if p]
    for depth in range(1, len(parts) + 1):
        is_dir = depth < len(parts) or clean.endswith("/")
        prefix = "/".join(parts[:depth])
        if rules.ignored(prefix, is_dir=is_dir):
            return prefix + ("/" if is_dir else "")
    if parts and (len(parts) > 1 or clean.endswith("/")) and rules.ignores_inside(parts[0]):
        return parts[0] + "/"  # e.g. `data/**/*.bin`: the data under the folder is ignored, not the folder
    return None


def _located(root: Path, path: str, rules: IgnoreRules, missing: list[str]) -> list[str]:
    """Where an ignored path the script names lies, relative to the root. A bare name (`train.bin`,
    usually joined to a folder at run time: `os.path.join(data_dir, "train.bin")`) that is not at the
    root is looked for below it: every ignored file of that name, by its path; one found nowhere is
    left out (a data entry that does not exist stops every run) and noted in `missing`."""
    if "/" in path.rstrip("/") or os.path.lexists(root / path):
        return [path]
    hits = [rel for rel in _files_named(root, path.rstrip("/")) if rules.ignored(rel, is_dir=False)]
    if not hits and path not in missing:
        missing.append(path)
    return hits


def _files_named(root: Path, name: str, limit: int = _DATA_SEARCH_LIMIT) -> list[str]:
    """Paths (relative, sorted) of the files called `name` below `root`, hidden and environment folders skipped."""
    hits: list[str] = []
    seen = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS)
        seen += len(files)
        if name in files:
            hits.append(Path(folder, name).relative_to(root).as_posix())
        if seen > limit:
            break
    return sorted(hits)
