"""What a Python file says about itself as a training script, read with `ast` (nothing is imported
or run): whether it runs as a script (an ``if __name__ == "__main__"`` block, or loops and calls at
module level), whether it builds an optimizer and calls ``.backward()``, how it takes its settings
(argparse arguments, a nanoGPT-style ``configurator.py`` that turns ``--key=value`` and config files
into module globals, a dataclass of hyperparameters), the constants one could shrink it by, and the
path strings it reads. A minGPT-style config tree (`get_config()` returning `C` with `C.trainer.max_iters = ...`,
sub-trees from `Trainer.get_default_config()`) read from `--trainer.max_iters=...` arguments
(`config.merge_from_args(sys.argv[1:])`) is kept as `config_builders` and `config_args_line`. A script whose loop a library runs (`transformers.Trainer(...).train()`, Lightning's
`Trainer(...).fit(...)`) builds no optimizer and calls no `.backward()` itself: `library_trainer` names the trainer.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

_OPTIMIZER_CALL = re.compile(r"(?:^|\.)(?:[A-Z]\w*Optimizer|AdamW?|SGD|Adagrad|Adadelta|Adamax|NAdam|RAdam|RMSprop|"
                             r"LBFGS|Rprop|SparseAdam|Muon|Lion|Adafactor|LAMB|Shampoo|Sophia)$")
_OPTIMIZER_FACTORIES = ("configure_optimizers", "create_optimizer", "build_optimizer", "make_optimizer",
                        "get_optimizer")
# Packages whose `*Trainer` classes run the training loop (optimizer, backward, step) for the script; accelerate's loops
# are the user's own (`accelerator.backward(loss)` is a .backward() call)
TRAINER_LIBRARIES = ("transformers", "trl", "pytorch_lightning", "lightning", "peft", "sentence_transformers")
_TRAINER_METHODS = ("train", "fit")
_PATH_LIKE = re.compile(r"^(?:\./)?[\w.*-]+(?:/[\w.*-]*)+$|^[\w*-]+\.(?:bin|pkl|pt|pth|npy|npz|txt|json|jsonl|arrow|"
                        r"parquet|model|safetensors|h5|csv|tar|idx)$")
SIZE_NAMES = ("batch_size", "device_batch_size", "micro_batch_size", "total_batch_size", "gradient_accumulation_steps",
              "block_size", "sequence_length", "seq_len", "max_seq_len", "context_length", "n_layer", "num_layers",
              "n_layers", "depth", "n_head", "num_heads", "n_embd", "d_model", "hidden_size", "model_dim", "dim",
              "vocab_size", "max_iters", "num_iterations", "max_steps", "train_steps", "iterations", "eval_iters",
              "eval_interval", "val_steps", "warmup_iters", "epochs", "num_epochs", "compile",
              # a library's own arguments: TrainingArguments(...) of transformers, Lightning's Trainer(...)
              "per_device_train_batch_size", "max_epochs", "num_train_epochs", "limit_train_batches")
# Calls whose size keywords are a library's own settings (`TrainingArguments(max_steps=...)`): shrunk by a call override
LIBRARY_SETTING_CALLS = ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig", "Trainer")


@dataclass(frozen=True)
class SettingHint:
    """A setting of the script one could override to shrink a run: a module-level constant, a field of
    a hyperparameter dataclass, or an argparse option."""

    name: str
    value: str  # the default as written in the source
    kind: str  # "constant" | "dataclass field" | "argparse option" | "call keyword"
    line: int
    key: str = ""  # its [overrides] key: `batch_size`, `Hyperparameters.batch_size`, `--batch-size`, `GPTConfig(n_layer)`

    @property
    def override_key(self) -> str:
        return self.key or self.name


@dataclass
class ScriptFacts:
    """One Python file, as `read_script_facts` found it."""

    path: str  # repo-relative
    main_guard: int | None = None  # line of `if __name__ == "__main__":`
    module_level_code: bool = False  # loops or calls at module level: runs as a script without a guard
    optimizer_lines: list[int] = field(default_factory=list)
    backward_lines: list[int] = field(default_factory=list)
    evaluates: bool = False  # .eval() / torch.no_grad() / inference_mode seen
    uses_argparse: bool = False
    uses_configurator: bool = False  # exec(open("configurator.py").read()) or similar
    configurator_line: int | None = None  # settings are the constants above it (what it may override)
    distributed: bool = False  # init_process_group / RANK in the environment
    needs_torchrun: bool = False  # reads os.environ["RANK"] (or LOCAL_RANK, WORLD_SIZE) with no default: a KeyError without torchrun
    settings: list[SettingHint] = field(default_factory=list)
    path_strings: list[tuple[str, int]] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)  # modules it imports (relative ones with their dots)
    bound: dict[str, list[str]] = field(default_factory=dict)  # a name the imports bind -> the modules it may come from
    called: set[str] = field(default_factory=set)  # the first name of every call (`Trainer(...)`, `engine.train(...)`)
    call_keywords: list[tuple[str, str, str, int]] = field(default_factory=list)  # `GPTConfig(n_layer=12)`: class, keyword, value, line
    only_assignments: bool = False  # a config file: nothing but `name = literal` lines
    library_trainer: str | None = None  # `transformers.Trainer`: a library's trainer runs the loop (built and .train()/.fit() called)
    library_trainer_line: int | None = None
    # functions that build a config tree: "get_config" / "Trainer.get_default_config" -> its assignments to the tree it
    # returns, in order: (attribute path, value source, line, mounted) where mounted is the dotted callee of
    # `C.trainer = Trainer.get_default_config()` (a sub-tree) and None for a value
    config_builders: dict[str, list[tuple[tuple[str, ...], str, int, str | None]]] = field(default_factory=dict)
    config_args_line: int | None = None  # line of `config.merge_from_args(sys.argv[1:])`: --a.b=value arguments
    # optimizers built only under `if args.use_optimizer:`: the attribute tested -> the optimizer's line (word-level
    # language model examples update parameters by hand unless a flag turns the optimizer on)
    optimizer_flags: dict[str, int] = field(default_factory=dict)
    beside_file: set[str] = field(default_factory=set)  # path strings joined to the script's own folder (`__file__`)
    _trainer_calls: list[tuple[str, int]] = field(default_factory=list, repr=False)  # (dotted name, line) of `*Trainer(...)` calls
    _methods_called: set[str] = field(default_factory=set, repr=False)  # `x.train()`: "train"
    syntax_error: str | None = None

    @property
    def runs_as_script(self) -> bool:
        return self.main_guard is not None or self.module_level_code

    @property
    def trains(self) -> bool:
        """Runs as a script, builds an optimizer and calls `.backward()`."""
        return self.runs_as_script and bool(self.optimizer_lines) and bool(self.backward_lines)

    def why_not_training(self) -> str:
        """For a file that runs as a script but is no training script: what is missing."""
        missing = [what for what, seen in (("builds no optimizer", self.optimizer_lines),
                                           ("never calls .backward()", self.backward_lines)) if not seen]
        extra = " (it only evaluates)" if self.evaluates and not self.backward_lines else ""
        return " and ".join(missing) + extra


def read_script_facts(root: Path, rel: str) -> ScriptFacts:
    """Facts of the file `root/rel`; a file that does not parse gets `syntax_error` and nothing else."""
    facts = ScriptFacts(path=rel)
    try:
        tree = ast.parse((root / rel).read_text(encoding="utf-8", errors="replace"), rel)
    except (SyntaxError, ValueError) as exc:
        facts.syntax_error = f"{rel}:{getattr(exc, 'lineno', '?')}: {exc.msg if isinstance(exc, SyntaxError) else exc}"
        return facts
    facts.only_assignments = bool(tree.body) and all(_is_literal_assignment(node) or _is_docstring(node)
                                                     for node in tree.body)
    for node in tree.body:
        if _is_main_guard(node):
            facts.main_guard = node.lineno
        elif isinstance(node, (ast.For, ast.While, ast.With)) or (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            facts.module_level_code = True
        _module_setting(node, facts)
    required_read = defaulted = False  # os.environ["RANK"] read; RANK read with a default or tested for first
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func).endswith("environ.get") and node.args \
                and _const(node.args[0]) in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            defaulted = True  # nanoGPT: `int(os.environ.get("RANK", -1)) != -1`, then os.environ["RANK"] under that test
        if isinstance(node, ast.Call):
            _read_call(node, facts)
        elif isinstance(node, ast.Import):
            facts.imports += [alias.name for alias in node.names]
            for alias in node.names:
                facts.bound[alias.asname or alias.name.split(".")[0]] = [alias.name]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            facts.imports.append(base)
            if node.module is None or node.level:  # `from . import engine`: the names may be modules
                facts.imports += [f"{base}{'' if base.endswith('.') else '.'}{alias.name}" for alias in node.names]
            for alias in node.names:  # `from mingpt.trainer import Trainer`, or `from mingpt import trainer` (a module)
                facts.bound[alias.asname or alias.name] = [base, f"{base}{'' if base.endswith('.') else '.'}{alias.name}"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _PATH_LIKE.match(node.value):
            facts.path_strings.append((node.value, node.lineno))
        elif isinstance(node, ast.ClassDef) and any(_decorator_name(d) == "dataclass" for d in node.decorator_list):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    facts.settings.append(SettingHint(item.target.id, ast.unparse(item.value), "dataclass field",
                                                      item.lineno, key=f"{node.name}.{item.target.id}"))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and _const(node.slice) in ("RANK", "LOCAL_RANK",
                                                                                                 "WORLD_SIZE"):
            facts.distributed = True
            required_read = required_read or isinstance(node.ctx, ast.Load)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            defaulted = True
    facts.needs_torchrun = required_read and not defaulted
    _find_config_builders(tree, facts)
    _find_optimizer_flags(tree, facts)
    for node in ast.walk(tree):  # os.path.join(os.path.dirname(__file__), "input.txt"), Path(__file__).parent / "x.bin"
        if isinstance(node, (ast.Call, ast.BinOp)) and any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(node)):
            facts.beside_file |= {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    _find_library_trainer(facts)
    if facts.configurator_line is not None:  # constants set after the configurator ran are no settings
        facts.settings = [s for s in facts.settings if s.kind != "constant" or s.line < facts.configurator_line]
    return facts


_CONFIG_ARG_METHODS = ("merge_from_args",)  # minGPT's CfgNode: `--trainer.max_iters=10` arguments into the tree


def _find_config_builders(tree: ast.Module, facts: ScriptFacts) -> None:
    """Functions (module level, or methods of a module-level class) that make a config tree and return it:
    `C = CN()`, then `C.a.b = value` and `C.sub = Other.get_default_config()`, then `return C`."""
    scopes: list[tuple[str, ast.FunctionDef]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            scopes.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            scopes += [(f"{node.name}.{item.name}", item) for item in node.body if isinstance(item, ast.FunctionDef)]
    for name, function in scopes:
        returned = {n.value.id for n in ast.walk(function) if isinstance(n, ast.Return) and isinstance(n.value, ast.Name)}
        made = {t.id for n in function.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and not n.value.args
                and not n.value.keywords for t in n.targets if isinstance(t, ast.Name)}
        root = next(iter(sorted(returned & made)), None)
        if root is None:
            continue
        entries = []
        for node in function.body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            path = _attribute_path(node.targets[0], root)
            if not path:
                continue
            value = node.value
            mounted = _dotted(value.func) if isinstance(value, ast.Call) and not value.args and not value.keywords \
                and _dotted(value.func).rsplit(".", 1)[-1].startswith("get_") else None
            entries.append((path, ast.unparse(value), node.lineno, mounted))
        if entries:
            facts.config_builders[name] = entries
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CONFIG_ARG_METHODS:
            facts.config_args_line = node.lineno
            break


def _find_optimizer_flags(tree: ast.Module, facts: ScriptFacts) -> None:
    """Optimizers built only when an option is set (`if args.use_optimizer: optimizer = torch.optim.AdamW(...)`),
    when no optimizer is built unconditionally."""
    flagged: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Attribute) and isinstance(node.test.value, ast.Name):
            lines = {n.lineno for statement in node.body for n in ast.walk(statement) if isinstance(n, ast.Call)}
            built = sorted(lines & set(facts.optimizer_lines))
            if built:
                flagged.setdefault(node.test.attr, built[0])
    if flagged and set(facts.optimizer_lines) <= {line for line in facts.optimizer_lines if line in flagged.values()
                                                   or _under_flag(tree, line, flagged)}:
        facts.optimizer_flags = flagged


def _under_flag(tree: ast.Module, line: int, flagged: dict[str, int]) -> bool:
    """Whether the call on `line` sits in the body of an `if <name>.<flag>:` of `flagged`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Attribute) and node.test.attr in flagged:
            if any(isinstance(n, ast.Call) and n.lineno == line for statement in node.body for n in ast.walk(statement)):
                return True
    return False


