"""Where a record's NPU kernels per step go (issue 28): one Modded-NanoGPT record, ported (`trainbridge port --to npu`)
and measured on the emulated npu (`trainbridge measure <port> -b npu`) with every kernel the emulated device
counts (sandbox/npu_emulation/torch_npu/_kernel_count.py) tallied by the step's phase (forward, backward,
optimizer) and by ATen op, or by fused torch_npu API.

    .venv/bin/python benchmarks/record_kernels.py --mirror /work/.mirror/KellerJordan+modded-nanogpt/repo --record 8
    .venv/bin/python benchmarks/record_kernels.py --mirror <dir> --record 8 --patch pending.diff   # a pending head

The tally is made by a few lines added at the end of the port's imports in a scratch copy (never in this
repository): they wrap the counter's `dispatched` and the fused-call guard, and mark the optimizer steps with
torch.optim's global step hooks and the backward with autograd's graph task id. One step in the middle of the
measurement is reported (the steps are alike). Public code is read from the mirror and stays in the scratch copy.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import zlib
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record_repos import build_repo, record_script  # noqa: E402
from records_catalog import BY_NUMBER  # noqa: E402

# added after the ported script's `import torch_npu`: prints its counts by (step, phase, op) after every optimizer
# step (the run's sandbox lets a script write only in its scratch folder, and may leave by os._exit). A step is
# its forward, its backward (autograd's graph task running) and its optimizer steps (torch.optim's global hooks);
# the first forward op after an optimizer step opens the next step.
PROLOGUE = """
import base64 as _tb_b64, json as _tb_json, sys as _tb_sys, zlib as _tb_zlib, torch as _tb_torch
from torch.optim.optimizer import register_optimizer_step_pre_hook as _tb_pre_hook, register_optimizer_step_post_hook as _tb_post_hook
from torch_npu import _kernel_count as _tb_kc
_tb_state = {"phase": "forward", "step": 0, "tally": {}}
def _tb_close_step():
    done = _tb_json.dumps(_tb_state["tally"]).encode()
    print(f"TB_TALLY {_tb_state['step']} " + _tb_b64.b64encode(_tb_zlib.compress(done, 9)).decode(), flush=True)
    _tb_state["tally"] = {}
    _tb_state["step"] += 1
def _tb_note(op):
    if _tb_torch._C._current_graph_task_id() != -1:
        phase = "backward"
    elif _tb_state["phase"] == "optimizer":
        phase = "optimizer"
    else:
        if _tb_state["phase"] == "after_optimizer":
            _tb_close_step()
        phase = _tb_state["phase"] = "forward"
    _tb_state["tally"][phase + "|" + op] = _tb_state["tally"].get(phase + "|" + op, 0) + 1
_tb_dispatched = _tb_kc.dispatched
def _tb_counting(func, crosses_host):
    before = _tb_kc._total
    _tb_dispatched(func, crosses_host)
    if _tb_kc._total != before:
        _tb_note(func.__name__)
_tb_kc.dispatched = _tb_counting
_tb_enter = _tb_kc._Fused.__enter__
def _tb_fused_enter(self):
    before = _tb_kc._total
    out = _tb_enter(self)
    if _tb_kc._total != before:
        _tb_note("fused:" + getattr(_tb_sys._getframe(1).f_locals.get("fn"), "__qualname__", "?"))
    return out
_tb_kc._Fused.__enter__ = _tb_fused_enter
def _tb_pre(opt, args, kwargs):
    _tb_state["phase"] = "optimizer"
def _tb_post(opt, args, kwargs):
    _tb_state["phase"] = "after_optimizer"
_tb_pre_hook(_tb_pre)
_tb_post_hook(_tb_post)
"""


def instrument(script: Path) -> None:
    """Add the counting lines after the script's first `import torch_npu` line."""
    lines = script.read_text(encoding="utf-8").splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.split("#")[0].strip() == "import torch_npu")
    lines.insert(at + 1, PROLOGUE)
    script.write_text("".join(lines), encoding="utf-8")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", *args], cwd=repo, check=True,
                   capture_output=True, text=True)


def breakdown(tallies: dict[int, dict[str, int]]) -> dict[str, object]:
    """A step in the middle of the measurement (each step's kernels: its forward, backward and optimizer steps) by
    phase and op."""
    steps = sorted(tallies)
    step = steps[len(steps) // 2] if steps else 0
    by_phase: Counter[str] = Counter()
    by_op: dict[str, Counter[str]] = {}
    for key, count in tallies.get(step, {}).items():
        phase, op = key.split("|", 1)
        by_phase[phase] += count
        by_op.setdefault(phase, Counter())[op] += count
    return {"step": step, "steps": steps, "total": sum(by_phase.values()), "by_phase": dict(by_phase),
            "by_op": {phase: dict(c.most_common()) for phase, c in by_op.items()}}


def read_tallies(output: str) -> dict[int, dict[str, int]]:
    """The TB_TALLY lines of the measurement's output: step -> its counts."""
    found = {}
    for line in output.splitlines():
        if line.startswith("TB_TALLY "):
            _, step, blob = line.split(" ", 2)
            found[int(step)] = json.loads(zlib.decompress(base64.b64decode(blob)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", type=Path, required=True)
    parser.add_argument("--record", type=int, required=True)
    parser.add_argument("--patch", type=Path, default=None, help="a diff applied to the port first (a pending head)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    source = BY_NUMBER[args.record]
    work = args.work or Path(tempfile.mkdtemp(prefix=f"record-kernels-{args.record}-"))
    repo = build_repo(work / "repo", source, record_script(args.mirror, source))
    env = {**os.environ, "TRAINBRIDGE_HOME": str(work / "home"), "COLUMNS": "160"}
    subprocess.run([sys.executable, "-m", "trainbridge", "port", str(repo), "--to", "npu", "--out", str(work / "npu"),
                    "--report-dir", str(work / "port-report")], check=True, capture_output=True, env=env)
    port = work / "npu"
    if args.patch:
        _git(port, "apply", str(args.patch.resolve()))
    instrument(port / source.script)
    _git(port, "commit", "-qam", "count kernels by phase and op")
    measured = work / "measure.json"
    done = subprocess.run([sys.executable, "-m", "trainbridge", "measure", str(port), "-b", "npu", "--json",
                           str(measured)], env=env, capture_output=True, text=True)
    payload = json.loads(measured.read_text(encoding="utf-8")) if measured.exists() else {}
    output = json.dumps(payload) + done.stdout + done.stderr
    tallies = read_tallies("\n".join(str(payload.get(k) or "") for k in ("stdout_tail", "stderr_tail")) + "\n" +
                           done.stdout)
    if not tallies:
        print(output[-3000:])
        return 1
    result = breakdown(tallies)
    print(f"record {args.record}: step {result['step']} of {result['steps']}: {result['total']} kernels; "
          f"by phase {result['by_phase']}")
    for phase, ops in result["by_op"].items():
        print(f"  {phase}: " + ", ".join(f"{op} {n}" for op, n in list(ops.items())[:25]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
