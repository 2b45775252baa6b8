"""How many of the intents found in real-style code get a rewrite that applies and keeps numerics (issue 13).

Over the team-written runnable real-style programs (tests/fixtures/real_style/runnable/: a speedrun-style
single file, a module-per-file package, a Hugging Face-style decoder), for each target:

1. the static scan's intents for that target;
2. each intent's recipe queue as retrieval builds it: the seed recipes of its category written for the
   target, else (cpu/cuda) the regional-compile last resort; an intent with a non-empty queue "has a
   known rewrite";
3. every recipe of the queue applied the way the coder does (each span of the intent until one applies);
4. every applied candidate trained a few steps against the unmodified program (same seed, same
   batches; first-step gradients and losses compared within the recipe's numerics class, as
   tests/test_recipes.py does), CPU recipes on the CPU, torch_npu recipes on the NPU emulation;
   an intent passes when one of its candidates applies and passes. NPU regional compiles
   (``backend="npu"``) cannot be judged here (no TorchAir): they are counted apart;
5. for every intent whose span lies inside a method, whether the regional-compile rung
   (compile-regional / compile-regional-npu) applies to it.

Prints a markdown table and writes JSON to benchmarks/results/recipe_apply_rate.json.

    .venv/bin/python -m trainbridge.benchmarks.recipe_apply_rate [--targets cpu npu] [--no-compile-numerics]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from trainbridge.agents.analyst.static.scan import scan_repo
from trainbridge.records import Intent
from recipe_lab import REAL_STYLE, RECIPES, Case, Lab, apply_case, assert_within, compare
from trainbridge.tools.codemods import scopes
from trainbridge.tools.codemods.library_patch import fits as library_patch_fits

RESULTS = Path(__file__).resolve().parent / "results"
LAST_RESORT = {"cpu": "compile-regional", "cuda": "compile-regional"}
COMPILE_RUNG = {"cpu": "compile-regional", "cuda": "compile-regional", "npu": "compile-regional-npu"}


@dataclass
class IntentRow:
    program: str
    target: str
    category: str
    spans: list[str]
    nth: int
    queue: list[str]
    in_method: str | None  # Class.method holding the first span, when it is a method
    applied: dict[str, bool] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)
    numerics: dict[str, str] = field(default_factory=dict)  # recipe -> "pass" / "fail: ..." / "unverifiable: ..."
    compile_rung: bool | None = None  # applies to a method intent (None: not in a method)
    compile_rung_refusal: str = ""

    @property
    def has_rewrite(self) -> bool:
        return bool(self.queue)

    @property
    def applies(self) -> bool:
        return any(self.applied.values())

    @property
    def passes(self) -> bool:
        return any(v == "pass" for v in self.numerics.values())

    @property
    def unverifiable_only(self) -> bool:
        """Applies, but only through recipes whose numerics cannot be judged here."""
        return self.applies and not self.passes and bool(self.numerics) and \
            all(v.startswith("unverifiable") or not self.applied.get(r) for r, v in self.numerics.items()) and \
            any(v.startswith("unverifiable") for v in self.numerics.values())


def _queue(intent: Intent, target: str) -> list[str]:
    # as retrieval queues them (agents/retrieval/choose.own_recipes): a library patch only for the library function it
    # replaces, never for the user's own code
    own = [r.id for r in RECIPES.values() if str(r.category) == str(intent.category) and target in {t.value for t in r.targets}
           and (r.match.kind != "library_patch" or library_patch_fits(r, intent.library))]
    if own:
        return own
    last = LAST_RESORT.get(target)
    return [last] if last else []


def _method_of(folder: Path, intent: Intent) -> str | None:
    span = intent.spans[0]
    module = cst.parse_module((folder / span.file).read_text())
    wrapper = MetadataWrapper(module)
    found = scopes.innermost_function(wrapper.module, wrapper.resolve(PositionProvider), span)
    return found.qualname if found is not None and found.is_method else None


def _backend(target: str) -> str:
    return "npu" if target == "npu" else "cpu"


def _case(row: IntentRow, recipe_id: str, target: str) -> Case:
    return Case(recipe_id, row.program, _backend(target), row.category, nth=row.nth, steps=3, scan_target=target)


def survey(programs: list[str], targets: list[str]) -> list[IntentRow]:
    rows = []
    for program in programs:
        folder = REAL_STYLE / program
        for target in targets:
            seen: dict[str, int] = {}
            for intent in scan_repo(folder, target=target):
                category = str(intent.category)
                nth = seen.get(category, 0)
                seen[category] = nth + 1
                rows.append(IntentRow(program, target, category, [str(s) for s in intent.spans], nth,
                                      _queue(intent, target), _method_of(folder, intent)))
    return rows


def apply_all(rows: list[IntentRow], scratch: Path) -> None:
    for k, row in enumerate(rows):
        for recipe_id in row.queue:
            folder = scratch / f"apply-{k}-{recipe_id}"
            shutil.copytree(REAL_STYLE / row.program, folder, ignore=shutil.ignore_patterns("__pycache__"))
            applied = apply_case(_case(row, recipe_id, row.target), folder)
            row.applied[recipe_id] = applied.file is not None
            if applied.file is None:
                row.refusals[recipe_id] = " | ".join(r.splitlines()[0] for r in applied.refusals)[:400]
        if row.in_method is not None:
            rung = COMPILE_RUNG[row.target]
            folder = scratch / f"rung-{k}"
            shutil.copytree(REAL_STYLE / row.program, folder, ignore=shutil.ignore_patterns("__pycache__"))
            applied = apply_case(_case(row, rung, row.target), folder)
            row.compile_rung = applied.file is not None
            row.compile_rung_refusal = "" if row.compile_rung else " | ".join(applied.refusals)[:300]


def check_numerics(rows: list[IntentRow], scratch: Path, compile_numerics: bool) -> None:
    cases: dict[tuple[int, str], Case] = {}
    for k, row in enumerate(rows):
        for recipe_id, ok in row.applied.items():
            if not ok:
                continue
            recipe = RECIPES[recipe_id]
            if recipe.match.kind == "decorate" and row.target == "npu":
                row.numerics[recipe_id] = "unverifiable: torch.compile(backend='npu') needs TorchAir on an NPU host"
                continue
            if recipe.match.kind == "decorate" and not compile_numerics:
                row.numerics[recipe_id] = "unverifiable: skipped (--no-compile-numerics)"
                continue
            cases[(k, recipe_id)] = _case(row, recipe_id, row.target)
    lab = Lab(scratch / "lab", list(cases.values()))
    (scratch / "lab").mkdir()
    for (k, recipe_id), case in cases.items():
        row = rows[k]
        try:
            applied, result = lab.result(case)
        except AssertionError as exc:
            row.numerics[recipe_id] = f"fail: the runner crashed ({str(exc).splitlines()[-1][:200]})"
            continue
        if result is None or not result.get("ok"):
            error = (result or {}).get("error", "did not run")
            row.numerics[recipe_id] = f"fail: {error[:300]}"
            continue
        base = lab.baseline(case.program, case.steps, case.backend)
        if result["param_names"] != base["param_names"]:
            row.numerics[recipe_id] = "fail: the rewrite changed the model's parameters"
            continue
        comparison = compare(base, result)
        try:
            assert_within(RECIPES[recipe_id], comparison)
        except AssertionError as exc:
            row.numerics[recipe_id] = f"fail: {str(exc).splitlines()[0][:300]}"
            continue
        row.numerics[recipe_id] = "pass"


def _rate(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "0/0"


def table(rows: list[IntentRow]) -> tuple[str, dict]:
    lines = ["| program | target | intents | with a known rewrite | applies | applies + numerics pass | "
             "applies, numerics not judged here | in a method | method intents reaching the compile rung |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[IntentRow]] = {}
    for row in rows:
        groups.setdefault((row.program, row.target), []).append(row)
    groups[("**all**", "")] = rows
    summary = {}
    for (program, target), members in groups.items():
        known = [r for r in members if r.has_rewrite]
        methods = [r for r in members if r.in_method is not None]
        figures = {
            "intents": len(members), "with_rewrite": len(known), "applies": sum(r.applies for r in known),
            "passes": sum(r.passes for r in known), "unverifiable": sum(r.unverifiable_only for r in known),
            "in_method": len(methods), "rung": sum(bool(r.compile_rung) for r in methods),
        }
        summary[f"{program}/{target}" if target else "all"] = figures
        lines.append(f"| {program} | {target} | {figures['intents']} | {figures['with_rewrite']} | "
                     f"{_rate(figures['applies'], figures['with_rewrite'])} | {_rate(figures['passes'], figures['with_rewrite'])} | "
                     f"{figures['unverifiable']} | {figures['in_method']} | {_rate(figures['rung'], figures['in_method'])} |")
    all_figures = summary["all"]
    verifiable = all_figures["with_rewrite"] - all_figures["unverifiable"]
    lines += ["", f"Applies and passes numerics: {_rate(all_figures['passes'], all_figures['with_rewrite'])} of the intents "
              f"with a known rewrite; {_rate(all_figures['passes'], verifiable)} of those whose numerics were judged "
              f"here (NPU regional compiles need TorchAir on an NPU host). Method intents reaching the regional-compile rung: "
              f"{_rate(all_figures['rung'], all_figures['in_method'])}."]
    return "\n".join(lines), summary


def details(rows: list[IntentRow]) -> str:
    lines = ["| program | target | intent | spans | method | outcome |", "|---|---|---|---|---|---|"]
    for row in rows:
        if not row.has_rewrite:
            outcome = "no recipe for this target"
        elif row.passes:
            outcome = "pass: " + ", ".join(r for r, v in row.numerics.items() if v == "pass")
        elif row.unverifiable_only:
            why = next(v for v in row.numerics.values() if v.startswith("unverifiable"))
            outcome = "applies (" + ", ".join(r for r, ok in row.applied.items() if ok) + "); " + why
        elif row.applies:
            outcome = "applies, numerics fail: " + "; ".join(f"{r}: {v[6:120]}" for r, v in row.numerics.items())
        else:
            outcome = "refused: " + "; ".join(f"{r}: {v[:140]}" for r, v in row.refusals.items())[:400]
        lines.append(f"| {row.program} | {row.target} | {row.category} | {', '.join(row.spans)} | {row.in_method or ''} | "
                     f"{outcome.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", nargs="*", default=sorted(p.name for p in REAL_STYLE.iterdir() if p.is_dir()))
    parser.add_argument("--targets", nargs="*", default=["cpu", "npu"], choices=["cpu", "cuda", "npu"])
    parser.add_argument("--no-compile-numerics", action="store_true",
                        help="apply CPU regional compiles but skip training them (Inductor compiles take minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=RESULTS / "recipe_apply_rate.json")
    args = parser.parse_args(argv)
    started = time.time()
    rows = survey(args.programs, args.targets)
    with tempfile.TemporaryDirectory(prefix="tb-apply-rate-") as tmp:
        scratch = Path(tmp)
        apply_all(rows, scratch)
        check_numerics(rows, scratch, compile_numerics=not args.no_compile_numerics)
    text, summary = table(rows)
    print(text)
    print()
    print(details(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"programs": args.programs, "targets": args.targets, "compile_numerics": not args.no_compile_numerics,
               "wall_s": round(time.time() - started, 1), "summary": summary,
               "intents": [{**asdict(r), "has_rewrite": r.has_rewrite, "applies": r.applies, "passes": r.passes}
                           for r in rows]}
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"\nwritten {args.out} ({payload['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
