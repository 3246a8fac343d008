"""Continuous batching: which requests run in the next step, with which cache blocks and KDA slots.

Each step is either a prefill step (chunks of prompts, at most `max_prefill_tokens` tokens in all) or a decode step
(one token for every running request). Waiting requests are admitted when a slot and blocks are free; a prompt is
first matched against the prefix cache (for hybrid models only up to a block with a KDA snapshot, which is restored
into the request's slot). When a decode step cannot get a block, the newest running request is preempted: its
blocks and slot are released and it waits to be recomputed from its prompt plus what it generated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dayzero.model.errors import RequestError

from .block_pool import BlockPool, BlockTable, OutOfBlocks, OutOfSlots, SlotPool
from .prefix_cache import PrefixCache
from .request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_prefill_tokens: int = 512
    max_prefill_rows: int = 8
    max_model_len: int = 4096
    block_size: int = 64
    enable_prefix_caching: bool = True
    decode_steps: int = 1  # decode steps per dispatch


@dataclass
class ScheduledRow:
    request: Request
    start: int  # first position computed in this step
    length: int  # tokens computed in this step (decode: steps this row may take in the dispatch)


@dataclass
class StepPlan:
    decode: bool
    rows: list[ScheduledRow]


class Scheduler:
    """Owns the queues and every host-side resource: blocks (through the prefix cache), slots, snapshots."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, num_slots: int, num_snapshots: int,
                 hybrid: bool, runner=None):
        self.config = config
        self.pool = BlockPool(num_blocks, config.block_size, reserved=1)
        self.cache = PrefixCache(self.pool, config.block_size)
        self.slots = SlotPool(num_slots, reserved=1)
        self.snapshot_ids = SlotPool(num_snapshots, reserved=0) if hybrid and num_snapshots > 0 else None
        self.hybrid = hybrid
        self.runner = runner  # restores/saves KDA snapshots and resets slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------------ admission
    def check_fits(self, request: Request) -> None:
        need = -(-(len(request.prompt_token_ids) + 1) // self.config.block_size)
        if need > self.pool.num_usable:
            raise RequestError(request.request_id, f"prompt of {len(request.prompt_token_ids)} tokens needs {need} "
                               f"cache blocks; the cache has {self.pool.num_usable}")

    def add(self, request: Request) -> None:
        request.prefill_target = request.num_tokens
        self.waiting.append(request)

    def _admit(self, request: Request) -> bool:
        """Gives a waiting request a slot, its prefix-cache hit and restored KDA state. False if no slot."""
        try:
            slot = self.slots.allocate()
        except OutOfSlots:
            return False
        match = None
        if self.config.enable_prefix_caching:
            match = self.cache.match(request.cache_key_tokens(request.prefill_target), require_snapshot=self.hybrid)
        blocks = self.cache.acquire(match) if match else []
        request.table = BlockTable(self.config.block_size, blocks, match.num_tokens if match else 0)
        request.slot = slot
        request.num_computed = request.num_cached_tokens = match.num_tokens if match else 0
        if self.runner is not None and self.hybrid:
            if match and match.snapshot is not None:
                self.runner.restore_snapshot(match.snapshot, slot)
            else:
                self.runner.reset_slots([slot])
        request.status = Status.RUNNING
        self.running.append(request)
        return True

    def _ensure_blocks(self, request: Request, num_tokens: int) -> bool:
        need = request.table.blocks_needed(num_tokens)
        if need == 0:
            return True
        try:
            blocks, snaps = self.cache.allocate(need)
        except OutOfBlocks:
            return False
        self._free_snapshots(snaps)
        request.table.append_blocks(blocks)
        return True

    def _chunk(self, request: Request, budget: int) -> int:
        remaining = request.prefill_target - request.num_computed
        n = min(remaining, budget)
        bs = self.config.block_size
        if n < remaining and n >= bs:
            n -= (request.num_computed + n) % bs  # end chunks on block boundaries (snapshots, cacheable blocks)
        if self.hybrid and self.config.enable_prefix_caching:
            last_full = (request.prefill_target // bs) * bs  # snapshot the prompt's last full block
            if request.num_computed < last_full < request.num_computed + n:
                n = last_full - request.num_computed
        return n

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan | None:
        """The next step, or None when nothing can run."""
        rows: list[ScheduledRow] = []
        budget = self.config.max_prefill_tokens
        for request in self.running:
            if request.is_prefilling and budget > 0 and len(rows) < self.config.max_prefill_rows:
                n = self._chunk(request, budget)
                if n > 0 and self._ensure_blocks(request, request.num_computed + n):
                    rows.append(ScheduledRow(request, request.num_computed, n))
                    budget -= n
        while (self.waiting and budget > 0 and len(rows) < self.config.max_prefill_rows
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if not self._admit(request):
                break
            n = self._chunk(request, budget)
            if not self._ensure_blocks(request, request.num_computed + n):
                self._release(request)
                request.status = Status.WAITING
                break
            self.waiting.popleft()
            rows.append(ScheduledRow(request, request.num_computed, n))
            budget -= n
        if rows:
            return StepPlan(False, rows)
        decoding = [r for r in self.running if not r.is_prefilling]
        for request in list(decoding):
            if request.status is not Status.RUNNING:
                continue
            while not self._ensure_blocks(request, request.num_tokens):
                victim = self._newest_other(request) or request
                self.preempt(victim)
                if victim is request:
                    break
        decoding = [r for r in self.running if not r.is_prefilling]
        if decoding:
            return StepPlan(True, [ScheduledRow(r, r.num_tokens - 1, self._lookahead(r)) for r in decoding])
        if len(self.running) > 1:  # prefills stalled for blocks: make room by recomputing the newest later
            self.preempt(self.running[-1])
            return self.schedule()
        return None

    def _lookahead(self, request: Request, pending: int = 0) -> int:
        """Decode steps (>= 1) `request` may take in one dispatch, after `pending` tokens of a dispatch not read
        back yet: up to `decode_steps`, no further than its token budget and the model length, and only onto blocks
        it holds or can get without preempting anyone."""
        num_tokens = request.num_tokens + pending
        steps = min(self.config.decode_steps, self.config.max_model_len - num_tokens + 1,
                    max(request.params.max_tokens - len(request.output_token_ids) - pending, 1))
        for extra in range(1, max(steps, 1)):
            if not self._ensure_blocks(request, num_tokens + extra):
                return extra
        return max(steps, 1)

    def plan_ahead(self, pending: Sequence[tuple[Request, int]]) -> list[ScheduledRow]:
        """The rows of the decode dispatch launched right after one whose sampled tokens are not read back yet.
        `pending` pairs requests with the tokens each has there: a decode row's steps, or 1 for a prompt whose
        prefill completes there (recorded already by `after_prefill_chunk`); running requests not named hold all
        their tokens on the host. Each is assumed to take its pending tokens without stopping; requests that surely
        finish by then (token budget, model length) are left out. [] when the next dispatch has to wait for those
        tokens: requests waiting or still prefilling (their prefill goes first), or blocks that only a preemption
        would free."""
        if self.waiting or any(r.is_prefilling for r in self.running):
            return []
        tokens_there_of = {id(request): n for request, n in pending}
        ahead = []
        for request in self.running:
            tokens_there = tokens_there_of.get(id(request), 0)
            num_tokens = request.num_tokens + tokens_there
            generated = len(request.output_token_ids) + tokens_there
            if generated >= request.params.max_tokens or num_tokens >= self.config.max_model_len:
                continue
            if not self._ensure_blocks(request, num_tokens):
                return []
            ahead.append(ScheduledRow(request, num_tokens - 1, self._lookahead(request, tokens_there)))
        return ahead

    def _newest_other(self, request: Request) -> Request | None:
        others = [r for r in self.running if r is not request]
        return others[-1] if others else None

    # ------------------------------------------------------------------ results
    def after_prefill_chunk(self, row: ScheduledRow) -> None:
        """Records a computed chunk: snapshot at a block boundary (hybrid) and publish full blocks to the cache."""
        request = row.request
        request.num_computed += row.length
        request.table.num_tokens = request.num_computed
        bs = self.config.block_size
        if (self.snapshot_ids is not None and self.config.enable_prefix_caching and request.num_computed % bs == 0
                and self.runner is not None):
            try:
                snap = self.snapshot_ids.allocate()
            except OutOfSlots:
                snap = None
            if snap is not None:
                self.runner.save_snapshot(request.slot, snap)
                request.snapshots[request.num_computed // bs - 1] = snap
        self._publish(request)

    def after_decode(self, request: Request) -> None:
        request.num_computed += 1
        request.table.num_tokens = request.num_computed

    def _publish(self, request: Request) -> None:
        if not self.config.enable_prefix_caching:
            self._free_snapshots(request.snapshots.values())
            request.snapshots = {}
            return
        result = self.cache.insert(request.cache_key_tokens(request.num_computed), request.table.block_ids,
                                   request.snapshots)
        self._free_snapshots(result.unused_snapshots)
        request.snapshots = {}

    def _free_snapshots(self, snaps) -> None:
        if self.snapshot_ids is not None:
            for s in snaps:
                self.snapshot_ids.free(s)

    def _release(self, request: Request) -> None:
        if request.table is not None:
            self.cache.release(request.table.clear())
        if request.slot:
            self.slots.free(request.slot)
            request.slot = 0
        self._free_snapshots(request.snapshots.values())
        request.snapshots = {}
        if request in self.running:
            self.running.remove(request)

    def preempt(self, request: Request) -> None:
        """Releases a running request's resources; it waits (first in line) to recompute what it had."""
        if self.config.enable_prefix_caching and request.num_computed:
            self._publish(request)
        self._release(request)
        request.status = Status.WAITING
        request.num_computed = 0
        request.prefill_target = request.num_tokens
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Frees everything a finished (or aborted) request holds; its full blocks stay in the prefix cache."""
        if request.status is Status.RUNNING and self.config.enable_prefix_caching and request.num_computed:
            self._publish(request)
        self._release(request)
        if request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
