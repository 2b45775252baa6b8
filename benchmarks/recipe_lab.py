"""The recipe lab, shared by the recipe tests (tests/test_recipes*.py) and benchmarks/recipe_apply_rate.py: the child
that builds a program through its `trainbridge_entry` and records first-step gradients and a loss
trajectory, applying a recipe the way the coder does, running groups of programs (CPU or the NPU
emulation), and the numerics comparison within a recipe's class.

The rewritten program must parse, import and train: the child records the first-step gradients of
`loss_fn` and the losses of a few `train_step` calls, and the parent compares them with the
unmodified program's (same seed, same batches). torch_npu recipes run in a child with the NPU
emulation first on PYTHONPATH and device "npu"; their baseline is the original program on that same
emulated device (as the gate compares head and candidate on the target).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainbridge.agents.coder.semantic_match import apply_semantically, probes
from trainbridge.agents.analyst.static.scan import scan_repo
from trainbridge.knowledge.schema import Recipe, load_recipe_dir
from trainbridge.knowledge.store import SEED_DIR
from trainbridge.records import SourceSpan
from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FIXTURES = ROOT / "tests" / "fixtures"
VARIANTS = FIXTURES / "recipe_variants"
REAL_STYLE = FIXTURES / "real_style" / "runnable"
NPU_REFERENCE = FIXTURES / "npu_reference"
RECIPES: dict[str, Recipe] = {r.id: r for r in load_recipe_dir(SEED_DIR)}
PYTHON = sys.executable

# Gradient agreement required of every 'tolerance' recipe, besides its own rtol/atol (README gate).
MIN_GLOBAL_COSINE = 0.9999
MIN_PARAM_COSINE = 0.999


# ------------------------------------------------------------------------------------------------
# the child: builds programs through their entry, records first-step grads and a loss trajectory

RUNNER = r'''
import contextlib, importlib, io, json, logging, math, os, random, sys, tomllib, traceback
import torch

torch.set_num_threads(1)
spec = json.load(open(sys.argv[1]))
if spec["npu"]:
    import torch_npu  # the emulation (first on PYTHONPATH): registers the npu device

class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.n = 0
    def emit(self, record):
        self.n += 1

def reseed(seed):
    random.seed(seed)
    torch.manual_seed(seed)

def load(program):
    folder = program["dir"]
    sys.path.insert(0, folder)
    entry = tomllib.loads(open(os.path.join(folder, "trainbridge.toml")).read())["entry"]
    module, _, fn = entry.partition(":")
    return getattr(importlib.import_module(module), fn)

def run(program):
    entry = load(program)
    device, seed, steps = spec["device"], program["seed"], program["steps"]
    reseed(seed)
    parts = entry(device, seed)
    model, batch, loss_fn = parts["model"], parts["batch"], parts["loss_fn"]
    reseed(seed)
    model.zero_grad(set_to_none=True)
    with contextlib.redirect_stdout(io.StringIO()):
        first = loss_fn(model, batch(0))
        first.backward()
    grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None}
    torch.save(grads, program["grads"])
    reseed(seed)
    parts = entry(device, seed)
    model, optimizer, batch, train_step = parts["model"], parts["optimizer"], parts["batch"], parts["train_step"]
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    counter = Count()
    root.addHandler(counter)
    out = io.StringIO()
    losses = []
    reseed(seed)
    try:
        for i in range(steps):
            with contextlib.redirect_stdout(out):
                loss = train_step(model, optimizer, batch(i))
            losses.append(float(loss.detach().float().cpu()))
    finally:
        root.removeHandler(counter)
    return {"ok": True, "first_loss": float(first.detach()), "losses": losses, "log_records": counter.n,
            "stdout_lines": len(out.getvalue().splitlines()), "param_names": [n for n, _ in model.named_parameters()]}

results = {}
for program in spec["programs"]:
    before = set(sys.modules)
    try:
        results[program["name"]] = run(program)
    except BaseException as exc:
        results[program["name"]] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc()[-4000:]}
    finally:
        # the next program has its own `train`/`model` modules: forget everything this one imported
        for name in set(sys.modules) - before:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(program["dir"] + os.sep):
                del sys.modules[name]
        if sys.path and sys.path[0] == program["dir"]:
            sys.path.pop(0)
json.dump(results, open(spec["out"], "w"))
'''


# ------------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class Case:
    recipe: str
    program: str  # an example name or a variant folder name
    backend: str  # "cpu" or "npu" (emulated)
    category: str | None = None  # the scanner intent to take spans from ...
    nth: int = 0  # ... the nth intent of that category
    function: str | None = None  # ... or the span of this function ("file.py:Class.method")
    steps: int = 3
    expect: str = "match"  # "match": same numerics; "refused": the engine refuses; "fails": the run fails
    # loudly; "diverges": (a deliberately broken recipe) runs but the numerics check rejects it
    expect_error: str = ""  # for "fails": a regular expression the child's error must match
    mutate: tuple[str, str] | None = None  # (old, new) text replaced in the recipe's replacement (else its define): a broken recipe
    slow: bool = False
    scan_target: str | None = None  # the target the scanner reports for (None: target-independent findings only)

    @property
    def id(self) -> str:
        where = self.category or (self.function or "").split(":")[-1]
        suffix = "" if self.nth == 0 else f"#{self.nth}"
        mutant = "" if self.mutate is None else "~" + re.sub(r"\W+", "_", self.mutate[0]).strip("_")[:24]
        return f"{self.recipe}{mutant}@{self.program}:{where}{suffix}[{self.backend}]"

    def recipe_data(self) -> Recipe:
        recipe = RECIPES[self.recipe]
        if self.mutate is None:
            return recipe
        old, new = self.mutate
        data = recipe.model_dump(mode="json", by_alias=True)
        if old in recipe.replacement:
            return Recipe.model_validate({**data, "replacement": recipe.replacement.replace(old, new)})
        define = str(recipe.match.params.get("define") or "")  # a trap inside the helper the recipe defines
        assert old in define, f"mutation {old!r} not in {recipe.id}'s replacement or define"
        data["match"]["params"]["define"] = define.replace(old, new)
        return Recipe.model_validate(data)


def examples(*cases: Case) -> list[Case]:
    return [Case(**{**c.__dict__, "slow": True}) for c in cases]


def source_dir(program: str) -> Path:
    """A bundled example, a variant (tests/fixtures/recipe_variants) or a runnable real-style program."""
    for folder in (EXAMPLES, VARIANTS, REAL_STYLE):
        if (folder / program).is_dir():
            return folder / program
    raise FileNotFoundError(f"no program {program!r} in {EXAMPLES}, {VARIANTS} or {REAL_STYLE}")


def function_span(root: Path, where: str) -> SourceSpan:
    file, _, qualname = where.partition(":")
    tree = ast.parse((root / file).read_text())
    parts = qualname.split(".")
    nodes = tree.body
    node = None
    for part in parts:
        node = next(n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        nodes = node.body
    return SourceSpan(file=file, line_start=node.lineno, line_end=node.end_lineno, function=qualname)


@dataclass
class Applied:
    folder: Path
    file: str | None = None
    before: str = ""
    after: str = ""
    refusals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def apply_case(case: Case, folder: Path) -> Applied:
    """Apply the case's recipe to the copied program the way the coder does; write the file."""
    recipe = case.recipe_data()
    if case.function:
        spans = [function_span(folder, case.function)]
    else:
        intents = [i for i in scan_repo(folder, target=case.scan_target) if i.category == case.category]
        assert len(intents) > case.nth, f"the scanner reports {len(intents)} {case.category} intent(s) in {case.program}"
        spans = intents[case.nth].spans
    applied = Applied(folder=folder)
    for span in spans:
        path = folder / span.file
        source = path.read_text()
        try:
            edit = apply_recipe(source, recipe, span)
        except CodemodRefused as refused:
            edit, why = apply_semantically(source, span, recipe, root=folder) if probes(recipe) else (None, "")
            if edit is None:  # as the coder does: a recipe matched by behaviour runs the region first
                applied.refusals.append(str(refused) + (f"; by behaviour: {why}" if why else ""))
                continue
            edit.notes.append(why)
        compile(edit.source, str(path), "exec")  # must parse
        path.write_text(edit.source)
        applied.file, applied.before, applied.after, applied.notes = span.file, source, edit.source, edit.notes
        return applied
    return applied


