"""`python -m trainbridge.graph.team.gate_worker JOB.json VERDICT.json`: run one gate (graph/team/gate_jobs.py)
in this process and write its verdict. The parent pins this process to a slot before it starts."""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from trainbridge.graph.team.gate_jobs import GateJob, judge_job

    if len(argv) != 2:
        print("usage: python -m trainbridge.graph.team.gate_worker JOB.json VERDICT.json", file=sys.stderr)
        return 2
    job = GateJob.model_validate_json(Path(argv[0]).read_text(encoding="utf-8"))
    verdict = judge_job(job)
    import json

    target = Path(argv[1])
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(verdict), encoding="utf-8")
    tmp.replace(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
