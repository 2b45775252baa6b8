"""Busy rounds: the baseline's steps got far fewer cores than on a quiet round, so the round's times
are left out and it is measured again (agents/profiler/quiet.py)."""

from __future__ import annotations

from trainbridge.agents.profiler.quiet import BUSY_SHARE, busy_rounds, describe


def test_rounds_whose_baseline_got_few_cores_are_busy_judged_against_the_quietest():
    cores = [1.95, 1.30, 1.90, None, 1.97, 1.60]
    assert busy_rounds(cores, planned=20) == [1]  # 1.30 < 0.75 * 1.97; 1.60 is not; None is never busy
    assert busy_rounds([0.99, 0.98, 0.5], planned=20) == [2]  # one-thread workloads alike
    assert busy_rounds([], planned=10) == [] and busy_rounds([None, None], planned=10) == []
    assert busy_rounds([2.0, 2.0 * BUSY_SHARE], planned=10) == []  # exactly at the share: quiet enough


def test_no_more_rounds_are_measured_again_than_half_the_plan_and_the_busiest_go_first():
    cores = [2.0, 0.5, 0.9, 0.7, 1.0, 2.0]
    assert busy_rounds(cores, planned=4) == [1, 3]  # two allowed of four planned: the two busiest
    text = describe(cores, busy_rounds(cores, planned=4), planned=4)
    assert "busy in 2 round(s), measured again, the most this gate re-measures" in text
    assert "round 1 (0.50)" in text and "round 3 (0.70)" in text and "2.00 of a quiet round" in text
    assert describe(cores, [], planned=4) == ""


def test_contention_is_seen_in_a_busy_round_or_a_round_far_slower_than_the_quickest(monkeypatch):
    from trainbridge.agents.profiler import quiet

    assert not quiet.contended_round([2.0, 1.98], [0.125, 0.13], 10)
    assert quiet.contended_round([2.0, 1.98, 0.9], [0.125, 0.13, 0.14], 10)  # the baseline lost its cores
    assert quiet.contended_round([2.0, 1.98, 1.99], [0.125, 0.13, 5.8], 10)  # spin-waits keep the cores busy: the time says it
    monkeypatch.setattr(quiet.os, "getloadavg", lambda: (3.1, 2.0, 1.0))
    assert quiet.contended_at_start(cpus=2)
    monkeypatch.setattr(quiet.os, "getloadavg", lambda: (2.2, 2.0, 1.0))  # the gate's own two children of a moment ago
    assert not quiet.contended_at_start(cpus=2)


def test_a_parameter_whose_change_the_baseline_does_not_reproduce_is_not_judged_by_direction():
    """An attention key's bias has a zero true gradient: AdamW turns its rounding noise into full-size
    steps, so two honest runs move it in unrelated directions. The drift marks it as noise; the timed
    check then judges only that it changes, and still judges every other parameter."""
    import torch

    from trainbridge.agents.profiler.drift import timed_drift
    from trainbridge.agents.profiler.integrity import check_timed_deltas

    torch.manual_seed(0)
    weight = torch.randn(64)
    base = {"w": weight, "key.bias": torch.randn(16)}
    ref = {"w": weight * 1.0001, "key.bias": torch.randn(16)}  # the baseline again: same w, unrelated noise in the bias
    drift = timed_drift([1.0], [1.0], base, ref)
    assert drift.noise_params == ["key.bias"] and drift.delta_cosine_min > 0.99
    candidate = {"w": weight * 1.0002, "key.bias": -base["key.bias"]}  # honest: noise the other way
    assert check_timed_deltas(1, [], [], base, candidate, 0.9, 0.5, frozenset(drift.noise_params)) == []
    assert check_timed_deltas(1, [], [], base, candidate, 0.9, 0.5)  # without the drift's word it looks like other work
    cheat = {"w": -weight, "key.bias": base["key.bias"]}  # the parameters that carry the work are still judged
    assert check_timed_deltas(1, [], [], base, cheat, 0.9, 0.5, frozenset(drift.noise_params))
    skipped = check_timed_deltas(1, [], ["key.bias"], base, candidate, 0.9, 0.5, frozenset(drift.noise_params))
    assert skipped and "left 1 parameter(s) unchanged" in skipped[0].message  # a noise parameter must still change


def test_a_true_zero_gradient_marks_a_noise_parameter_even_when_its_noise_agreed_once():
    """The drift's one comparison can find the key bias's noise pointing the same way twice (the gpt2 example's
    suite run: skipped_work on h.2.attn.key.bias after the drift had not marked it); its first-step gradient,
    rounding noise around zero, marks it however the noise fell."""
    import torch

    from trainbridge.agents.profiler.drift import timed_drift, zero_gradient_params

    torch.manual_seed(0)
    grads = {"w": torch.randn(64), "key.bias": torch.randn(16) * 1e-9, "small.but.real": torch.randn(8) * 1e-2}
    assert zero_gradient_params(grads) == {"key.bias"}
    assert zero_gradient_params({"w": torch.zeros(4)}) == frozenset() and zero_gradient_params(None) == frozenset()
    weight, noise = torch.randn(64), torch.randn(16)
    base = {"w": weight, "key.bias": noise}
    ref = {"w": weight * 1.0001, "key.bias": noise + 0.1 * torch.randn(16)}  # the noise agreed this time
    assert timed_drift([1.0], [1.0], base, ref).noise_params == []
    marked = timed_drift([1.0], [1.0], base, ref, zero_gradient_params(grads))
    assert marked.noise_params == ["key.bias"] and marked.delta_cosine_min > 0.99
