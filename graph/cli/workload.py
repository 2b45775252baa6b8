"""CLI commands that inspect one workload without the loop: measure, analyze, collect-evidence.

Mounted on the root app by graph/cli/app.py. Nothing here runs at import time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trainbridge.graph.cli.inputs import resolve_repo
from trainbridge.graph.cli.terminal import console
from trainbridge.graph.cli.terminal import error as _error
from trainbridge.knowledge.cli_json import json_option, write_json
from trainbridge.sandbox.backends import BACKENDS
from trainbridge.sandbox.results import RunResult
from trainbridge.sandbox.workload import WorkloadConfigError


def _stdout(json_out: Path | None = None) -> Console:
    """Tables go to stdout, wide enough to read when piped; to stderr when stdout carries the JSON (`--json -`), so
    that stdout holds the JSON and nothing else."""
    if json_out is not None and str(json_out) == "-":
        return Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    return Console(width=None if sys.stdout.isatty() else 200)


def resolve_backend(backend: str | None, root: Path) -> str:
    """The backend asked for (checked), else cpu, or npu for a program that imports torch_npu (a ported one: on the
    CPU it would stop at `import torch_npu`); says on stderr when npu runs on the emulation (no NPU here)."""
    from trainbridge.sandbox.backends import npu_emulated
    from trainbridge.tools.launch.script_facts import imports_torch_npu

    if backend is not None and backend not in BACKENDS:
        raise typer.BadParameter(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}", param_hint="--backend")
    if backend is None:
        backend = "npu" if imports_torch_npu(root) else "cpu"
        if backend == "npu":
            _error("note: the program imports torch_npu: it runs on the npu backend (--backend cpu to override)")
    if backend == "npu" and npu_emulated():
        _error("note: no NPU on this host: the npu backend is the CPU emulation of torch_npu; numerics are real, "
               "step times are not NPU speed (speed unmeasured)")
    return backend


def measure(
    repo: str = typer.Argument(..., help="Repository root with a trainbridge.toml, or a bundled example name such as llama_pretrain."),
    backend: Optional[str] = typer.Option(None, "--backend", "-b", help=f"Device backend: {', '.join(BACKENDS)} (default: cpu, or npu for a program that imports torch_npu; npu without an NPU runs on the emulation, speed unmeasured)."),
    steps: Optional[int] = typer.Option(None, help="Measured steps (default: the repo's trainbridge.toml)."),
    warmup: Optional[int] = typer.Option(None, help="Warm-up steps, not measured (default: trainbridge.toml)."),
    timeout: Optional[float] = typer.Option(None, help="Wall-clock limit in seconds for the whole run."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for the child (default: trainbridge.toml, else 2)."),
    seed: Optional[int] = typer.Option(None, help="Seed for parameters and batches."),
    json_out: Optional[Path] = json_option("full result (every step time, loss and the failure, if any)"),
    launch: Optional[list[str]] = typer.Argument(None, metavar="[-- LAUNCH...]", help="Script mode: the command the repository trains with, after `--` (e.g. `-- python train.py --batch_size=4`); replaces trainbridge.toml's launch/entry/command."),
) -> None:
    """Run a workload's training step in the sandbox and print step-time statistics and losses.

    `trainbridge measure <repo> -- python train.py ...` runs the script unmodified (script mode); without a launch line, trainbridge.toml says how to run a step.
    The step runs in a child process (own process group, memory cap, scrubbed environment, no network where the host allows); times are device-synchronised. Exit code 1 if the run failed.
    """
    from trainbridge.sandbox.backends import availability as backend_availability
    from trainbridge.sandbox.runner import run_workload

    try:
        workload = _workload(repo, launch).with_overrides(steps=steps, warmup_steps=warmup, timeout_s=timeout, threads=threads, seed=seed)
    except WorkloadConfigError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    backend = resolve_backend(backend, workload.root)
    availability = backend_availability(backend)
    if not availability.available and backend != "npu":  # npu without an NPU: the emulation (resolve_backend said so)
        _error(f"backend {backend} is not available: {availability.reason}")
        raise typer.Exit(2)
    with _progress() as progress:
        task = progress.add_task(f"measuring {workload.root.name}", total=workload.config.warmup_steps + workload.config.steps)
        result = run_workload(workload, backend=backend, on_progress=lambda done, total: progress.update(task, completed=done, total=total))
    _print_result(workload.root, result, _stdout(json_out))
    if json_out is not None:
        write_json(json_out, {"repo": str(workload.root), **result.model_dump(mode="json")})
    if not result.ok:
        raise typer.Exit(1)


def analyze(
    repo: str = typer.Argument(..., help="Repository root with a trainbridge.toml, or a bundled example name."),
    backend: Optional[str] = typer.Option(None, "--backend", "-b", help=f"Target backend whose eager step is profiled: {', '.join(BACKENDS)} (default: cpu, or npu for a program that imports torch_npu; npu without an NPU runs on the emulation)."),
    static: bool = typer.Option(False, "--static", help="Source scan only: no code is run, intents are lower-confidence and unestimated."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Evidence pack from `trainbridge collect-evidence` (e.g. made on a GPU machine) instead of compiling here."),
    no_reference: bool = typer.Option(False, "--no-reference", help="Skip the torch.compile reference (faster; K and savings become coarse)."),
    json_out: Optional[Path] = json_option("whole analysis (every intent with all its evidence)"),
    launch: Optional[list[str]] = typer.Argument(None, metavar="[-- LAUNCH...]", help="Script mode: the command the repository trains with, after `--` (e.g. `-- python train.py --batch_size=4`); replaces trainbridge.toml's launch/entry/command."),
) -> None:
    """Find where the eager program is fragmented: ranked intents with their evidence.

    `trainbridge analyze <repo> -- python train.py ...` analyses the script unmodified (script mode), as `run` and `measure` do.

    Profiles the eager step per source line on the target, compiles the same step with torch.compile (Inductor) as the reference (or reads --reference), runs Ascend's advisor rules and a source scan, and aligns them by source line. K vs N: reference kernels vs eager ops on those lines per step. Savings are estimates, never measurements.
    """
    from trainbridge.agents.analyst.analyze import AnalysisError, analyze_repo
    from trainbridge.tools.tables import intents_table

    try:
        workload = _workload(repo, launch)
    except WorkloadConfigError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    if reference is not None and not reference.is_file():
        raise typer.BadParameter(f"{reference} does not exist", param_hint="--reference")
    backend = resolve_backend(backend, workload.root)
    with console.status("analysing") as status:
        try:
            analysis = analyze_repo(workload, backend=backend, static_only=static, reference_pack=reference,
                                    compile_reference=not no_reference,
                                    on_phase=lambda phase: status.update(f"analysing {workload.root.name}: {phase.replace('_', ' ')}"))
        except AnalysisError as exc:
            _error(str(exc))
            raise typer.Exit(1) from None
    _stdout(json_out).print(intents_table(analysis.intents, f"{workload.root.name}: {len(analysis.intents)} intents ({analysis.mode})"))
    phases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in analysis.phase_seconds.items())
    console.print(f"phases: {phases}", soft_wrap=True)
    if analysis.reference_source:
        console.print(f"reference: {analysis.reference_source}", soft_wrap=True, markup=False)
    for note in analysis.notes + [f"skipped {s}" for s in analysis.skipped_files]:
        console.print(f"note: {note}", soft_wrap=True)
    if json_out is not None:
        write_json(json_out, analysis.model_dump(mode="json"))


def collect_evidence(
    repo: str = typer.Argument(..., help="Repository root with a trainbridge.toml, or a bundled example name."),
    out: Path = typer.Option(..., "--out", "-o", help="Evidence pack to write (.tar.gz)."),
    backend: str = typer.Option("cpu", "--backend", "-b", help="Device to compile on: cuda on a GPU machine, else cpu."),
    launch: Optional[list[str]] = typer.Argument(None, metavar="[-- LAUNCH...]", help="Script mode: the command the repository trains with, after `--` (e.g. `-- python train.py --batch_size=4`); replaces trainbridge.toml's launch/entry/command."),
) -> None:
    """Compile the workload's step with torch.compile here and write a portable evidence pack.

    Run it where the reference compiler is best (a GPU machine), copy the pack, and pass it to `trainbridge analyze --reference PACK` or `trainbridge run --reference PACK` on the target host.
    """
    import tempfile

    from trainbridge.sandbox.runner import run_workload
    from trainbridge.tools.evidence_pack import write_pack

    try:
        workload = _workload(repo, launch)
    except WorkloadConfigError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    with tempfile.TemporaryDirectory(prefix="trainbridge-evidence-") as tmp, console.status("compiling the step with torch.compile"):
        evidence_dir = Path(tmp) / "evidence"
        result = run_workload(workload.with_overrides(steps=2, warmup_steps=0), backend=backend, mode="capture",
                              extra_request={"evidence_dir": str(evidence_dir)})
        if result.failure is not None:
            _error(f"capture failed ({result.failure.kind}): {result.failure.message}")
            raise typer.Exit(1)
        trace = evidence_dir / "trace.json"
        write_pack(evidence_dir, out, trace=trace if trace.is_file() else None, repo_root=workload.root, trim=True)
    console.print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")


def _workload(repo: str, launch: list[str] | None):
    """The workload of `repo` (a path or a bundled example), in script mode from the launch line after `--` when one
    is given; WorkloadConfigError when neither says how to run it."""
    from trainbridge.sandbox.workload import load_workload, workload_for_launch

    root = resolve_repo(repo)
    return workload_for_launch(root, launch_line(launch)) if launch else load_workload(root)


def launch_line(argv: list[str]) -> str:
    """The words after `--` as one launch line (quoted where needed, so the parser reads back the same argv)."""
    import shlex

    return shlex.join(argv)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)


def _print_result(root: Path, result: RunResult, out: Console) -> None:
    table = Table(title=f"{root.name} on {result.backend} ({result.threads} threads, seed {result.seed})", show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    if result.step_times_s:
        table.add_row("measured steps", str(len(result.step_times_s)))
        table.add_row("median step", f"{result.median_step_s() * 1000:.1f} ms")
        table.add_row("p10 / p90 step", f"{result.quantile_step_s(0.1) * 1000:.1f} / {result.quantile_step_s(0.9) * 1000:.1f} ms")
    if result.warmup_times_s:
        table.add_row("first (warm-up) step", f"{result.warmup_times_s[0] * 1000:.1f} ms")
    if result.losses:
        table.add_row("loss first -> last", f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    sources = (result.extra.get("script") or {}).get("loss_sources")
    if sources:  # script mode: backward's scalars, GradScaler's unscaled, or the printed loss (sandbox/script/loss.py)
        table.add_row("loss from", ", ".join(f"{name} ({count} steps)" for name, count in sources.items()))
    shown = (result.extra.get("script") or {}).get("data_shown")
    if shown:  # a worktree's run: the checkout's files outside git, shown read-only (sandbox/script/ignored.py)
        table.add_row("shown read-only", ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else ""))
    if result.peak_memory_bytes:
        table.add_row("peak memory", f"{result.peak_memory_bytes / 2**20:.0f} MiB")
    if result.kernels_per_step is not None:  # the emulated NPU counts them (sandbox/device_kernels.py)
        table.add_row("NPU kernels per step", f"{result.kernels_per_step} (counted on the emulated npu)")
    table.add_row("network", "isolated" if result.network_isolated else "not isolated")
    table.add_row("torch", result.versions.get("torch", "?"))
    out.print(table)
    if result.failure is not None:
        _error(f"failed ({result.failure.kind}): {result.failure.message}")
        if result.failure.traceback_tail:
            console.print(result.failure.traceback_tail, markup=False, highlight=False, soft_wrap=True)
    else:
        from trainbridge.sandbox.backends import npu_emulated

        if result.backend == "npu" and npu_emulated():
            kernels = f", {result.kernels_per_step} NPU kernels per step" if result.kernels_per_step is not None else ""
            console.print(f"[green]ok[/]: trained on the emulated npu (no NPU here){kernels}: speed unmeasured")
        else:
            console.print("[green]ok[/]: speed measured on this machine's " + result.backend)
            note = busy_note(result)
            if note:
                console.print(f"note: {note}", soft_wrap=True, markup=False)


NOISY_SPREAD = 1.5  # p90 / p10 of the measured steps past which the figures are called noisy


def busy_note(result: RunResult, load: float | None = None, cores: int | None = None) -> str | None:
    """A word on noisy step times (p90 more than `NOISY_SPREAD` x p10), with the machine's load when it is busy."""
    if len(result.step_times_s) < 3:
        return None
    p10, p90 = result.quantile_step_s(0.1), result.quantile_step_s(0.9)
    if p10 <= 0 or p90 / p10 <= NOISY_SPREAD:
        return None
    load = os.getloadavg()[0] if load is None else load
    cores = (os.cpu_count() or 1) if cores is None else cores
    busy = f"; the machine is busy (load average {load:.1f} on {cores} cores)" if load > cores else ""
    return (f"the step times varied a lot (p90 is {p90 / p10:.1f}x p10){busy}: measure again on a quiet machine, "
            "or with more --steps, before trusting the median")
