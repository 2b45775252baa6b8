"""The `trainbridge` command line: the root app, with every command mounted from its own module.

    workload.py           measure, analyze, collect-evidence (one workload, no loop)
    init.py               init (find the launch line, write trainbridge.toml)
    loop.py               run, resume, status, rm, review, report, demo, verify
    serve.py              serve (and `run/review --server`)
    knowledge/cli.py      kb ...
    tools/porting/cli.py  port

Each command is a thin layer: it validates input, shows progress, and calls the subsystem that does
the work. The commands import nothing of this module (imports run one way: cli -> commands), and
nothing runs at import time: `main()` builds the app.
"""

from __future__ import annotations

import typer

HELP = ("TrainBridge makes PyTorch training programs fast on Ascend NPUs (and CPUs/GPUs): it compares "
        "the eager program with what torch.compile makes of it, rewrites fragmented regions with fused "
        "APIs on git branches, and keeps only rewrites that a profiler shows faster with unchanged numerics.")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"trainbridge {version('trainbridge')}")
        raise typer.Exit()


def _root(show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                            help="Print the version and exit.")) -> None:
    """TrainBridge: compiler-guided, measurement-gated rewrites of PyTorch training programs."""


def build_app() -> typer.Typer:
    """The root typer app with every command and sub-app mounted."""
    from trainbridge.graph.cli import init, loop, serve, workload
    from trainbridge.knowledge.cli import kb_app
    from trainbridge.tools.porting.cli import port_command

    app = typer.Typer(name="trainbridge", help=HELP, no_args_is_help=True, add_completion=False, rich_markup_mode="rich")
    app.callback()(_root)
    app.command("init")(init.init)
    app.command("measure")(workload.measure)
    app.command("analyze")(workload.analyze)
    app.command("collect-evidence")(workload.collect_evidence)
    app.command("run")(loop.run)
    app.command("resume")(loop.resume)
    app.command("status")(loop.status)
    app.command("rm")(loop.remove)
    app.command("review")(loop.review_cmd)
    app.command("report")(loop.report_cmd)
    app.command("demo")(loop.demo)
    app.command("verify")(loop.verify)
    app.command("serve")(serve.serve)
    app.command("port")(port_command)
    app.add_typer(kb_app, name="kb", help="The rewrite knowledge base: list, show, search, add, import, export, stats.")
    return app


def main() -> None:
    from trainbridge.sandbox.termination import run_terminable

    run_terminable(build_app())  # SIGTERM ends the sandbox children too (sandbox/termination.py)
