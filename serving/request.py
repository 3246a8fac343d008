"""A request's life in the engine (`Request`) and what the caller gets back (`RequestOutput`)."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from .block_pool import BlockTable
from .sampling import SamplingParams, StopChecker, key_stream


@dataclass(frozen=True)
class RequestImages:
    """A request's image features, computed once when it is added: `positions` [M] (prompt positions of its image
    placeholder tokens, ascending), `features` [M, D] (model dtype, image after image), and `keys` [M] (negative
    int64 values derived from each image's pixels, standing in for the placeholder ids in prefix-cache keys so that
    equal prompts with different images never share cached blocks)."""

    positions: np.ndarray
    features: np.ndarray
    keys: np.ndarray

    def chunk(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets from `start`, features) of the image tokens at positions [start, stop)."""
        lo, hi = np.searchsorted(self.positions, [start, stop])
        return self.positions[lo:hi] - start, self.features[lo:hi]


class Status(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and waiting to recompute)
    RUNNING = "running"      # holds a KDA slot and cache blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass
class Request:
    """Engine-side state. `tokens` = prompt + generated; the first `num_computed` have their KV/state in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_checker: StopChecker
    seed: int
    prompt: str | None = None
    images: RequestImages | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    table: BlockTable | None = None
    slot: int = 0
    num_computed: int = 0
    num_cached_tokens: int = 0
    prefill_target: int = 0  # tokens to compute before sampling resumes (the prompt, or prompt + outputs after preemption)
    snapshots: dict[int, int] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None
    text_trim: int | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # seconds between consecutive generated tokens

    @functools.cached_property
    def key_state(self) -> int:
        """The splitmix64 state this request's sampling keys derive from (`sampling.key_stream`)."""
        return key_stream(self.seed, 0)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop] without building the whole prompt + output list (the decode hot path)."""
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n_prompt]

    def cache_key_tokens(self, stop: int) -> list[int]:
        """tokens[:stop] as the prefix cache keys them: image placeholder ids replaced by their image's key."""
        tokens = self.token_slice(0, stop)
        if self.images is not None:
            n = int(np.searchsorted(self.images.positions, stop))
            if n:
                keyed = np.asarray(tokens, np.int64)
                keyed[self.images.positions[:n]] = self.images.keys[:n]
                tokens = keyed.tolist()
        return tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_target


@dataclass
class RequestOutput:
    """What `Engine.generate` / `Engine.stream` return for one request.

    `token_ids` are the generated ids; `text` their decoding (cut before a stop string) when the engine has a
    tokenizer; `finish_reason` is "stop", "length", "abort" or "error" (then `error` says why; nothing was
    generated). Timings in seconds: `ttft` from arrival to the first token, `itl` the gaps between later tokens.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def mean_itl(self) -> float | None:
        return float(np.mean(self.itl)) if self.itl else None
