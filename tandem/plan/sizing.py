"""``tandem simulate --search``: the fewest instances, colocated or split into prefill
and decode pools, that serve a workload within its SLOs (DistServe's question, asked
of the simulator).

For n = 1, 2, ... up to a limit, every layout of n instances is simulated on the same
arrivals: n colocated, and each split P:D with P + D = n. The first n with a layout
that meets every SLO is the answer (fewer instances cannot, more cost more); among
its layouts, the one with the most headroom (the smallest worst ratio of a metric to
its limit) wins. Every simulated row is kept, to print the table searched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from tandem.bench.summary import PERCENTILES
from tandem.errors import InvalidParameterError, TandemError
from tandem.plan.simulate import Topology

STATS = ("mean", *("median" if p == 50 else f"p{p}" for p in PERCENTILES))
METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """``["p90_ttft:500", "p99_tpot:50"]`` -> limits on summary keys, in milliseconds."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        stat, _, metric = name.partition("_")
        try:
            limit = float(value)
        except ValueError:
            limit = -1.0
        if stat not in STATS or metric not in METRICS or not limit > 0:
            raise InvalidParameterError(
                "--slo", f"takes STAT_METRIC:MS with STAT in {STATS} and METRIC in "
                f"{METRICS} (e.g. p90_ttft:500), got {item!r}",
            )  # fmt: skip
        slos[f"{stat}_{metric}_ms"] = limit
    if not slos:
        raise InvalidParameterError("--slo", "the search needs at least one SLO")
    return slos


@dataclass
class Row:
    topology: Topology
    summary: dict | None  # None: the layout cannot run the workload (see ``why``)
    why: str = ""

    def headroom(self, slos: dict[str, float]) -> float:
        """The worst ratio of a metric to its limit (<= 1: every SLO is met)."""
        if self.summary is None:
            return float("inf")
        return max(self.summary[key] / limit for key, limit in slos.items())

    def meets(self, slos: dict[str, float]) -> bool:
        return self.headroom(slos) <= 1.0


def layouts(n: int, link: Topology) -> list[Topology]:
    """Every way to serve with ``n`` instances (``link``: the disaggregated settings)."""
    split = [replace(link, instances=0, prefill=p, decode=n - p) for p in range(1, n)]
    return [Topology(instances=n), *split]


def search(
    run: Callable[[Topology], dict],
    slos: dict[str, float],
    max_instances: int,
    link: Topology | None = None,
) -> tuple[Row | None, list[Row]]:
    """The cheapest layout meeting ``slos`` (None if none up to ``max_instances``) and
    every row simulated. ``run`` simulates a layout and returns its summary (bench
    serve's keys); a TandemError from it marks the layout as unable to run."""
    rows: list[Row] = []
    for n in range(1, max_instances + 1):
        batch = []
        for topology in layouts(n, link or Topology()):
            try:
                batch.append(Row(topology, run(topology)))
            except TandemError as error:
                batch.append(Row(topology, None, str(error)))
        rows += batch
        meeting = [row for row in batch if row.meets(slos)]
        if meeting:
            return min(meeting, key=lambda row: row.headroom(slos)), rows
    return None, rows


def format_search(best: Row | None, rows: list[Row], slos: dict[str, float]) -> str:
    keys = list(slos)
    header = ["layout", *(f"{key[:-3]} (ms)" for key in keys), "req/s", "meets"]
    lines = [header]
    for row in rows:
        if row.summary is None:
            lines.append([row.topology.label, *("-" for _ in keys), "-", row.why[:40]])
            continue
        mark = "yes" if row.meets(slos) else "no"
        lines.append(
            [row.topology.label, *(f"{row.summary[key]:.1f}" for key in keys),
             f"{row.summary['request_throughput']:.2f}", mark + (" <-" if row is best else "")]
        )  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    limits = ", ".join(f"{key[:-3]} <= {limit:g} ms" for key, limit in slos.items())
    if best is None:
        verdict = f"no layout meets {limits} within {rows[-1].topology.num_instances} instances"
    else:
        verdict = (
            f"cheapest: {best.topology.label} ({best.topology.num_instances} instances) meets "
            f"{limits}"
        )
    return "\n".join([*text, verdict])