def _attribute_path(node: ast.expr, root: str) -> tuple[str, ...]:
    """`C.trainer.max_iters` with root "C": ("trainer", "max_iters"); () for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return tuple(reversed(parts)) if isinstance(node, ast.Name) and node.id == root and parts else ()


def _find_library_trainer(facts: ScriptFacts) -> None:
    """A `*Trainer` of a training library that the script builds and then runs (`.train()` or `.fit()`)."""
    if not any(method in facts._methods_called for method in _TRAINER_METHODS):
        return
    for name, line in facts._trainer_calls:
        first, _, rest = name.partition(".")
        for module in facts.bound.get(first, []):
            full = f"{module}.{rest}" if rest else module
            if full.split(".", 1)[0] in TRAINER_LIBRARIES and "." in full:
                facts.library_trainer, facts.library_trainer_line = f"{full.split('.', 1)[0]}.{full.rsplit('.', 1)[-1]}", line
                return


def _read_call(node: ast.Call, facts: ScriptFacts) -> None:
    name = _dotted(node.func)
    facts.called.add(name.split(".", 1)[0])
    callee = name.rsplit(".", 1)[-1]
    if callee.endswith("Trainer"):
        facts._trainer_calls.append((name, node.lineno))
    if isinstance(node.func, ast.Attribute):
        facts._methods_called.add(node.func.attr)
    facts.call_keywords += [(callee, k.arg, ast.unparse(k.value), node.lineno) for k in node.keywords
                            if k.arg is not None and isinstance(k.value, ast.Constant) and callee[:1].isupper()]
    if name.endswith(".backward") or name == "backward":
        facts.backward_lines.append(node.lineno)
    elif _OPTIMIZER_CALL.search(name) or name.rsplit(".", 1)[-1] in _OPTIMIZER_FACTORIES:
        facts.optimizer_lines.append(node.lineno)
    elif name.endswith((".eval", "no_grad", "inference_mode")):
        facts.evaluates = True
    elif name in ("argparse.ArgumentParser", "ArgumentParser"):
        facts.uses_argparse = True
    elif name.endswith("add_argument") and node.args and isinstance(_const(node.args[0]), str):
        flag = _const(node.args[0])
        if flag.startswith("--"):
            default = next((ast.unparse(k.value) for k in node.keywords if k.arg == "default"), "")
            facts.settings.append(SettingHint(flag[2:].replace("-", "_"), default, "argparse option", node.lineno, key=flag))
    elif name in ("exec", "runpy.run_path") and "configurator" in ast.unparse(node):
        facts.uses_configurator = True
        facts.configurator_line = min(node.lineno, facts.configurator_line or node.lineno)
    elif name.endswith("init_process_group"):
        facts.distributed = True
    elif name.endswith("path.join") and len(node.args) > 1 and isinstance(_const(node.args[0]), str):
        facts.path_strings.append((_const(node.args[0]).rstrip("/") + "/", node.lineno))  # a folder the path is under


def _module_setting(node: ast.stmt, facts: ScriptFacts) -> None:
    if _is_literal_assignment(node):
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        facts.settings.append(SettingHint(target.id, ast.unparse(node.value), "constant", node.lineno))


def _is_literal_assignment(node: ast.stmt) -> bool:
    if isinstance(node, ast.Assign):
        target, value = (node.targets[0] if len(node.targets) == 1 else None), node.value
    elif isinstance(node, ast.AnnAssign):
        target, value = node.target, node.value
    else:
        return False
    return isinstance(target, ast.Name) and value is not None and _literal(value)


def _literal(value: ast.expr) -> bool:
    """A number, string, bool or None, or arithmetic of them (`8*64`, `6e-4`, `-1`)."""
    if isinstance(value, ast.Constant):
        return True
    if isinstance(value, ast.UnaryOp):
        return _literal(value.operand)
    if isinstance(value, ast.BinOp):
        return _literal(value.left) and _literal(value.right)
    return False


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(_const(s) == "__main__" for s in sides)


def _is_environ(node: ast.expr) -> bool:
    return _dotted(node).endswith("environ")


def _decorator_name(node: ast.expr) -> str:
    return _dotted(node.func if isinstance(node, ast.Call) else node).rsplit(".", 1)[-1]


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return ""


def _const(node: ast.expr):
    return node.value if isinstance(node, ast.Constant) else None


_IMPORTS_TORCH_NPU = re.compile(r"^\s*(import\s+torch_npu\b|from\s+torch_npu\b)", re.MULTILINE)
_SKIPPED_DIRS = frozenset({".git", "__pycache__", "site-packages", "node_modules", ".venv", "venv"})
SCANNED_FILES = 2000  # Python files read at most, looking for `import torch_npu`


def imports_torch_npu(root: Path) -> bool:
    """Whether some Python file under `root` imports torch_npu (a program written or ported for Ascend). Hidden and
    environment folders are not descended into; at most `SCANNED_FILES` files, the first 1 MiB of each."""
    seen = 0
    for path in sorted(Path(root).rglob("*.py")):
        if any(part in _SKIPPED_DIRS or part.startswith(".") for part in path.relative_to(root).parts[:-1]):
            continue
        seen += 1
        if seen > SCANNED_FILES:
            return False
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                if _IMPORTS_TORCH_NPU.search(handle.read(1 << 20)):
                    return True
        except OSError:
            continue
    return False


def module_file(root: Path, importer: str, module: str) -> str | None:
    """The repo-relative file of `module` as imported by `importer` (from its folder or the root)."""
    level = len(module) - len(module.lstrip("."))
    parts = [p for p in module.lstrip(".").split(".") if p]
    bases = [(root / importer).parents[level - 1]] if level else [(root / importer).parent, root]
    for base in bases:
        for path in (base.joinpath(*parts).with_suffix(".py") if parts else None, base.joinpath(*parts, "__init__.py")):
            if path is not None and path.is_file() and path.resolve().is_relative_to(root):
                return path.resolve().relative_to(root).as_posix()
    return None