# ------------------------------------------------------------------------------------------------
# running groups of programs (one child per program and backend)


class Lab:
    """Runs the cases' programs, one child per group (a program, a backend, compile recipes apart from the rest), the
    group's unmodified program (its baseline) first in the same child. `result(case)` runs the case's group when it is
    first asked for; after `prefetch(workers)` it also starts the next groups' children, that many at a time."""

    def __init__(self, root: Path, cases: list[Case]):
        self.root, self.cases = root, cases
        self.applied: dict[Case, Applied] = {}
        self.results: dict[tuple[str, str], dict] = {}
        self.baselines: dict[str, dict] = {}
        self.children = 0
        self._jobs: dict[Case, _Job] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._ahead = 0

    def _copy(self, program: str, name: str) -> Path:
        target = self.root / name
        if not target.exists():
            shutil.copytree(source_dir(program), target, ignore=shutil.ignore_patterns("__pycache__"))
        return target

    def _spec(self, programs: list[dict], npu: bool) -> Path:
        """The runner and a numbered spec file for one child (written here, so that children run from threads never
        write a file another one reads)."""
        self.children += 1
        spec_path = self.root / f"spec-{self.children}.json"
        out = spec_path.with_suffix(".out.json")
        spec = {"npu": npu, "device": "npu" if npu else "cpu", "programs": programs, "out": str(out)}
        spec_path.write_text(json.dumps(spec))
        runner = self.root / "runner.py"
        if not runner.exists():
            runner.write_text(RUNNER)
        return spec_path

    def _run(self, programs: list[dict], npu: bool, timeout: float = 900, spec_path: Path | None = None) -> dict:
        spec_path = spec_path or self._spec(programs, npu)
        out = spec_path.with_suffix(".out.json")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"
        if npu:
            selection = NpuSelection(mode="emulated", cause="not_installed", reason="recipe tests", python=PYTHON)
            env = selection_env(selection, env)
        done = subprocess.run([PYTHON, str(self.root / "runner.py"), str(spec_path)], env=env, cwd=self.root,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise AssertionError(f"the runner crashed:\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())

    def _program(self, name: str, folder: Path, steps: int) -> dict:
        return {"name": name, "dir": str(folder), "seed": 0, "steps": steps, "grads": str(self.root / f"{name}.grads.pt")}

    @staticmethod
    def _baseline_key(program: str, steps: int, backend: str) -> str:
        return f"{program}-base-{steps}" + ("" if backend == "cpu" else f"-{backend}")

    def baseline(self, program: str, steps: int, backend: str = "cpu") -> dict:
        """The unmodified program's run (normally from its group's child; in a child of its own otherwise)."""
        key = self._baseline_key(program, steps, backend)
        for job in {id(j): j for j in self._jobs.values() if key in j.bases}.values():
            self._collect(job)
        if key not in self.baselines:
            folder = self._copy(program, key)
            result = self._run([self._program(key, folder, steps)], npu=backend == "npu")[key]
            result["grads_path"] = str(self.root / f"{key}.grads.pt")
            self.baselines[key] = result
        result = self.baselines[key]
        assert result["ok"], f"the unmodified {program} does not run: {result.get('traceback')}"
        return result

    def _group(self, case: Case) -> list[Case]:
        return [c for c in self.cases if c.program == case.program and c.backend == case.backend
                and c.expect != "refused" and c.recipe.startswith("compile-") == case.recipe.startswith("compile-")]

    def _launch(self, case: Case) -> None:
        """Apply the recipes of the case's group and start (with a pool: submit) its child: the baselines the group's
        numerics need first, then every case whose recipe applied."""
        group = self._group(case)
        programs, bases = [], []
        try:
            for c in group:
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", c.id)
                folder = self._copy(c.program, name)
                self.applied[c] = applied = apply_case(c, folder)
                if applied.file is not None:
                    programs.append(self._program(name, folder, c.steps))
        except Exception as exc:  # noqa: BLE001 (the group's cases fail with it when asked for)
            job = _Job(group=group, bases=[], error=exc)
            for c in group:
                self._jobs[c] = job
            return
        if programs:
            for steps in sorted({c.steps for c in group if c.expect in ("match", "diverges")}):
                key = self._baseline_key(case.program, steps, case.backend)
                if key not in self.baselines and not any(key in job.bases for job in self._jobs.values()):
                    bases.append(key)
                    programs.insert(len(bases) - 1, self._program(key, self._copy(case.program, key), steps))
        job = _Job(group=group, bases=bases)
        for c in group:
            self._jobs[c] = job
        if programs:
            spec = self._spec(programs, case.backend == "npu")
            job.run = lambda: self._run(programs, case.backend == "npu", spec_path=spec)
            if self._pool is not None:
                job.future = self._pool.submit(job.run)

    def _collect(self, job: _Job) -> None:
        if job.collected:
            return
        if job.error is not None:
            raise job.error
        job.collected = True
        try:
            job.results = job.future.result() if job.future is not None else job.run() if job.run is not None else {}
        except BaseException:
            for c in job.group:  # the first case asked for fails with the child's error, the others find no result
                self.results[(c.program, c.id)] = None
            raise
        for key in job.bases:
            if key in job.results:
                self.baselines[key] = {**job.results[key], "grads_path": str(self.root / f"{key}.grads.pt")}
        for c in job.group:
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", c.id)
            if name in job.results:
                job.results[name]["grads_path"] = str(self.root / f"{name}.grads.pt")
            self.results[(c.program, c.id)] = job.results.get(name)

    def prefetch(self, workers: int = 2) -> None:
        """From now on, asking for a case's result also applies the recipes of the next groups (in the cases' order) and
        starts their children, `workers` at a time, so that the next group's child runs while this one's is read: the
        children have one thread each and this process mostly waits, so on `workers` cores the groups take about
        1/`workers` of the time. The results are those of running them one by one (each child is its own process)."""
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="recipe-lab")
        self._ahead = max(1, workers)

    def close(self) -> None:
        """Wait for the children started ahead (the ones no case asked for yet are not started)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _launch_ahead(self, case: Case) -> None:
        pending = {id(job) for job in self._jobs.values() if job.future is not None and not job.collected}
        for c in self.cases[self.cases.index(case) + 1:]:
            if len(pending) > self._ahead:  # this case's child and `workers` more
                break
            if c.expect == "refused" or c in self._jobs:
                continue
            self._launch(c)
            if self._jobs[c].future is not None:
                pending.add(id(self._jobs[c]))

    def result(self, case: Case) -> tuple[Applied, dict | None]:
        if case not in self._jobs:
            self._launch(case)
        if self._pool is not None and case in self.cases:
            self._launch_ahead(case)
        self._collect(self._jobs[case])
        return self.applied[case], self.results.get((case.program, case.id))


@dataclass
class _Job:
    """One group's child: its cases, the baselines it runs first, its results (or the future that brings them)."""

    group: list[Case]
    bases: list[str]
    error: Exception | None = None  # applying a recipe of the group failed
    run: Callable[[], dict] | None = None
    future: Future | None = None
    results: dict = field(default_factory=dict)
    collected: bool = False


# ------------------------------------------------------------------------------------------------
# numerics


@dataclass
class Comparison:
    global_cosine: float  # cosine of all first-step gradients, concatenated
    min_param_cosine: float  # worst per-parameter cosine among parameters whose gradient carries signal
    worst_param: str
    noise_params: list[str]  # gradients that are zero up to rounding (e.g. attention key biases): no cosine
    max_abs: float  # max |g - g_ref| over every element of every parameter
    max_ref: float  # max |g_ref|: the largest reference gradient element
    max_loss_rel: float  # max over the first loss and the train_step losses of |l - l_ref| / |l_ref|
    bit_exact: bool

    def line(self) -> str:
        return (f"grad cos {self.global_cosine:.9f} (min param {self.min_param_cosine:.6f} {self.worst_param}), "
                f"grad max-abs {self.max_abs:.2e} (max grad {self.max_ref:.2e}, ratio {self.max_abs / self.max_ref:.2e}), "
                f"loss max rel {self.max_loss_rel:.2e}, bit-exact {self.bit_exact}")


SIGNAL = 1e-4  # a parameter's gradient carries signal when its norm is above SIGNAL x the largest one's


def compare(base: dict, cand: dict) -> Comparison:
    g0 = torch.load(base["grads_path"])
    g1 = torch.load(cand["grads_path"])
    assert set(g0) == set(g1), f"gradients for different parameters: {sorted(set(g0) ^ set(g1))}"
    a = {n: g0[n].double().flatten() for n in g0}
    b = {n: g1[n].double().flatten() for n in g0}
    exact = all(torch.equal(g0[n], g1[n]) for n in g0)
    dots = sum(float(a[n] @ b[n]) for n in a)
    norms = math.sqrt(sum(float(a[n] @ a[n]) for n in a) * sum(float(b[n] @ b[n]) for n in a))
    global_cos = dots / norms if norms > 0 else 0.0
    largest = max(float(a[n].norm()) for n in a)
    min_cos, worst, noise = 1.0, "", []
    for n in a:
        if float(a[n].norm()) <= SIGNAL * largest:
            noise.append(n)
            continue
        denominator = float(a[n].norm()) * float(b[n].norm())
        cos = float(a[n] @ b[n]) / denominator if denominator > 0 else 0.0
        if cos < min_cos:
            min_cos, worst = cos, n
    max_abs = max(float((a[n] - b[n]).abs().max()) for n in a)
    max_ref = max(float(a[n].abs().max()) for n in a)
    losses0, losses1 = [base["first_loss"], *base["losses"]], [cand["first_loss"], *cand["losses"]]
    assert len(losses0) == len(losses1)
    rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(losses0, losses1))
    exact = exact and losses0 == losses1
    return Comparison(global_cos, min_cos, worst, noise, max_abs, max_ref, rel, exact)


def assert_within(recipe: Recipe, c: Comparison) -> None:
    """Exact: bit-identical gradients and losses. Tolerance: cosines (README gate), then
    max |g - g_ref| <= atol + rtol * max |g_ref|, and every loss within loss_rtol."""
    numerics = recipe.numerics
    if numerics.class_ == "exact":
        assert c.bit_exact, f"recipe {recipe.id} is declared exact but {c.line()}"
        return
    assert c.global_cosine >= MIN_GLOBAL_COSINE, c.line()
    assert c.min_param_cosine >= MIN_PARAM_COSINE, c.line()
    bound = numerics.atol + numerics.rtol * c.max_ref
    assert c.max_abs <= bound, f"beyond atol {numerics.atol} + rtol {numerics.rtol} x max grad: {c.line()}"
    assert c.max_loss_rel <= (numerics.loss_rtol or numerics.rtol), f"beyond loss_rtol {numerics.loss_rtol}: {c.line()}"


def params(cases):
    """pytest parameters of cases, slow ones marked."""
    import pytest

    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in cases]
