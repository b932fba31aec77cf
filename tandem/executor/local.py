"""LocalExecutor: steps run on this process's runner: the whole model in one process,
or rank 0's share, which the tensor-parallel executors (multiproc.py, external.py)
extend by sending each step to the other ranks and watching them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner
    from tandem.step import RunnerInfo, RunnerOutput, SchedulerOutput, SpecDecodeStats


class LocalExecutor:
    """tandem/step.py's Executor over this process's runner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.info: RunnerInfo = runner.info
        # What a disaggregated role's connector moves (multiproc.py: every rank's).
        self.kv_cache = runner.kv_cache

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.runner.spec_stats

    def expert_load(self) -> tuple[tuple[int, ...], ...]:
        """A mixture's last step, tokens per expert (every rank routes over all the
        experts, so rank 0's counts are the whole model's); empty for a dense model."""
        return self.runner.expert_load()

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(scheduler_output)

    def close(self) -> None:
        """Nothing to stop in one process; the tensor-parallel executors stop ranks."""
