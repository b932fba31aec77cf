"""Whether speculating pays, measured while serving: speculation turns itself off
where it costs more than it saves, and back on where it pays.

Globally, per batch-size class (1, 2-3, 4-7, ...: the step's running requests), the
engine's generated tokens per second are measured over decode-only steps with
speculation and without: an exponential average of each. Speculation runs in a class
while its rate is at least the plain rate. Now and then a decode step runs the other
way (a probe), so both rates stay current (the cost of a draft model, of verifying k
more tokens, and the acceptance of the workload all move them): after ``PROBE_EVERY``
steps at first, twice as long after each probe that leaves the decision as it was (up
to ``PROBE_MAX``: a probe of an expensive draft costs several plain steps), and again
after ``PROBE_EVERY`` once the decision flips.

Per request, the share of its draft tokens the target accepts (an exponential
average over the steps where its proposer drafted: a proposer that finds nothing
costs nothing) must pay for what a draft token costs: the measured extra time of a
speculative step over a plain one in its class, per draft token verified, times the
batch (an accepted token is worth one request's share of a plain step). A request that
does not pay stops speculating, and tries again after ``PROBE_EVERY`` of its own decode
steps, then after twice as many each time it still does not pay.

Decisions depend on timing: with speculation adaptive, a seeded sampled request can
draw differently from one run to the next (greedy output never changes; speculation
is lossless either way). ``speculative_config.adaptive = False`` keeps every decision
fixed (speculate whenever there are slots).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PROBE_EVERY = 16
PROBE_MAX = 64
SMOOTHING = 0.2  # weight of the newest measurement in the averages


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class _Rates:
    """One batch-size class: its decode steps with and without speculation."""

    seconds: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    tokens: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    drafted: float | None = None  # draft tokens verified per speculative step
    steps: int = 0
    probe_in: int = 0  # decode steps until the next probe (0: this one; at first: plain)
    probe_every: int = PROBE_EVERY

    def rate(self, speculating: bool) -> float | None:
        seconds, tokens = self.seconds[speculating], self.tokens[speculating]
        return None if seconds is None or not seconds else tokens / seconds

    def pays(self) -> bool:
        """Speculation's measured rate is at least the plain one (unknown: try it)."""
        with_spec, plain = self.rate(True), self.rate(False)
        return with_spec is None or plain is None or with_spec >= plain

    def draft_token_cost(self) -> float:
        """What verifying one draft token adds to a step, as a share of a plain step
        (0 while unknown)."""
        with_spec, plain = self.seconds[True], self.seconds[False]
        if with_spec is None or not plain or not self.drafted:
            return 0.0
        return max(with_spec / plain - 1, 0.0) / self.drafted


@dataclass
class SpeculationControl:
    classes: dict[int, _Rates] = field(default_factory=dict)
    acceptance: dict[str, float] = field(default_factory=dict)  # request -> accepted share
    request_steps: dict[str, int] = field(default_factory=dict)  # ... since it last drafted
    request_probe_every: dict[str, int] = field(default_factory=dict)
    # What the last step decided (for /metrics and the trace).
    speculating: bool = True
    num_speculating: int = 0
    num_switches: int = 0  # times the decision for a class flipped (probes excluded)
    _decisions: dict[int, bool] = field(default_factory=dict)
    _everyone: bool = False

    @staticmethod
    def batch_class(num_running: int) -> int:
        return max(num_running, 1).bit_length()

    def step_speculates(self, num_running: int) -> bool:
        """Called once per step, before scheduling: whether this step's decodes may
        speculate at all."""
        key = self.batch_class(num_running)
        rates = self.classes.setdefault(key, _Rates())
        decision = rates.pays()
        if self._decisions.get(key, decision) != decision:
            self.num_switches += 1
            rates.probe_every = PROBE_EVERY
        self._decisions[key] = decision
        probe = rates.probe_in <= 0
        self.speculating = decision != probe
        self._everyone = self.speculating and probe  # measuring speculation itself
        self.num_speculating = 0
        return self.speculating

    def request_speculates(self, request_id: str, num_running: int) -> bool:
        """Whether this decoding request drafts in this step: never in a plain step;
        always in a step probing speculation; otherwise when its drafts pay for their
        cost, or as its own probe."""
        waited = self.request_steps.get(request_id, 0) + 1  # decode steps since it drafted
        self.request_steps[request_id] = waited
        if not self.speculating:
            return False
        accepted = self.acceptance.get(request_id)
        rates = self.classes.get(self.batch_class(num_running))
        cost = num_running * rates.draft_token_cost() if rates is not None else 0.0
        pays = self._everyone or accepted is None or accepted >= cost
        interval = self.request_probe_every.get(request_id, PROBE_EVERY)
        probe = not pays and waited >= interval
        if probe:
            self.request_probe_every[request_id] = min(2 * interval, PROBE_MAX)
        elif pays:
            self.request_probe_every.pop(request_id, None)
        if pays or probe:
            self.request_steps[request_id] = 0
            self.num_speculating += 1
        return pays or probe

    def observe(
        self,
        num_running: int,
        drafted: Mapping[str, int],
        sampled: Mapping[str, Sequence],
        seconds: float,
        decode_only: bool,
    ) -> None:
        """A step ended: ``drafted`` (request -> draft tokens it had verified), every
        request's sampled tokens, the step's seconds, and whether it ran decodes only."""
        for request_id, count in drafted.items():
            tokens = sampled.get(request_id)
            if count and tokens:
                self.acceptance[request_id] = _average(
                    self.acceptance.get(request_id), (len(tokens) - 1) / count
                )
        if not decode_only or seconds <= 0:
            return
        rates = self.classes.setdefault(self.batch_class(num_running), _Rates())
        total_drafted = sum(drafted.values())
        speculated = total_drafted > 0
        generated = sum(len(tokens) for tokens in sampled.values())
        rates.seconds[speculated] = _average(rates.seconds[speculated], seconds)
        rates.tokens[speculated] = _average(rates.tokens[speculated], generated)
        if speculated:
            rates.drafted = _average(rates.drafted, total_drafted)
        rates.steps += 1
        if rates.probe_in <= 0:  # this step was the probe: the next one waits longer
            rates.probe_in = rates.probe_every
            rates.probe_every = min(2 * rates.probe_every, PROBE_MAX)
        else:
            rates.probe_in -= 1

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self.request_steps.pop(request_id, None)
        self.request_probe_every.pop(request_id, None)
