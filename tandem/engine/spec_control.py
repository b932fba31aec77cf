"""Whether speculating pays, measured while serving: speculation turns itself off
where it costs more than it saves, and back on where it pays.

Globally, per batch-size class (1, 2-3, 4-7, ...: the step's running requests), the
engine's last ``WINDOW`` decode-only steps with speculation and without are kept.
Speculation runs in a class while a draft token pays for itself there: the share of
draft tokens accepted (summed over the window: acceptance comes in bursts) is at least
what a draft token costs, the median speculative step's time over the median plain
step's, less one, per draft token verified, times the batch (an accepted token is
worth one request's share of a plain step). Medians, so that one step stretched by
something else (a suffix trie built for a new request, the machine's noise) does not
flip the decision. Now and then a decode step runs the other way (a probe), so both
stay current (the cost of a draft model, of verifying k more tokens, and the
acceptance of the workload all move them): after ``PROBE_EVERY`` steps at first, twice
as long after each probe that leaves the decision as it was (up to ``PROBE_MAX``: a
probe of an expensive draft can cost several plain steps). A probe whose proposer
found nothing to draft is tried again at the next step.

Per request, the share of its draft tokens the target accepts (over its life, counted
only where its proposer drafted: a proposer that finds nothing costs nothing) must pay
for what a draft token costs: the measured extra time of a speculative step over a
plain one in its class, per draft token verified, times the batch (an accepted token
is worth one request's share of a plain step). A request that does not pay stops
speculating, and tries again after ``PROBE_EVERY`` of its own decode steps, then after
twice as many each time it still does not pay.

Decisions depend on timing: with speculation adaptive, a seeded sampled request can
draw differently from one run to the next (greedy output never changes; speculation
is lossless either way). ``speculative_config.adaptive = False`` keeps every decision
fixed (speculate whenever there are slots).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PROBE_EVERY = 16
PROBE_MAX = 256
WINDOW = 64  # recent steps per class and mode that are measured (acceptance is bursty)
MIN_SAMPLES = 4  # steps of each way before a class decides
PROBE_REQUESTS = 2  # requests that draft in a step probing speculation


@dataclass
class _Rates:
    """One batch-size class: its recent decode steps with and without speculation, as
    (seconds, tokens generated, draft tokens verified, requests)."""

    recent: dict[bool, deque] = field(
        default_factory=lambda: {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)}
    )
    probe_in: int = 0  # decode steps until the next probe (0: this one; at first: plain)
    probe_every: int = PROBE_EVERY

    def add(self, speculating: bool, seconds: float, tokens: int, drafted: int, batch: int):
        self.recent[speculating].append((seconds, tokens, drafted, batch))

    def _seconds(self, speculating: bool) -> float | None:
        steps = self.recent[speculating]
        return statistics.median(step[0] for step in steps) if steps else None

    def accepted_share(self) -> float | None:
        """Of the draft tokens verified in the recent speculative steps, the share
        accepted (a sum over the window: acceptance comes in bursts)."""
        steps = self.recent[True]
        drafted = sum(step[2] for step in steps)
        return sum(step[1] - step[3] for step in steps) / drafted if drafted else None

    def draft_token_cost(self) -> float:
        """What verifying one draft token adds to a step, as a share of a plain step:
        the median speculative step over the median plain one, less one, per draft
        token verified (0 while unknown)."""
        with_spec, plain = self._seconds(True), self._seconds(False)
        steps = self.recent[True]
        if with_spec is None or not plain:
            return 0.0
        drafted = statistics.fmean(step[2] for step in steps)
        return max(with_spec / plain - 1, 0.0) / drafted

    def pays(self, batch: int) -> bool:
        """A draft token is accepted often enough to pay for itself: its accepted share
        is at least its cost times the batch (an accepted token is worth one request's
        share of a plain step). Unknown (fewer than ``MIN_SAMPLES`` steps either way):
        try it."""
        if min(len(steps) for steps in self.recent.values()) < MIN_SAMPLES:
            return True
        return (self.accepted_share() or 0.0) >= batch * self.draft_token_cost()


@dataclass
class SpeculationControl:
    classes: dict[int, _Rates] = field(default_factory=dict)
    # request -> (draft tokens accepted, draft tokens verified), over its life
    drafts: dict[str, tuple[int, int]] = field(default_factory=dict)
    request_steps: dict[str, int] = field(default_factory=dict)  # ... since it last drafted
    request_probe_every: dict[str, int] = field(default_factory=dict)
    speculating: bool = True  # what this step decided (StepStats counts who drafted)
    num_switches: int = 0  # times the decision for a class flipped (probes excluded)
    _decisions: dict[int, bool] = field(default_factory=dict)
    _probe_budget: int = 0  # requests that may still draft in this probing step

    @staticmethod
    def batch_class(num_running: int) -> int:
        return max(num_running, 1).bit_length()

    def step_speculates(self, num_running: int) -> bool:
        """Called once per step, before scheduling: whether this step's decodes may
        speculate at all."""
        key = self.batch_class(num_running)
        rates = self.classes.setdefault(key, _Rates())
        decision = rates.pays(num_running)
        if self._decisions.get(key, decision) != decision:
            self.num_switches += 1
            rates.probe_every = PROBE_EVERY
        self._decisions[key] = decision
        probe = rates.probe_in <= 0
        self.speculating = decision != probe
        exploring = min(len(steps) for steps in rates.recent.values()) < MIN_SAMPLES
        # Measuring speculation itself: the first PROBE_REQUESTS requests draft whatever
        # they accepted before (a probe where every one of a large batch drafts would
        # cost several plain steps).
        self._probe_budget = PROBE_REQUESTS if self.speculating and (probe or exploring) else 0
        return self.speculating

    def acceptance(self, request_id: str) -> float | None:
        """The share of the request's draft tokens accepted so far, with a prior of one
        accepted in two (None before it drafted): over its life, not its last steps,
        as acceptance comes in bursts."""
        accepted, verified = self.drafts.get(request_id, (0, 0))
        return (accepted + 1) / (verified + 2) if verified else None

    def request_speculates(self, request_id: str, num_running: int) -> bool:
        """Whether this decoding request drafts in this step: never in a plain step;
        among the first ``PROBE_REQUESTS`` in a step probing speculation; otherwise when
        its drafts pay for their cost, or as its own probe."""
        waited = self.request_steps.get(request_id, 0) + 1  # decode steps since it drafted
        self.request_steps[request_id] = waited
        if not self.speculating:
            return False
        accepted = self.acceptance(request_id)
        rates = self.classes.get(self.batch_class(num_running))
        cost = num_running * rates.draft_token_cost() if rates is not None else 0.0
        probing = self._probe_budget > 0
        self._probe_budget -= probing
        pays = probing or accepted is None or accepted >= cost
        interval = self.request_probe_every.get(request_id, PROBE_EVERY)
        probe = not pays and waited >= interval
        if probe:
            self.request_probe_every[request_id] = min(2 * interval, PROBE_MAX)
        elif pays:
            self.request_probe_every.pop(request_id, None)
        if pays or probe:
            self.request_steps[request_id] = 0
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
                accepted, verified = self.drafts.get(request_id, (0, 0))
                self.drafts[request_id] = (accepted + len(tokens) - 1, verified + count)
        if not decode_only or seconds <= 0:
            return
        rates = self.classes.setdefault(self.batch_class(num_running), _Rates())
        total_drafted = sum(drafted.values())
        generated = sum(len(tokens) for tokens in sampled.values())
        speculated = total_drafted > 0
        decision = rates.pays(num_running)
        rates.add(speculated, seconds, generated, total_drafted, len(sampled))
        need_spec = len(rates.recent[True]) < MIN_SAMPLES
        need_plain = len(rates.recent[False]) < MIN_SAMPLES
        if need_spec or need_plain:
            # Until both ways are measured: run a missing one next, alternating (a probe
            # runs the way the decision does not; an unmeasured class speculates).
            plain_next = need_plain and (speculated or not need_spec)
            rates.probe_in = 0 if plain_next else 1
        elif rates.probe_in > 0:
            rates.probe_in -= 1
        elif speculated == decision:
            pass  # the probe could not run the other way (nothing drafted): again next step
        elif rates.pays(num_running) != decision:  # it changed the decision: watch closely
            rates.probe_in = rates.probe_every = PROBE_EVERY
        else:  # it agreed: the next one waits longer
            rates.probe_in = rates.probe_every
            rates.probe_every = min(2 * rates.probe_every, PROBE_MAX)

    def forget(self, request_id: str) -> None:
        self.drafts.pop(request_id, None)
        self.request_steps.pop(request_id, None)
        self.request_probe_every.pop(request_id, None)
