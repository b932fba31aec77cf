"""Speculation switching itself off where it does not pay and back on where it does,
on synthetic step timings (the engine with a draft that never pays:
tests/test_spec_decode.py)."""

from __future__ import annotations

from tandem.engine.spec_control import PROBE_EVERY, PROBE_MAX, SpeculationControl


def run_steps(control, steps, spec_seconds, plain_seconds, accepted, batch=4):
    """``steps`` decode-only steps of ``batch`` requests; returns how many speculated."""
    speculated = 0
    for _ in range(steps):
        control.step_speculates(batch)
        drafted = {}
        for r in range(batch):
            if control.request_speculates(f"r{r}", batch):
                drafted[f"r{r}"] = 3
        sampled = {f"r{r}": [0] * (1 + (accepted if f"r{r}" in drafted else 0))
                   for r in range(batch)}  # fmt: skip
        seconds = spec_seconds if drafted else plain_seconds
        control.observe(batch, drafted, sampled, seconds, decode_only=True)
        speculated += bool(drafted)
    return speculated


def test_it_switches_off_when_drafts_do_not_pay_and_back_on_when_they_do():
    control = SpeculationControl()
    # Drafting costs 50% more time and nothing is accepted: off, but for the probes,
    # which grow rarer while they confirm it.
    run_steps(control, 64, spec_seconds=0.015, plain_seconds=0.010, accepted=0)
    later = run_steps(control, 4 * PROBE_MAX, spec_seconds=0.015, plain_seconds=0.010,
                      accepted=0)  # fmt: skip
    assert later <= 8  # probes, backing off to one in PROBE_MAX steps
    assert control.num_switches == 1
    # The workload turns repetitive: 3 of 3 drafts accepted. A probe sees it; on.
    run_steps(control, 3 * PROBE_MAX, spec_seconds=0.015, plain_seconds=0.010, accepted=3)
    again = run_steps(control, 4 * PROBE_MAX, spec_seconds=0.015, plain_seconds=0.010,
                      accepted=3)  # fmt: skip
    assert again >= 4 * PROBE_MAX - 8  # plain probes, backing off
    assert control.num_switches == 2


def test_each_request_pays_for_its_share_or_stops_drafting():
    control = SpeculationControl()
    batch = 2
    for _ in range(40):
        control.step_speculates(batch)
        drafted = {r: 3 for r in ("good", "bad") if control.request_speculates(r, batch)}
        assert "good" in drafted or not control.speculating
        sampled = {"good": [0] * (1 + 3 * ("good" in drafted)), "bad": [0]}
        # a speculative step costs 20% more than a plain one
        control.observe(batch, drafted, sampled, 0.012 if drafted else 0.010, True)
    assert control.acceptance("good") > 0.9 and control.acceptance("bad") < 0.1
    allowed = []
    for _ in range(PROBE_EVERY):
        control.step_speculates(batch)
        drafted = {r: 3 for r in ("good", "bad") if control.request_speculates(r, batch)}
        sampled = {"good": [0] * (1 + 3 * ("good" in drafted)), "bad": [0]}
        control.observe(batch, drafted, sampled, 0.012 if drafted else 0.010, True)
        allowed += list(drafted)
    # "good" drafts in every speculating step (all but a plain probe); "bad" only in
    # its own probes (rarer each time) and in a step probing speculation as a whole.
    assert allowed.count("good") >= PROBE_EVERY - 1
    assert allowed.count("bad") <= 2
    control.forget("bad")
    assert control.acceptance("bad") is None


def test_classes_of_batch_size_are_measured_apart():
    control = SpeculationControl()
    run_steps(control, 48, spec_seconds=0.030, plain_seconds=0.010, accepted=0, batch=16)
    run_steps(control, 48, spec_seconds=0.011, plain_seconds=0.010, accepted=3, batch=1)
    assert not control.classes[control.batch_class(16)].pays(16)
    assert control.classes[control.batch_class(1)].pays(1)
