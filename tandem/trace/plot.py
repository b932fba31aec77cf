"""``tandem trace plot``: a Chrome trace written by StepTracer -> a swimlane picture.

One lane per request (first arrival at the top), time on x: waiting in grey, prefill
chunks in blue, decode steps in green, preempted in red; a triangle where the request
arrived, a dot at its first token with the TTFT written beside it. Above the lanes, the
engine's steps, so that who waits for whom is visible. Needs matplotlib
(``pip install 'tandem[plot]'``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from tandem.errors import TandemError
from tandem.trace.recorder import ENGINE_PID, REQUESTS_PID

COLOURS = {
    "waiting": "#d0d0d0",
    "prefill": "#3b75af",
    "decode": "#59a14f",
    "preempted": "#e15759",
    "step": "#9c9c9c",
}


def load_trace(path: str | Path) -> dict:
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TandemError(f"cannot read the trace {path}: {exc}") from exc
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise TandemError(f"{path} is not a Chrome trace-event file (no traceEvents)")
    return trace


def plot_trace(path: str | Path, output: str | Path, title: str | None = None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise TandemError(
            "plotting needs matplotlib: pip install 'tandem[plot]' (or pip install matplotlib)"
        ) from exc
    events = load_trace(path)["traceEvents"]
    names = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == REQUESTS_PID
    }
    lanes: dict[int, list[dict]] = defaultdict(list)
    steps = []
    for event in events:
        if event.get("ph") not in ("X", "i"):
            continue
        if event["pid"] == ENGINE_PID:
            steps.append(event)
        elif event["pid"] == REQUESTS_PID:
            lanes[event["tid"]].append(event)
    if not lanes:
        raise TandemError(f"{path} holds no request tracks")
    order = sorted(lanes)
    height = max(2.5, 0.35 * len(order) + 1.5)
    fig, ax = plt.subplots(figsize=(12, height))
    for event in steps:  # the engine's steps, as alternating shades on a top lane
        index = int(event["name"].split()[-1]) if event["name"].startswith("step") else 0
        ax.broken_barh(
            [(event["ts"] / 1e3, event["dur"] / 1e3)], (-1.4, 0.8),
            facecolors=COLOURS["step"] if index % 2 else "#c8c8c8", edgecolor="white",
            linewidth=0.3,
        )  # fmt: skip
    for row, tid in enumerate(order):
        for event in lanes[tid]:
            start = event["ts"] / 1e3
            if event["ph"] == "X":
                ax.broken_barh(
                    [(start, event["dur"] / 1e3)], (row - 0.35, 0.7),
                    facecolors=COLOURS.get(event["cat"], "black"), edgecolor="white",
                    linewidth=0.3,
                )  # fmt: skip
            elif event["name"] == "arrival":
                ax.plot(start, row, marker=">", color="black", markersize=5)
            elif event["name"] == "first token":
                ax.plot(start, row, marker="o", color="black", markersize=3)
                ttft = event["args"].get("ttft_ms")
                if ttft is not None:
                    ax.annotate(f"TTFT {ttft:.0f} ms", (start, row), xytext=(4, 5),
                                textcoords="offset points", fontsize=7)  # fmt: skip
    ax.set_yticks([-1, *range(len(order))], ["steps", *[names.get(t, str(t)) for t in order]])
    ax.set_ylim(len(order) - 0.4, -1.6)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=COLOURS[k], label=k) for k in ("waiting", "prefill", "decode",
                                                          "preempted")]  # fmt: skip
    ax.legend(handles=legend, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              ncols=4, frameon=False)  # fmt: skip
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output
