"""Request: one sequence's state as the scheduler sees it (no tensors).

A request knows its tokens (prompt, then output), how many of them have their K/V in
the cache (``num_computed_tokens``), its blocks, and its timeline. Prefill and decode
are not states: a request just has ``num_tokens - num_computed_tokens`` tokens to run.
"""

from __future__ import annotations

import enum
from typing import Any

from tandem.engine import clock
from tandem.engine.kv_transfer_params import KVTransferParams
from tandem.outputs import RequestTimeline
from tandem.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # its prompt's K/V are arriving
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV is recomputed on resume
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed alone (its sampling or output raised); see .error

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        # prompt + output; the token sequence whose K/V the cache holds a prefix of.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it failed, when its status is FINISHED_ERROR
        self.pooled: list[float] | None = None  # an embedding request's vector, when done
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        # Prefix cache: requests with different salts never share blocks; the digests of
        # the full blocks so far (see kv_manager.py).
        self.cache_salt = cache_salt
        self.block_digests: list[bytes] = []
        # Leading blocks of its table the runner holds a copy of (see ScheduledRequest).
        self.num_blocks_sent = 0
        # Disaggregated serving (engine/kv_connector.py): what the client asked of the
        # connector, and what the connector says about this request when it finishes.
        self.kv_transfer: KVTransferParams | None = None
        self.kv_transfer_output: dict[str, Any] | None = None
        self.grammar: str | None = None  # structured outputs: the runner masks by it
        self.eos_token_ids = () if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_ids = set(sampling_params.stop_token_ids or ())
        self.timeline = RequestTimeline(arrival_time or clock.now())
        # One of n samples of the request ``parent_id`` (Engine.add sets these for n > 1).
        self.parent_id = request_id
        self.sample_index, self.num_samples = 0, 1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.timeline.token_times.append(now)

    def drop_last_output_tokens(self, count: int) -> None:
        """Forget the newest ``count`` tokens (accepted in one step, but after a stop)."""
        del self.output_token_ids[-count:]
        del self.all_token_ids[-count:]
        del self.timeline.token_times[-count:]

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finishing status after the newest token, or None to continue."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def keeps_for_decode(request: Request) -> bool:
    """Whether a finished request's blocks are for a decode instance to read: it asked
    for a remote decode and ended as a prefill ends (not aborted, not failed)."""
    transfer = request.kv_transfer
    return (
        transfer is not None
        and transfer.do_remote_decode
        and request.status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
    )


def remote_prefix(request: Request, block_ids: list[int], block_size: int) -> tuple[int, list]:
    """What a decode instance reads of a finished prompt: every token but the last (it
    computes that one itself, for its logits), and the blocks holding them."""
    num_tokens = len(request.prompt_token_ids) - 1
    return num_tokens, block_ids[: -(-num_tokens // block_size)]
