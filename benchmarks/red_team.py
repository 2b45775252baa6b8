"""Every planted cheat of the red team against the real gate, as a table: class, expected, got, why.

    .venv/bin/python benchmarks/red_team.py                 # all of tests/fixtures/redteam/cheats/
    .venv/bin/python benchmarks/red_team.py --only clock_   # those whose name starts so

Each cheat is the red team's victim (tests/fixtures/redteam/base/) with the cheat's lines appended,
judged by `run_gate` against the unmodified victim (2 rounds). The same cases are asserted in
tests/test_gate_red_team.py; this prints what each got, for the record.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from trainbridge.agents.profiler.gate import run_gate
from trainbridge.sandbox.workload import load_workload

REDTEAM = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "redteam"


def header(text: str, key: str) -> str:
    match = re.search(rf"^# {key}: (.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else "?"


def judge(cheat: Path, rounds: int) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory(prefix="trainbridge-redteam-") as tmp:
        baseline, candidate = Path(tmp) / "baseline", Path(tmp) / "candidate"
        shutil.copytree(REDTEAM / "base", baseline)
        shutil.copytree(REDTEAM / "base", candidate)
        code = cheat.read_text().replace("{MARKER}", str(Path(tmp) / f"marker-{uuid.uuid4().hex}"))
        step = candidate / "step.py"
        step.write_text(step.read_text() + "\n\n# --- planted ---\n" + code, encoding="utf-8")
        started = time.monotonic()
        verdict = run_gate(load_workload(baseline), load_workload(candidate), rounds=rounds, max_rounds=rounds,
                           rng=random.Random(7))
        message = verdict.findings[0].message if verdict.findings else verdict.message
        return verdict.reason.value, message, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="judge only cheats whose file name starts with this")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    cheats = sorted(p for p in (REDTEAM / "cheats").glob("*.py") if p.stem.startswith(args.only))
    if not cheats:
        print(f"no cheat matches {args.only!r} in {REDTEAM / 'cheats'}", file=sys.stderr)
        return 2
    print("| cheat | class | expected | got | what the verdict says |")
    print("|---|---|---|---|---|")
    wrong = 0
    for cheat in cheats:
        text = cheat.read_text()
        expect = header(text, "expect")
        got, message, seconds = judge(cheat, args.rounds)
        ok = got == expect or (expect == "not_accepted" and got in ("not_significant", "slower"))
        wrong += not ok
        shown = message.replace("|", "\\|").replace("\n", " ")
        if len(shown) > 240:
            shown = shown[:237] + "..."
        print(f"| {cheat.stem} | {header(text, 'class')} | {expect} | {got}{'' if ok else ' (UNEXPECTED)'} | {shown} ({seconds:.0f} s) |",
              flush=True)
    print(f"\n{len(cheats) - wrong} of {len(cheats)} cheats got the expected verdict")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
