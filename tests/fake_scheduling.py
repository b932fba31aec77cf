"""A scheduler with its block manager and a fake runner: no model, fake token ids.
Shared by the scheduler and prefix-caching tests."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import SchedulerConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.scheduler import Scheduler


@dataclass
class Token:
    token_id: int


def make_scheduler(num_blocks=100, block_size=4, max_model_len=1000, **config):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), kv, max_model_len), kv


def run_step(scheduler):
    """schedule + a fake forward that samples token 7 wherever a chunk completes."""
    out = scheduler.schedule()
    sampled = {s.request_id: [Token(7)] for s in out.scheduled if s.samples}
    scheduler.update(out, sampled)
    return out


def run_to_completion(scheduler, *requests):
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
