"""Script mode's launch line: `python train.py --x=1` read as argv, never through a shell (parent side, pure).

A launch line is what the repository's authors type: an interpreter, the script (or ``-m module``)
and its arguments. TrainBridge runs it as an argument list, so shell syntax (``&&``, ``|``, ``;``,
redirections, ``$VAR``, backticks, ``VAR=value`` prefixes) cannot mean what it means in a shell and
is refused with a message saying what to do instead. ``torchrun`` lines parse; one process
(``--nproc_per_node=1``) runs with the environment torchrun would give it (`single_torchrun_env`);
several on one node (``--nproc_per_node 2``, ``--nproc-per-node=2``, with or without ``--standalone``)
run as a group of ranks (sandbox/child/rank_supervisor.py), each with torchrun's environment (`torchrun_env`);
several nodes are refused (`LaunchSpec.launch_problem`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field

PYTHON_NAMES = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
TORCHRUN_NAMES = ("torchrun",)
SHELL_OPERATORS = ("&&", "||", "|", ";", ">", "<", "&", "(", ")")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
MAX_RANKS = 8  # ranks of one group on one machine
_PYTHON_FLAGS_WITHOUT_VALUE = {"-u", "-O", "-OO", "-B", "-s", "-S", "-E", "-I", "-q", "-b", "-bb", "-v"}


class LaunchError(ValueError):
    """A launch line TrainBridge cannot run as an argument list; the message says what to write instead."""


@dataclass(frozen=True)
class LaunchSpec:
    """A parsed launch line: run `script` (a path relative to the repository root) or `module`, with `args`."""

    line: str
    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    interpreter_flags: list[str] = field(default_factory=list)
    launcher: str = "python"  # or "torchrun" (one process with its environment, or a group of ranks: `nproc`)
    launcher_args: list[str] = field(default_factory=list)

    @property
    def multi_process(self) -> bool:
        """More than one process: a torchrun line with --nproc_per_node above 1 or several nodes.
        `torchrun --standalone --nproc_per_node=1 train.py` is one process, with torchrun's environment."""
        if self.launcher == "python":
            return False
        options = torchrun_options(self.launcher_args)
        return options.get("nproc_per_node", "1") != "1" or options.get("nnodes", "1") not in ("1", "1:1")

    @property
    def nproc(self) -> int:
        """How many ranks run on this node (1 for python lines and torchrun's default); 0 when the line's value is not
        a number of processes (`launch_problem` says so)."""
        if self.launcher == "python":
            return 1
        value = torchrun_options(self.launcher_args).get("nproc_per_node", "1")
        return int(value) if value.isdigit() else 0

    def launch_problem(self) -> str | None:
        """Why this line cannot run as a group of ranks on this machine (None: it can)."""
        if self.launcher == "python":
            return None
        target = self.script or "-m " + (self.module or "")
        options = torchrun_options(self.launcher_args)
        if options.get("nnodes", "1") not in ("1", "1:1"):
            return (f"launch line {self.line!r}: several nodes (--nnodes={options['nnodes']}) are not supported in script mode; "
                    f"run the ranks of one node: launch = \"torchrun --standalone --nproc_per_node=2 {target} ...\"")
        if self.nproc < 1:
            return (f"launch line {self.line!r}: --nproc_per_node={options.get('nproc_per_node')!r} is not a number of processes; "
                    f"write it, e.g. launch = \"torchrun --standalone --nproc_per_node=2 {target} ...\" (2 gloo ranks on the CPU)")
        if self.nproc > MAX_RANKS:
            return (f"launch line {self.line!r}: {self.nproc} processes per node; script mode runs at most {MAX_RANKS} ranks on one "
                    f"machine. Lower --nproc_per_node (e.g. 2) and shrink the run with [overrides]")
        return None

    def argv0(self) -> str:
        """What the script sees as sys.argv[0]: its path as written, or the module's name."""
        return self.script if self.script is not None else (self.module or "")

    def to_json(self) -> dict:
        return asdict(self)


def check_shell_syntax(line: str) -> None:
    """Raise LaunchError for syntax only a shell gives meaning to (outside quotes; `$` also inside double quotes)."""
    quote = None
    index = 0
    while index < len(line):
        char = line[index]
        if quote == "'":
            quote = None if char == "'" else quote
        elif char == "\\" and quote != "'":
            index += 2
            continue
        elif quote == '"' and char == '"':
            quote = None
        elif char in "`$" and quote != "'":
            raise LaunchError(f"launch line {line!r}: {char!r} at column {index + 1} is shell syntax (variable or command substitution); "
                              "TrainBridge runs the line as an argument list without a shell. Write the value itself, or set it "
                              "with [overrides] in trainbridge.toml")
        elif quote is None and char in "'\"":
            quote = char
        elif quote is None:
            for operator in SHELL_OPERATORS:
                if line.startswith(operator, index):
                    raise LaunchError(f"launch line {line!r}: {operator!r} at column {index + 1} is shell syntax (chaining, pipes or "
                                      "redirection); TrainBridge runs one program as an argument list. Put the training command "
                                      "alone in launch = \"python train.py ...\" (run preparation steps yourself beforehand)")
        index += 1
    if quote is not None:
        raise LaunchError(f"launch line {line!r}: unclosed {quote} quote")


