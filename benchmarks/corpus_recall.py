"""Score the static analyst on the development corpus of public training code (issue 13).

    python -m trainbridge.benchmarks.corpus_recall CORPUS_DIR [--target npu] [--json OUT] [--details]
    python -m trainbridge.benchmarks.corpus_recall CORPUS_DIR --labels benchmarks/corpus/labels_unseen.yaml --goal-recall 0.95

CORPUS_DIR holds the files named by the labels file (default ``benchmarks/corpus/labels.yaml``, the
development corpus; ``labels_unseen.yaml`` is issue 30's corpus of repositories the team had not
used) under their key ``local``, flat, as
``benchmarks/corpus/materialise.py`` writes them; this script fetches nothing. Every file is
scanned (one scan over all of them, so helpers in one file are seen from another) and each
intent is compared with the labels of its file:

- a ``must`` region is *found* when an intent of its category has a span overlapping it;
- an intent is a *false positive* when none of its spans overlaps a ``must`` or ``may`` region of
  its category in that file.

The table gives per category: must regions, found, recall, predictions (intents), false
positives and their share of the predictions; the last row is the whole corpus. A detector that
raised on a file is listed (the scan goes on without its findings there). Exit status 2 when a
labelled file is missing from CORPUS_DIR.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trainbridge.agents.analyst.static.scan import scan_repo_result
from trainbridge.records import Intent

LABELS = Path(__file__).resolve().parent / "corpus" / "labels.yaml"


@dataclass(frozen=True)
class Region:
    file: str
    category: str
    start: int
    end: int

    def overlaps(self, start: int, end: int) -> bool:
        return self.start <= end and start <= self.end

    def __str__(self) -> str:
        return f"{self.file}:{self.start}" + (f"-{self.end}" if self.end != self.start else "")


@dataclass
class Score:
    must: int = 0
    found: int = 0
    predictions: int = 0
    false_positives: int = 0
    missed: list[str] = field(default_factory=list)
    spurious: list[str] = field(default_factory=list)

    @property
    def recall(self) -> float | None:
        return self.found / self.must if self.must else None

    @property
    def fp_share(self) -> float | None:
        return self.false_positives / self.predictions if self.predictions else None


def parse_span(text: str | int) -> tuple[int, int]:
    """'12-18' -> (12, 18); '7' or 7 -> (7, 7)."""
    start, _, end = str(text).partition("-")
    a, b = int(start), int(end or start)
    if a < 1 or b < a:
        raise ValueError(f"bad span {text!r}: want START-END with 1 <= START <= END")
    return a, b


def load_labels(path: Path = LABELS) -> tuple[list[dict], list[Region], list[Region]]:
    """The labelled files, and their must and may regions."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    files, must, may = data["files"], [], []
    for entry in files:
        for kind, out in (("must", must), ("may", may)):
            for category, spans in (entry.get(kind) or {}).items():
                for span in spans:
                    out.append(Region(entry["local"], category, *parse_span(span)))
    return files, must, may


def scan_result(folder: Path, names: list[str], target: str | None):
    kwargs = {}
    if target is not None and "target" in inspect.signature(scan_repo_result).parameters:
        kwargs["target"] = target
    return scan_repo_result(folder, [folder / n for n in names], on_syntax_error="raise", **kwargs)


def scan(folder: Path, names: list[str], target: str | None) -> list[Intent]:
    return scan_result(folder, names, target).intents


def score(intents: list[Intent], must: list[Region], may: list[Region]) -> dict[str, Score]:
    """Per-category scores and the overall one (key 'overall')."""
    scores: dict[str, Score] = {}

    def of(category: str) -> Score:
        return scores.setdefault(category, Score())

    spans = [(str(i.category), s.file, s.line_start, s.line_end) for i in intents for s in i.spans]
    for region in must:
        s = of(region.category)
        s.must += 1
        if any(c == region.category and f == region.file and region.overlaps(a, b) for c, f, a, b in spans):
            s.found += 1
        else:
            s.missed.append(str(region))
    labelled = must + may
    for intent in intents:
        category = str(intent.category)
        s = of(category)
        s.predictions += 1
        hit = any(
            r.category == category and r.file == span.file and r.overlaps(span.line_start, span.line_end)
            for span in intent.spans
            for r in labelled
        )
        if not hit:
            s.false_positives += 1
            s.spurious.append(f"{intent.spans[0]} ({intent.evidence.notes[0] if intent.evidence.notes else ''})")
    total = Score()
    for s in scores.values():
        total.must += s.must
        total.found += s.found
        total.predictions += s.predictions
        total.false_positives += s.false_positives
    scores = dict(sorted(scores.items()))
    scores["overall"] = total
    return scores


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(scores: dict[str, Score]) -> str:
    rows = [("category", "must", "found", "recall", "predictions", "false pos.", "FP share")]
    for category, s in scores.items():
        rows.append((category, str(s.must), str(s.found), _pct(s.recall), str(s.predictions),
                     str(s.false_positives), _pct(s.fp_share)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def goal_met(scores: dict[str, Score], recall: float = 0.9, fp: float = 0.1, min_must: int = 5) -> bool:
    """Issue 13's bar: overall and in every category with at least ``min_must`` must regions."""
    for category, s in scores.items():
        if category != "overall" and s.must < min_must:
            continue
        if (s.recall or 0.0) < recall or (s.fp_share or 0.0) > fp:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus_dir", type=Path, help="folder holding the labelled files (see benchmarks/corpus/README.md)")
    parser.add_argument("--target", default="npu", help="target backend the scan is run for (default: npu)")
    parser.add_argument("--labels", type=Path, default=LABELS)
    parser.add_argument("--json", type=Path, help="also write the scores as JSON here")
    parser.add_argument("--details", action="store_true", help="list missed must regions and false positives")
    parser.add_argument("--goal-recall", type=float, default=0.9,
                        help="recall the goal asks for, overall and per category with >= 5 must (default 0.9; issue 30: 0.95)")
    args = parser.parse_args(argv)

    files, must, may = load_labels(args.labels)
    names = [f["local"] for f in files]
    missing = [n for n in names if not (args.corpus_dir / n).is_file()]
    if missing:
        print(f"missing from {args.corpus_dir}: {', '.join(missing)}; see benchmarks/corpus/README.md", file=sys.stderr)
        return 2
    result = scan_result(args.corpus_dir.resolve(), names, args.target)
    failures = [f.describe() for f in getattr(result, "detector_failures", [])]
    scores = score(result.intents, must, may)
    met = goal_met(scores, recall=args.goal_recall) and not failures
    print(table(scores))
    print(f"detector failures: {len(failures)}")
    for line in failures:
        print(f"  {line}")
    print(f"goal (recall >= {100 * args.goal_recall:.0f}%, false positives <= 10%, overall and per category with >= 5 must, "
          f"no detector failure): {'met' if met else 'not met'}")
    if args.details:
        for category, s in scores.items():
            for m in s.missed:
                print(f"missed    {category:18s} {m}")
            for m in s.spurious:
                print(f"false pos {category:18s} {m}")
    if args.json:
        payload = {
            "target": args.target,
            "labels": args.labels.name,
            "detector_failures": failures,
            "files": [{k: f[k] for k in ("local", "repo", "path", "commit")} for f in files],
            "scores": {c: {"must": s.must, "found": s.found, "recall": s.recall, "predictions": s.predictions,
                           "false_positives": s.false_positives, "missed": s.missed, "spurious": s.spurious}
                       for c, s in scores.items()},
            "goal_recall": args.goal_recall,
            "goal_met": met,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
