"""Knowledge-base query latency with many recorded outcomes, embedded and on a loopback server.

    .venv/bin/python benchmarks/kb_latency.py                      # 10k and 100k outcomes, both modes
    .venv/bin/python benchmarks/kb_latency.py --sizes 10000 --modes embedded --queries 30

For each mode the knowledge base is filled with synthetic but realistic outcomes (evidence of the
intent categories with their op and kernel names, verdicts, ratios, diffs) and ~100 recipes;
after each size is reached it times `rank_recipes` (the retrieval agent's query) and `search`
(the CLI's), and reports median and p95 latency, how long the inserts took and how long a full JSONL export takes. Prints a markdown
table and writes JSON to benchmarks/results/kb_latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

from trainbridge.agents.retrieval.rank import rank_recipes
from trainbridge.knowledge.schema import Outcome, parse_recipe
from trainbridge.knowledge.store import KnowledgeBase
from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, SourceSpan

RESULTS = Path(__file__).resolve().parent / "results"
CHROMA = Path(sys.executable).parent / "chroma"

# Op vocabulary per category, as eager profiles and Inductor kernel names show them.
OPS: dict[str, list[str]] = {
    "rmsnorm": ["pow", "mean", "add", "rsqrt", "mul", "type_as", "to"],
    "layernorm": ["native_layer_norm", "sub", "mean", "var", "add", "rsqrt", "mul"],
    "add_norm": ["add", "pow", "mean", "rsqrt", "mul", "native_layer_norm"],
    "rope": ["slice", "neg", "cat", "mul", "add", "cos", "sin", "view_as_complex"],
    "swiglu": ["chunk", "silu", "mul", "sigmoid", "linear"],
    "geglu": ["chunk", "gelu", "mul", "linear"],
    "attention": ["matmul", "bmm", "div", "masked_fill", "softmax", "dropout", "transpose"],
    "softmax": ["exp", "sum", "div", "amax", "sub", "softmax"],
    "cross_entropy": ["log_softmax", "nll_loss", "gather", "logsumexp"],
    "gelu": ["mul", "pow", "add", "tanh", "erf", "gelu"],
    "silu": ["sigmoid", "mul", "silu"],
    "elementwise_chain": ["add", "mul", "sub", "div", "exp", "where", "clamp"],
    "optimizer_step": ["mul_", "add_", "lerp_", "addcmul_", "sqrt", "div", "addcdiv_", "_foreach_mul_"],
    "zero_grad": ["zero_", "fill_", "_foreach_zero_"],
    "host_sync": ["item", "_local_scalar_dense", "to", "copy_"],
    "redundant_cast": ["to", "_to_copy", "type_as", "copy_"],
    "permute_reshape": ["permute", "contiguous", "reshape", "view", "transpose", "clone"],
    "conv_layout": ["convolution", "permute", "contiguous", "batch_norm", "relu"],
    "normalize": ["norm", "clamp_min", "div", "expand_as", "linalg_vector_norm"],
    "porting_debt": ["to", "_to_copy", "cpu", "item", "copy_"],
}
CATEGORIES = list(OPS)
assert set(CATEGORIES) <= set(IntentCategory), set(CATEGORIES) - set(IntentCategory)
BACKENDS = ["npu", "npu", "cpu", "cuda"]
VERDICTS = ["numerics mismatch: grad cosine 0.9991", "slower: ratio 1.03", "crash: RuntimeError", "no speedup"]
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def evidence(rng: random.Random, category: str) -> Evidence:
    ops = OPS[category]
    seq = [rng.choice(ops) for _ in range(rng.randint(3, 9))]
    kernel = "cpp_fused_" + "_".join(sorted(set(seq))) + f"_{rng.randint(0, 40)}"
    return Evidence(
        reference_kernels=rng.randint(1, 3),
        target_ops=len(seq) * rng.randint(1, 24),
        target_time_us=rng.uniform(5, 5000),
        kernels=[kernel],
        target_op_names=[f"aten::{op}" for op in seq],
        detectors=["fusion_gap"],
    )


def make_recipes(rng: random.Random, n: int) -> list:
    base = json.loads(
        parse_recipe(
            {
                "id": "x0",
                "title": "t",
                "category": "gelu",
                "targets": ["cpu"],
                "match": {"kind": "op_sequence", "params": {"regex": "a"}},
                "replacement": "f()",
                "numerics": {"class": "tolerance", "rtol": 1e-3, "atol": 1e-5},
                "provenance": {"kind": "learned"},
            }
        ).model_dump_json()
    )
    recipes = []
    for i in range(n):
        cat = CATEGORIES[i % len(CATEGORIES)]
        ops = rng.sample(OPS[cat], k=min(4, len(OPS[cat])))
        data = dict(base, id=f"bench-{cat}-{i}", title=f"{cat} rewrite {i}", category=cat,
                    targets=rng.choice([["npu"], ["cpu", "cuda"], ["cpu", "cuda", "npu"]]),
                    keywords=ops, match={"kind": "op_sequence", "params": {"regex": "-".join(ops)}},
                    replacement=f"fused_{cat}_{i}(x)")
        recipes.append(parse_recipe(data))
    return recipes


def make_outcomes(rng: random.Random, recipe_ids: dict[str, list[str]], start: int, n: int) -> list[Outcome]:
    outs = []
    for i in range(start, start + n):
        cat = rng.choice(CATEGORIES)
        accepted = rng.random() < 0.35
        ratio = rng.uniform(0.6, 0.99) if accepted else rng.choice([None, rng.uniform(1.0, 1.2)])
        outs.append(
            Outcome(
                run_id=f"run-{i // 500}",
                intent_id=f"{cat}-{i:07d}",
                category=cat,
                evidence=evidence(rng, cat),
                recipe_id=rng.choice(recipe_ids[cat]) if rng.random() < 0.9 else None,
                diff=f"--- a/model.py\n+++ b/model.py\n@@ -{i % 300} +{i % 300} @@\n-    y = slow(x)\n+    y = fast(x)\n",
                verdict="accepted" if accepted else rng.choice(VERDICTS),
                ratio=ratio,
                ratio_ci=(ratio * 0.98, ratio * 1.02) if ratio else None,
                backend=rng.choice(BACKENDS),
                versions={"torch": "2.13.0"},
                timestamp=T0 + timedelta(seconds=i),
            )
        )
    return outs


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def time_queries(kb: KnowledgeBase, rng: random.Random, n: int) -> dict[str, dict[str, float]]:
    rank_ms, search_ms = [], []
    for i in range(n):
        cat = rng.choice(CATEGORIES)
        span = [SourceSpan(file="model.py", line_start=10 + i, line_end=12 + i)]
        it = Intent(id=f"q{i}", category=cat, spans=span, evidence=evidence(rng, cat), confidence=0.8,
                    source=IntentSource.runtime)
        t = time.perf_counter()
        ranked = rank_recipes(kb, it, rng.choice(["npu", "cpu"]))
        rank_ms.append((time.perf_counter() - t) * 1e3)
        assert ranked, "ranking returned nothing"
        t = time.perf_counter()
        kb.search(" ".join(it.evidence.kernels + it.evidence.target_op_names), n=5)
        search_ms.append((time.perf_counter() - t) * 1e3)
    summary = lambda xs: {"median_ms": statistics.median(xs), "p95_ms": percentile(xs, 0.95), "n": len(xs)}  # noqa: E731
    return {"rank_recipes": summary(rank_ms), "search": summary(search_ms)}


@contextmanager
def chroma_server(path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(CHROMA), "run", "--path", str(path), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("chroma server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_mode(mode: str, sizes: list[int], queries: int, workdir: Path, n_recipes: int, chunk: int) -> list[dict]:
    rng = random.Random(0)
    recipes = make_recipes(rng, n_recipes)
    recipe_ids: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for r in recipes:
        recipe_ids[str(r.category)].append(r.id)
    rows = []

    def run(kb: KnowledgeBase) -> None:
        for r in recipes:
            kb.upsert_recipe(r)
        have, insert_s = 0, 0.0
        for size in sizes:
            while have < size:
                n = min(chunk, size - have)
                batch = make_outcomes(rng, recipe_ids, have, n)
                t = time.perf_counter()
                kb.record_outcomes(batch)
                insert_s += time.perf_counter() - t
                have += n
                print(f"  {mode}: {have} outcomes, {insert_s:.1f} s inserting", file=sys.stderr, flush=True)
            lat = time_queries(kb, random.Random(size), queries)
            t = time.perf_counter()
            _, exported = kb.export_jsonl(workdir / f"{mode}-{size}.jsonl")
            export_s = time.perf_counter() - t
            assert exported == size, (exported, size)
            rows.append({"mode": mode, "outcomes": size, "recipes": len(kb.list_recipes()),
                         "insert_s_total": insert_s, "insert_per_1k_s": insert_s / size * 1000,
                         "export_s": export_s, **lat})

    if mode == "embedded":
        with KnowledgeBase(workdir / "embedded") as kb:
            run(kb)
    else:
        with chroma_server(workdir / "server") as url, KnowledgeBase.connect(url) as kb:
            run(kb)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| mode | outcomes | recipes | rank median ms | rank p95 ms | search median ms | search p95 ms | insert total s | insert s / 1k | export s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['outcomes']:,} | {r['recipes']} | {r['rank_recipes']['median_ms']:.1f} | "
            f"{r['rank_recipes']['p95_ms']:.1f} | {r['search']['median_ms']:.1f} | {r['search']['p95_ms']:.1f} | "
            f"{r['insert_s_total']:.1f} | {r['insert_per_1k_s']:.2f} | {r['export_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000], help="outcome counts to measure at")
    ap.add_argument("--modes", nargs="+", default=["embedded", "server"], choices=["embedded", "server"])
    ap.add_argument("--queries", type=int, default=50, help="timed queries of each kind per size")
    ap.add_argument("--recipes", type=int, default=100, help="synthetic recipes besides the seeds")
    ap.add_argument("--chunk", type=int, default=5000, help="outcomes per record_outcomes call")
    ap.add_argument("--out", type=Path, default=RESULTS / "kb_latency.json")
    args = ap.parse_args()

    load_before = os.getloadavg()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kb_latency_") as tmp:
        for mode in args.modes:
            rows += bench_mode(mode, sorted(args.sizes), args.queries, Path(tmp), args.recipes, args.chunk)
    table = markdown(rows)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count(),
                 "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]]},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows,
        "markdown": table,
    }, indent=2) + "\n")
    print(f"\nwritten to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
