"""The run report's figures: product of gate ratios with a combined interval, the torch.compile line, the loop's cost."""

from __future__ import annotations

import base64
import math
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest

from trainbridge.tools.report.write import combined_ci, write_report


def _state() -> dict:
    accepted = [
        {"category": "attention", "recipe_id": "attention-sdpa-causal", "accepted": True, "reason": "accepted",
         "message": "faster", "ratio": 0.9, "ratio_ci": [0.85, 0.95]},
        {"category": "silu", "recipe_id": "silu-functional", "accepted": True, "reason": "accepted",
         "message": "faster", "ratio": 0.98, "ratio_ci": [0.97, 0.99]},
    ]
    return {
        "run_id": "r", "base_sha": "a" * 40, "run_branch": "trainbridge/r", "baseline_step_s": 0.125,
        "reference_step_s": 0.100, "accepted": accepted, "verdicts": accepted, "candidates_tried": 3,
        "phase_times": [
            {"node": "prepare", "wall_s": 6.0, "parts": {"baseline": 5.5}},
            {"node": "analyst", "wall_s": 50.0, "parts": {"static": 0.1, "profile": 3.9, "reference": 45.0}},
            {"node": "profiler", "wall_s": 80.0, "parts": {"numerics": 8.0, "timing": 72.0}},
            {"node": "profiler", "wall_s": 60.0, "parts": {"numerics": 7.0, "timing": 53.0}},
        ],
    }


def test_combined_interval_is_the_quadrature_sum_on_the_log_scale():
    low, high = combined_ci([(0.9, (0.85, 0.95)), (0.98, (0.97, 0.99))])
    point = math.log(0.9 * 0.98)
    assert low == pytest.approx(math.exp(point - math.hypot(math.log(0.9 / 0.85), math.log(0.98 / 0.97))))
    assert high == pytest.approx(math.exp(point + math.hypot(math.log(0.95 / 0.9), math.log(0.99 / 0.98))))
    assert low < 0.9 * 0.98 < high
    assert combined_ci([(0.9, (0.85, 0.95))]) == pytest.approx((0.85, 0.95))
    assert combined_ci([]) is None


def test_report_states_baseline_product_compile_reference_and_loop_cost(tmp_path):
    config = SimpleNamespace(run_id="r", repo="/repo", target="cpu")
    paths = write_report(_state(), config, tmp_path, final_step_s=0.110, stop_reason="no intents left", emulated_npu=False,
                         kb_stats=None, closing_s={"final_measure": 12.0})
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "baseline step: 125.0 ms" in markdown
    assert "ratio 0.882" in markdown and "1.13x faster" in markdown and "approximate CI of the product" in markdown  # no level said
    # the analyst's torch.compile figure and the final re-measurement are one-shot: stated, never a faster/slower claim
    assert "torch.compile of the original, one-shot (timed once while the analyst compiled it" in markdown
    assert "100.0 ms; the eager baseline measured 125.0 ms" in markdown and "than torch.compile" not in markdown.replace(
        "nothing here is claimed faster or slower than torch.compile", "")
    assert "A single re-measurement of the final head, one-shot" in markdown and "110.0 ms" in markdown
    assert "| profiler | 2 | 140.0 s | numerics 15.0 s, timing 125.0 s |" in markdown
    assert "| analyst | 1 | 50.0 s | static 0.1 s, profile 3.9 s, reference 45.0 s |" in markdown
    # issue 27: the report node's own measurement (the closing comparison, here the one-shot final) was not in the table
    assert "| report | 1 | 12.0 s | final_measure 12.0 s |" in markdown and "| all phases | 5 | 208.0 s | - |" in markdown
    assert "Candidates tried per accepted commit: 1.5." in markdown
    assert all(p.is_file() for p in paths)
    assert "UNCONFINED" not in markdown


def test_a_run_that_judged_candidates_unconfined_says_so_in_its_headline(tmp_path):
    state = _state()
    state["verdicts"] = [{**v, "unconfined": True} for v in state["verdicts"]]
    write_report(state, SimpleNamespace(run_id="r", repo="/repo", target="cpu"), tmp_path, final_step_s=0.110,
                 stop_reason="no intents left", emulated_npu=False, kb_stats=None)
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert f"- sandbox: UNCONFINED (--unconfined): {len(state['verdicts'])} candidate(s) ran without the sandbox's confinement" in markdown


def _comparison(rounds: int, *, final_s: float, final: tuple, versus: tuple) -> dict:
    """A closing comparison as agents.profiler.final writes it: (ratio, ci_low, ci_high) of the final head against the
    original and against torch.compile of the original (95.0 ms, ratio 0.79 to the original's 120.0 ms)."""
    figure = lambda ratio, low, high: {"ratio": ratio, "ci_low": low, "ci_high": high}  # noqa: E731
    return {"rounds": rounds, "confidence": 0.95,
            "median_step_s": {"original": 0.120, "final": final_s, "original_compiled": 0.095},
            "final_vs_original": figure(*final), "final_vs_compiled": figure(*versus),
            "compiled_vs_original": figure(0.79, 0.77, 0.81), "failures": {}}