def parse_launch(line: str) -> LaunchSpec:
    """The launch line as a LaunchSpec; raises LaunchError with what to fix."""
    if not line.strip():
        raise LaunchError('launch line is empty: write the command you train with, e.g. launch = "python train.py"')
    check_shell_syntax(line)
    argv = shlex.split(line)
    if _ENV_ASSIGNMENT.match(argv[0]):
        raise LaunchError(f"launch line {line!r}: {argv[0]!r} sets an environment variable the shell way; the sandbox passes a "
                          "scrubbed environment. Set what the script reads through [overrides] (a module constant or an argument)")
    program = argv[0].rsplit("/", 1)[-1]
    if program in TORCHRUN_NAMES:
        return _torchrun(line, argv)
    if not PYTHON_NAMES.match(argv[0]):
        raise LaunchError(f"launch line {line!r}: script mode runs Python training scripts (`python train.py ...` or "
                          f"`python -m package.train ...`), not {argv[0]!r}; for other programs use command = \"...\" (measure only)")
    return _python(line, argv[1:], launcher="python", launcher_args=[])


def _python(line: str, rest: list[str], *, launcher: str, launcher_args: list[str]) -> LaunchSpec:
    flags: list[str] = []
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        if rest[0] not in _PYTHON_FLAGS_WITHOUT_VALUE:
            raise LaunchError(f"launch line {line!r}: interpreter option {rest[0]!r} is not supported in script mode "
                              "(use `python [-u] train.py ...` or `python -m module ...`)")
        flags.append(rest.pop(0))
    if not rest:
        raise LaunchError(f"launch line {line!r}: no script to run after the interpreter (e.g. `python train.py`)")
    if rest[0] == "-m":
        if len(rest) < 2 or not re.fullmatch(r"[A-Za-z_][\w.]*", rest[1]):
            raise LaunchError(f"launch line {line!r}: `-m` needs a module name, e.g. `python -m mypackage.train`")
        return LaunchSpec(line=line, module=rest[1], args=rest[2:], interpreter_flags=flags, launcher=launcher, launcher_args=launcher_args)
    if not rest[0].endswith(".py"):
        raise LaunchError(f"launch line {line!r}: {rest[0]!r} is not a Python file (script mode runs `python <file>.py ...`)")
    return LaunchSpec(line=line, script=rest[0], args=rest[1:], interpreter_flags=flags, launcher=launcher, launcher_args=launcher_args)


def _torchrun(line: str, argv: list[str]) -> LaunchSpec:
    rest = argv[1:]
    launcher_args = []
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        option = rest.pop(0)
        launcher_args.append(option)
        if "=" not in option and rest and not rest[0].startswith("-") and not rest[0].endswith(".py"):
            launcher_args.append(rest.pop(0))  # `--nproc_per_node 2`
    return _python(line, rest, launcher="torchrun", launcher_args=launcher_args)


def torchrun_options(launcher_args: list[str]) -> dict[str, str]:
    """torchrun's options as name -> value (`--nproc-per-node 2` and `--nproc_per_node=2` alike; a bare flag: "")."""
    options: dict[str, str] = {}
    index = 0
    while index < len(launcher_args):
        arg = launcher_args[index]
        name, _, value = arg.lstrip("-").partition("=")
        if not value and index + 1 < len(launcher_args) and not launcher_args[index + 1].startswith("-"):
            value = launcher_args[index + 1]
            index += 1
        options[name.replace("-", "_")] = value
        index += 1
    return options


def single_torchrun_env(master_port: int) -> dict[str, str]:
    """The environment torchrun gives its one worker (`--standalone --nproc_per_node=1`): a script that reads
    RANK / LOCAL_RANK / WORLD_SIZE and calls init_process_group() runs as rank 0 of a world of 1."""
    return torchrun_env(0, 1, master_port)


def torchrun_env(rank: int, world_size: int, master_port: int) -> dict[str, str]:
    """The environment torchrun gives worker `rank` of `world_size` on one node (`--standalone`): the names
    torch.distributed's env:// rendezvous reads, and the TORCHELASTIC_* ones elastic agents set (no restarts here)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RUN_ID": "trainbridge", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False"}


def rank_threads(threads: int, ranks: int) -> int:
    """Torch threads per rank: the run's threads shared among its ranks (torchrun itself sets OMP_NUM_THREADS=1 for
    several workers), at least one."""
    return max(1, threads // max(1, ranks))
