"""NPU kernels per step over the bundled examples (issue 25, item 4): `trainbridge run --target npu` as a user runs it.

Without an NPU, speed is unmeasured, but how many kernels a training step launches on the device is countable
(sandbox/npu_emulation/torch_npu/_kernel_count.py): every ATen op that reaches the emulated device below autograd
(forward, backward, optimizer), views and host copies excluded, a fused torch_npu API one kernel each way. For
each example this runs what a user runs, on a git copy (never the example itself): `trainbridge run <copy>
--target npu` with the default compile reference (Inductor on the host CPU), which ports the program, judges
each candidate's numerics on the emulated device and stacks the verified ones on `<run branch>.pending-npu`. From
the run's final state it reads the original's kernels per step, the pending head's, what torch.compile's
reference runs the model's forward and backward in, every verdict, the torch_npu APIs on the pending branch and
the candidates that crashed.

    .venv/bin/python benchmarks/npu_kernels.py                                  # the four examples, ~25 min here
    .venv/bin/python benchmarks/npu_kernels.py --examples llama_pretrain --max-candidates 12

Writes benchmarks/results/<date>-npu-kernels.json and .md (--out to choose). NPU speed is unmeasured here; the
kernel counts are the emulated device's, not a profiler's (on an NPU host the profiler counts the same launches).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loop_cost import git_copy, run_loop  # noqa: E402

from trainbridge.tools.report.npu_kernels import baseline_kernels, pending_head_kernels  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("llama_pretrain", "gpt2_pretrain", "resnet_classify", "clip_pretrain")
# the fused APIs a pending diff may add: torch_npu.npu_* calls and torch_npu's fused optimizers
_API = re.compile(r"\b(npu_[a-z0-9_]+|NpuFused[A-Za-z]+)\b")


def pending_apis(repo: Path, run_branch: str) -> list[str]:
    """The fused torch_npu APIs the pending branch adds to the run branch (sorted, each once)."""
    pending = f"{run_branch}.pending-npu"
    done = subprocess.run(["git", "diff", f"{run_branch}...{pending}"], cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        return []
    found = set()
    for line in done.stdout.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            found.update(m.group(1) for m in _API.finditer(line))
    return sorted(found)


def summarise(name: str, run: dict[str, Any], repo: Path) -> dict[str, Any]:
    state = run["state"] or {}
    verdicts = state.get("verdicts") or []
    before = baseline_kernels(state)
    pending = pending_head_kernels(state)
    after = pending[0] if pending else before
    reference = state.get("reference_kernels") or {}
    return {
        "example": name,
        "exit_code": run["exit_code"],
        "wall_s": round(run["wall_s"], 1),
        "npu_kernels_per_step_before": before,
        "npu_kernels_per_step_after": after,
        "change": round(after / before - 1, 4) if before and after is not None else None,
        "reference_kernels": reference,
        "pending_numerics_ok": sum(1 for v in verdicts if v.get("reason") == "speed_unmeasured_numerics_ok"),
        "pending_apis": pending_apis(repo, state["run_branch"]) if state.get("run_branch") else [],
        "crashed": sum(1 for v in verdicts if v.get("reason") == "crashed"),
        "verdicts": [{"recipe": v.get("recipe_id"), "category": v.get("category"), "reason": v.get("reason"),
                      "device_kernels": (v.get("gate") or {}).get("device_kernels")} for v in verdicts],
        "output_tail": run.get("output_tail") or [],
    }


def markdown(results: list[dict[str, Any]], argv: list[str], date: str) -> str:
    lines = [f"# NPU kernels per step, `trainbridge run --target npu` on the bundled examples ({date})", "",
             f"Command: `.venv/bin/python benchmarks/npu_kernels.py {' '.join(argv)}`".rstrip() + " (2-core CPU host, no NPU).", "",
             "Kernels per step are counted on the emulated npu device (forward, backward and optimizer; views and host "
             "copies launch none; a fused torch_npu API is one kernel each way). **NPU speed is unmeasured here.** "
             "The reference column is what torch.compile (Inductor, on the host CPU) runs the model's forward and "
             "backward in, the optimizer not included.", "",
             "| example | kernels/step before | pending head | change | reference fwd + bwd | numerics-verified pending | "
             "torch_npu APIs on the pending branch | crashed | wall |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        ref = r["reference_kernels"]
        reference = f"{ref.get('forward', 0)} + {ref.get('backward', 0)}" if ref else "n/a"
        change = f"{r['change'] * 100:+.0f}%" if r["change"] is not None else "n/a"
        lines.append(f"| {r['example']} | {r['npu_kernels_per_step_before']} | {r['npu_kernels_per_step_after']} | {change} | "
                     f"{reference} | "
                     f"{r['pending_numerics_ok']} | {', '.join(r['pending_apis']) or '-'} | {r['crashed']} | {r['wall_s']:.0f} s |")
    lines += ["", "Every verdict per example:", ""]
    for r in results:
        lines.append(f"- **{r['example']}**: " + "; ".join(
            f"{v['recipe']} {v['reason']}" + (f" ({v['device_kernels']['baseline']} \u2192 {v['device_kernels']['candidate']})"
                                              if v.get("device_kernels") else "") for v in r["verdicts"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated examples (default: all four)")
    parser.add_argument("--budget", type=float, default=1800, help="each run's --budget in seconds (default 1800)")
    parser.add_argument("--max-candidates", type=int, default=16, help="each run's --max-candidates (default 16)")
    parser.add_argument("--out", type=Path, default=None, help="results path without suffix "
                        "(default benchmarks/results/<date>-npu-kernels)")
    args = parser.parse_args(argv)
    date = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"{date}-npu-kernels"
    results = []
    with tempfile.TemporaryDirectory(prefix="trainbridge-npu-kernels-") as tmp:
        for name in [e.strip() for e in args.examples.split(",") if e.strip()]:
            if name not in EXAMPLES:
                parser.error(f"unknown example {name!r}: choose from {', '.join(EXAMPLES)}")
            print(f"{name}: trainbridge run --target npu", flush=True)
            repo = git_copy(ROOT / "examples" / name, Path(tmp) / name)
            run = run_loop(repo, f"npu-kernels-{name.replace('_', '-')}", Path(tmp) / "home", budget_s=args.budget,
                           max_candidates=args.max_candidates, gate_rounds=6, target="npu")
            results.append(summarise(name, run, repo))
            r = results[-1]
            print(f"{name}: {r['npu_kernels_per_step_before']} -> {r['npu_kernels_per_step_after']} kernels per step, "
                  f"{r['pending_numerics_ok']} pending, {r['crashed']} crashed, {r['wall_s']:.0f} s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"date": date, "argv": argv, "results": results}, indent=2), encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(results, argv, date), encoding="utf-8")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