def test_report_leads_with_the_gate_then_the_interleaved_final_comparison(tmp_path):
    comparison = _comparison(6, final_s=0.108, final=(0.9, 0.88, 0.93), versus=(1.137, 1.10, 1.17))
    config = SimpleNamespace(run_id="r", repo="/repo", target="cpu")
    write_report(_state(), config, tmp_path, final_step_s=None, stop_reason="no intents left", emulated_npu=False,
                 kb_stats=None, final_comparison=comparison)
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "**Final head vs the original: step-time ratio 0.900 (95% CI 0.880–0.930), 1.11x faster**" in markdown
    unclear = {**comparison, "final_vs_original": {"ratio": 0.985, "ci_low": 0.958, "ci_high": 1.042}}
    write_report(_state(), config, tmp_path, final_step_s=None, stop_reason="x", emulated_npu=False, kb_stats=None,
                 final_comparison=unclear)
    assert "1.02x, but the interval includes no change" in (tmp_path / "report.md").read_text(encoding="utf-8")
    write_report(_state(), config, tmp_path, final_step_s=None, stop_reason="x", emulated_npu=False, kb_stats=None,
                 final_comparison=comparison)
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "original 120.0 ms, final 108.0 ms; medians of 6 interleaved rounds" in markdown
    assert "torch.compile of the original (Inductor, measured in the same rounds): 95.0 ms" in markdown
    assert "the final head is slower than torch.compile" in markdown
    result = markdown.split("## Result", 1)[1].split("##", 1)[0].strip()
    assert result.startswith("Gate-measured step-time ratios") and result.index("Gate-measured") < result.index("Closing comparison")
    assert "measured once while the analyst compiled it" not in markdown  # the interleaved figure replaces it


def test_a_closing_comparison_of_two_rounds_is_no_headline_and_no_interval(tmp_path):
    """Issue 27: "1.99x faster (95% CI 0.390-0.646)" in bold came from 2 rounds, where the gate's own figure was 1.13x."""
    comparison = _comparison(2, final_s=0.060, final=(0.502, 0.390, 0.646), versus=(0.63, 0.5, 0.7))
    write_report(_state(), SimpleNamespace(run_id="r", repo="/repo", target="cpu"), tmp_path, final_step_s=None,
                 stop_reason="no intents left", emulated_npu=False, kb_stats=None, final_comparison=comparison)
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    result = markdown.split("## Result", 1)[1].split("##", 1)[0]
    assert result.strip().startswith("Gate-measured step-time ratios"), result
    assert "over only 2 interleaved round(s): step-time ratio 0.502" in result and "indicative only" in result
    indicative = next(line for line in result.splitlines() if "interleaved round(s)" in line)
    assert "**" not in indicative and "95% CI 0.390" not in result and "1.99x" not in result


class _Page(HTMLParser):
    """What a browser would show: the text, and the tables, headers and images of the page."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.tags, self.images = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.images.append(dict(attrs))

    def handle_data(self, data):
        self.text.append(data)


def test_html_report_is_real_html_with_tables_charts_and_text_escaped_once(tmp_path):
    state = _state()
    hostile = "grad rtol >= 1e-3 & <script>alert(1)</script> for `w` *not* [x](y) | a\\b"
    state["verdicts"] = [*state["verdicts"], {"category": "rmsnorm", "recipe_id": "rms-x", "accepted": False,
                                              "reason": "numerics_mismatch", "message": hostile}]
    config = SimpleNamespace(run_id="r", repo="/repo", target="cpu")
    write_report(state, config, tmp_path, final_step_s=0.110, stop_reason="no intents left", emulated_npu=False,
                 kb_stats={"recipes": 3})
    source = (tmp_path / "report.html").read_text(encoding="utf-8")
    page = _Page()
    page.feed(source)
    text = "".join(page.text)
    assert "<pre>" not in source.split("<body>")[1].split("<h2>Knowledge base</h2>")[0]  # the report is not a <pre> dump
    assert page.tags.count("table") == 2 and "th" in page.tags and "h2" in page.tags  # candidates and loop cost
    assert hostile in text  # the browser shows the message exactly as it was ...
    assert "<script>" not in source and "&amp;gt;" not in source and "&amp;amp;" not in source  # ... escaped once
    assert "&gt;= 1e-3 &amp; &lt;script&gt;" in source
    charts = [i for i in page.images if i.get("src", "").startswith("data:image/png;base64,")]
    assert {i["alt"] for i in charts} == {"step_time"} and len(page.images) == len(charts)  # embedded, nothing fetched
    assert base64.b64decode(charts[0]["src"].split(",", 1)[1]) == (tmp_path / "step_time.png").read_bytes()
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "&gt;" not in markdown and "&amp;" not in markdown  # the markdown is markdown, not HTML-escaped text


def test_the_step_time_chart_draws_an_indicative_closing_comparison_as_such():
    """Seen in a real gpt2_pretrain report's screenshot: the text said the 3-round closing comparison was indicative only,
    while the chart drew its final bar and its torch.compile line like any measured figure."""
    from trainbridge.tools.report.write import step_time_bars

    few = {**_state(), "final_comparison": _comparison(3, final_s=0.1, final=(0.8, 0.7, 0.9), versus=(1.1, 1.0, 1.2))}
    labels, values, weak, reference, reference_label = step_time_bars(few, None)
    assert labels[-1] == "final (3 rounds, indicative)" and weak and reference_label.endswith("(3 rounds, indicative)")
    enough = {**_state(), "final_comparison": _comparison(6, final_s=0.1, final=(0.8, 0.7, 0.9), versus=(1.1, 1.0, 1.2))}
    labels, values, weak, reference, reference_label = step_time_bars(enough, None)
    assert labels[-1] == "final (closing comparison)" and not weak and reference_label == "torch.compile of the original"
    assert step_time_bars(_state(), 0.110)[0][-1] == "final (one-shot)" and step_time_bars({**_state(), "accepted": []}, None) is None
