"""`Engine`: continuous-batching generation over a paged cache (the DESIGN.md contract).

    engine = Engine.from_checkpoint("path/to/checkpoint", max_num_seqs=16)
    outputs = engine.generate(["Hello"], sampling_params=SamplingParams(max_tokens=32))

The engine admits requests, runs jitted prefill and decode steps (`runner.ModelRunner`), samples on the device,
checks stop conditions on the host, and reports per-request timings. A bad request fails alone with a RequestError
(from `add_request`) or an output whose `finish_reason` is "error" (from `generate`); the others run on.

For a vision model (kimi_k25) a request may carry images (paths, PIL images or uint8 arrays): `add_request`
preprocesses them, expands the prompt's placeholders and computes the image features once; prefill chunks then take
the features of the image tokens they cover, and the prefix cache keys image tokens by a hash of their image.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import time
from dataclasses import dataclass, fields
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from dayzero.model.cache import bytes_per_block, bytes_per_slot
from dayzero.model.config import LAYER_KDA
from dayzero.model.errors import ImageError, RequestError
from dayzero.model.image_processing import expand_placeholders, preprocess_images, tokens_per_image
from dayzero.model.model import Model, load_checkpoint

from .block_pool import blocks_for_budget
from .request import Request, RequestImages, RequestOutput, Status
from .runner import ModelRunner, StepRows, bucket, powers_of_two
from .sampling import SamplingParams, StopChecker, stream_keys
from .scheduler import ScheduledRow, Scheduler, SchedulerConfig, StepPlan
from .tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. `num_blocks=None` sizes the block pool from `cache_memory_bytes` (default: room for every
    sequence at `max_model_len`); `num_snapshots` KDA state snapshots back the prefix cache of hybrid models."""

    max_num_seqs: int = 16
    max_model_len: int = 2048
    max_prefill_tokens: int = 512
    max_prefill_rows: int = 8
    block_size: int = 64
    num_blocks: int | None = None
    cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    num_snapshots: int = 64
    seed: int | None = None
    decode_buckets: tuple[int, ...] | None = None       # rows per decode step (default: powers of two)
    prefill_len_buckets: tuple[int, ...] | None = None  # tokens per prefill row (default: powers of two from 32)
    block_buckets: tuple[int, ...] | None = None        # blocks per row gathered (default: powers of four)
    decode_steps: int = 4  # decode steps per dispatch (sampled on the device; stop checks after each dispatch)
    # a decode dispatch runs only as many steps as its longest row takes (a request's last tokens, a stop near the
    # model length), each count from 1 to decode_steps compiled apart, instead of always decode_steps
    trim_decode_steps: bool = True
    overlap_decode: bool = True  # launch the next decode dispatch before reading this one's tokens
    overlap_prefill: bool = True  # with overlap_decode: a prompt's first decode launched before its token is read
    # a dispatch's decode steps compiled as straight-line code, not an XLA loop; None: where the model runs on a GPU
    # (`runner.unrolled_by_default`)
    unrolled_decode: bool | None = None
    max_image_patches: int = 65536  # patches of one request's images in all (vision models)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "max_prefill_tokens", "max_prefill_rows", "block_size",
                     "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine option {name} must be at least 1")
        if self.max_prefill_tokens < self.block_size:
            raise ValueError(f"max_prefill_tokens ({self.max_prefill_tokens}) must be at least block_size")


class Engine:
    """Generation engine for one `Model` (and its tokenizer, when the checkpoint ships one)."""

    def __init__(self, model: Model, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        mcfg = model.config
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        num_blocks = config.num_blocks
        if num_blocks is None:
            per_block = max(bytes_per_block(mcfg, model.dtype, config.block_size), 1)
            budget = config.cache_memory_bytes or per_block * self.max_blocks_per_seq * config.max_num_seqs
            num_blocks = blocks_for_budget(budget, per_block) + 1
        hybrid = LAYER_KDA in mcfg.layer_types
        num_slots = config.max_num_seqs + 1
        self.runner = ModelRunner(model, num_blocks, num_slots, config.num_snapshots if hybrid else 0,
                                  config.block_size, config.unrolled_decode, config.trim_decode_steps)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_prefill_tokens, config.max_prefill_rows,
                            config.max_model_len, config.block_size, config.enable_prefix_caching,
                            config.decode_steps),
            num_blocks, num_slots, config.num_snapshots, hybrid, self.runner)
        self.decode_buckets = config.decode_buckets or powers_of_two(1, config.max_num_seqs)
        self.prefill_row_buckets = powers_of_two(1, config.max_prefill_rows)
        self.prefill_len_buckets = config.prefill_len_buckets or powers_of_two(
            min(32, config.max_prefill_tokens), config.max_prefill_tokens)
        self.block_buckets = config.block_buckets or powers_of_two(1, self.max_blocks_per_seq, factor=4)
        for name, buckets, need in (("decode_buckets", self.decode_buckets, config.max_num_seqs),
                                    ("prefill_len_buckets", self.prefill_len_buckets, config.max_prefill_tokens),
                                    ("block_buckets", self.block_buckets, self.max_blocks_per_seq)):
            if max(buckets) < need:
                raise ValueError(f"engine option {name} {buckets} does not reach {need}")
        self._embed_dim = mcfg.hidden_size if mcfg.vision is not None else 0  # prefill steps carry image features
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None and tokenizer.eos_token_ids \
            else mcfg.eos_token_ids
        self._requests: dict[str, Request] = {}
        self._ahead = None  # (StepPlan, (tokens, logprobs) on the device): a decode dispatch launched, not read
        self._ids = itertools.count()
        self._entropy = np.random.default_rng(config.seed if config.seed is not None else secrets.randbits(63))
        self.cache_bytes = num_blocks * bytes_per_block(mcfg, model.dtype, config.block_size) + \
            num_slots * bytes_per_slot(mcfg, model.dtype)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, dtype: Any = None, mesh=None, platform=None,
                        **engine_options) -> "Engine":
        """Loads a checkpoint directory (and its tokenizer, if any) into an engine; options go to EngineConfig.
        `platform` (a `dayzero.platforms.PlatformConfig` or a platform name) is `load_checkpoint`'s: the model, its
        cache and its steps then live on that platform's first device."""
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        model = load_checkpoint(path, dtype=dtype, mesh=mesh, platform=platform)
        return cls(model, load_tokenizer(path), EngineConfig(**engine_options))

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                    sampling_params: SamplingParams | None = None, request_id: str | None = None,
                    images: Sequence[Any] | None = None) -> str:
        """Queues one request; raises RequestError (naming it) when it is invalid. Returns its id."""
        request_id = str(request_id if request_id is not None else next(self._ids))
        if request_id in self._requests:
            raise RequestError(request_id, "a request with this id is already in the engine")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(request_id, f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(request_id)
        if images and self.model.config.vision is None:
            raise RequestError(request_id, f"this {self.model.config.model_type} model has no vision tower; "
                                           "images cannot be given")
        ids = self._prompt_ids(request_id, prompt, prompt_token_ids)
        pending = None
        if self.model.config.vision is not None:
            ids, pending = self._prepare_images(request_id, ids, list(images or []))
        if len(ids) >= self.config.max_model_len:
            raise RequestError(request_id, f"prompt has {len(ids)} tokens; the maximum is "
                                           f"{self.config.max_model_len - 1} (max_model_len {self.config.max_model_len})")
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        checker = StopChecker(params, self.eos_token_ids, decode, request_id)
        seed = params.seed if params.seed is not None else int(self._entropy.integers(1 << 62))
        request = Request(request_id, ids, params, checker, seed, prompt=prompt)
        self.scheduler.check_fits(request)
        if pending is not None:
            request.images = self._encode_images(request_id, ids, *pending)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _prompt_ids(self, request_id, prompt, prompt_token_ids) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise RequestError(request_id, "give exactly one of prompt (text) and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise RequestError(request_id, f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise RequestError(request_id, "this checkpoint has no tokenizer: pass prompt_token_ids")
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [int(t) for t in np.asarray(prompt_token_ids).reshape(-1)]
            except (TypeError, ValueError):
                raise RequestError(request_id, "prompt_token_ids must be a sequence of integers") from None
        if not ids:
            raise RequestError(request_id, "the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(request_id, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def _prepare_images(self, request_id, ids: list[int], images: list) -> tuple[list[int], tuple | None]:
        """Preprocesses a request's images and expands its placeholders: (prompt ids, (pixel_values, grid,
        tokens per image) or None without images). Raises ImageError for unreadable images, too many patches or
        placeholders that do not match the images."""
        cfg = self.model.config
        pixel_values, grid = preprocess_images(images, self.model.image_processor, request_id)
        if len(pixel_values) > self.config.max_image_patches:
            raise ImageError(request_id, f"the images have {len(pixel_values)} patches (grids "
                             f"{[g[1:] for g in grid.tolist()]}); at most {self.config.max_image_patches} "
                             "(engine option max_image_patches)")
        counts = tokens_per_image(grid, cfg.vision.merge_kernel_size[0])
        ids = expand_placeholders(ids, cfg.image_token_id, counts, request_id)
        return ids, ((pixel_values, grid, counts) if images else None)

    def _encode_images(self, request_id, ids: list[int], pixel_values, grid, counts) -> RequestImages:
        """Runs the vision tower once for the request; keys each image's tokens by a hash of its pixels."""
        features = np.asarray(self.model.encode_images(pixel_values, grid, request_id))
        starts = np.concatenate([[0], np.cumsum(np.prod(grid, axis=1))])
        keys = []
        for i, count in enumerate(counts):
            digest = hashlib.blake2b(pixel_values[starts[i]:starts[i + 1]].tobytes() + grid[i].tobytes(),
                                     digest_size=8).digest()
            keys += [-1 - (int.from_bytes(digest, "little") >> 1)] * count
        positions = np.flatnonzero(np.asarray(ids) == self.model.config.image_token_id)
        return RequestImages(positions, features, np.asarray(keys, np.int64))

    def abort(self, request_id: str) -> None:
        """Cancels a request; its resources are released at once. Unknown or finished ids are ignored."""
        request = self._requests.get(str(request_id))
        if request is not None and request.status is not Status.FINISHED:
            request.finish_reason = "abort"
            self.scheduler.finish(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def _rows(self, rows: list[ScheduledRow], decode: bool,
              previous: list[tuple[int, int] | None] | None = None) -> StepRows:
        """The step inputs of `rows`. `previous` (decode): per row, (its row, its steps) in the dispatch launched
        just before, whose tokens are not read back (a prefill's row p: (p, 1)), or None for a row whose tokens are
        all on the host: the row's input token is taken on the device from that dispatch's last step for it, and
        its sampling keys continue after those steps."""
        n_rows = bucket(len(rows), self.decode_buckets if decode else self.prefill_row_buckets)
        n_tok = 1 if decode else bucket(max(r.length for r in rows), self.prefill_len_buckets)
        n_blk = bucket(max(len(r.request.table) for r in rows), self.block_buckets)
        out = self._padding(n_rows, n_tok, n_blk, decode)
        n_keys = out.keys.shape[1] if decode else 1  # a row's keys start at its generated count
        previous = previous or [None] * len(rows)
        for i, row in enumerate(rows):
            req, p = row.request, row.request.params
            if decode:  # a decode row feeds its last token; the device feeds the rest
                if previous[i] is None:
                    out.tokens[i, 0] = req.token_slice(row.start, row.start + 1)[0]
                else:
                    out.feed[i] = previous[i][0] * n_keys + previous[i][1] - 1  # its row's last step
                out.positions[i, 0] = row.start
                out.valid[i, 0] = True
                out.steps[i] = row.length
            else:
                out.tokens[i, :row.length] = req.token_slice(row.start, row.start + row.length)
                out.positions[i, :row.length] = np.arange(row.start, row.start + row.length)
                out.valid[i, :row.length] = True
            blocks = req.table.block_ids
            out.block_tables[i, :len(blocks)] = blocks
            out.slots[i] = req.slot
            out.temperature[i], out.top_k[i], out.top_p[i], out.min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            if out.embeds is not None and req.images is not None:
                offsets, features = req.images.chunk(row.start, row.start + row.length)
                out.embeds[i, offsets] = features
                out.embeds_mask[i, offsets] = True
        done = [len(r.request.output_token_ids) + (previous[i][1] if previous[i] else 0) for i, r in enumerate(rows)]
        keys = stream_keys([r.request.key_state for r in rows], done, n_keys)
        out.keys[:len(rows)] = keys if decode else keys[:, 0]
        return out

    def _padding(self, n_rows: int, n_tok: int, n_blk: int, decode: bool) -> StepRows:
        """Padding rows of one step shape (prefill steps of vision models carry an embeds array; decode
        dispatches run `decode_steps` steps)."""
        embed_dim = 0 if decode else self._embed_dim
        return StepRows.padding(n_rows, n_tok, n_blk, embed_dim, self.model.dtype,
                                decode_steps=self.config.decode_steps if decode else 0)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled dispatch (a prefill step, or up to `decode_steps` decode steps); returns an output
        for every request that got tokens or finished."""
        return self._step(finished_only=False)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        """`step`; with `finished_only`, outputs are built only for requests that finished (what `generate` uses:
        building every running request's output each dispatch is host time the device waits for).

        With `overlap_decode`, the decode dispatch after this one is launched before this one's tokens are read
        (`Scheduler.plan_ahead`), so the device does not wait for the host in between: after a decode dispatch, and
        after a prefill step that completes every prompt it holds when nothing waits (the new rows' first input is
        the prefill's sample, still on the device). Its rows of requests that stop here are dropped when it is
        read. Dispatches run in order on the device, so blocks and slots that those requests free are rewritten by
        whoever gets them only after it; a prefill's chunks are recorded (KDA snapshots saved) before the dispatch
        ahead is launched, so a snapshot holds the prompt's state, not a later one."""
        if self._ahead is not None:
            plan, (tokens, logprobs) = self._ahead
            self._ahead = None
        else:
            plan = self.scheduler.schedule()
            if plan is None:
                return [self._fail_stuck(r) for r in list(self.scheduler.waiting)]
            tokens, logprobs = self.runner.dispatch(self._rows(plan.rows, plan.decode), plan.decode)
            if not plan.decode:
                for row in plan.rows:
                    self.scheduler.after_prefill_chunk(row)
        if self.config.overlap_decode:
            self._ahead = self._dispatch_ahead(plan, tokens)
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        now = time.perf_counter()
        updates = []
        for i, row in enumerate(plan.rows):
            req = row.request
            if req.status is Status.FINISHED:  # a row launched ahead whose request stopped (or was aborted) since
                continue
            if plan.decode:
                for s in range(row.length):  # tokens past a stop were computed ahead and are dropped
                    self.scheduler.after_decode(req)
                    self._append_token(req, int(tokens[i, s]), float(logprobs[i, s]), now)
                    if req.status is Status.FINISHED:
                        break
            else:
                if req.is_prefilling:  # a chunk short of the prompt's end: no token yet
                    continue
                self._append_token(req, int(tokens[i]), float(logprobs[i]), now)
            if not finished_only or req.status is Status.FINISHED:
                updates.append(self._output(req))
        return updates

    def _dispatch_ahead(self, plan: StepPlan, tokens: jax.Array):
        """Launches the decode dispatch after `plan` (whose sampled tokens, [B, n] for a decode and [B] for a
        prefill, are still on the device), or returns None when it has to wait for them (see
        `Scheduler.plan_ahead`) or, after a decode, has another row bucket."""
        if not plan.decode and not self.config.overlap_prefill:
            return None
        # each row's tokens there: its steps, or a prefill's one (a prompt still prefilling stops the plan anyway)
        pending = [(row.request, row.length if plan.decode else 1) for row in plan.rows]
        rows = self.scheduler.plan_ahead(pending)
        if not rows or (plan.decode and bucket(len(rows), self.decode_buckets) != tokens.shape[0]):
            return None
        there = {id(request): (i, n) for i, (request, n) in enumerate(pending)}  # (its row in `tokens`, its tokens)
        step_rows = self._rows(rows, True, previous=[there.get(id(row.request)) for row in rows])
        return StepPlan(True, rows), self.runner.dispatch(step_rows, True, previous=tokens)

    def _append_token(self, req: Request, token: int, logprob: float, now: float) -> None:
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = now
        else:
            req.token_gaps.append(now - req.last_token_time)
        req.last_token_time = now
        reason, trim = req.stop_checker.check(req.output_token_ids)
        if reason is None and req.num_tokens >= self.config.max_model_len:
            reason = "length"
        if reason is not None:
            del req.output_token_ids[req.stop_checker.num_tokens or len(req.output_token_ids):]
            req.finish_reason, req.text_trim = reason, trim
            self.scheduler.finish(req)

    def _fail_stuck(self, req: Request) -> RequestOutput:
        req.finish_reason, req.error = "error", "the request cannot be scheduled with the cache available"
        self.scheduler.finish(req)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = req.stop_checker.text if req.params.stop else self.tokenizer.decode(req.output_token_ids)
            if req.text_trim is not None:
                text = text[:req.text_trim]
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids), text=text, finished=req.status is Status.FINISHED,
            finish_reason=req.finish_reason, error=req.error,
            logprobs=list(req.output_logprobs[:len(req.output_token_ids)]) if req.params.logprobs else None,
            ttft=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            itl=list(req.token_gaps), num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions)

    # ------------------------------------------------------------------ batch API
    def generate(self, prompts: Sequence[str] | str | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 images: Sequence[Any] | None = None, progress: bool = False) -> list[RequestOutput]:
        """Generates for every prompt (text or token ids); one RequestOutput each, in order. Invalid requests
        come back with finish_reason "error" and the reason in `.error`; the others are unaffected."""
        if isinstance(prompts, str):
            prompts = [prompts]
        entries = [(p, None) for p in prompts] if prompts is not None else [(None, t) for t in prompt_token_ids or []]
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(entries)
        if len(sampling_params) != len(entries):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(entries)} prompts")
        images = list(images) if images is not None else [None] * len(entries)
        if len(images) != len(entries):
            raise ValueError(f"{len(images)} images entries for {len(entries)} prompts")
        order, results = [], {}
        for (text, ids), params, image in zip(entries, sampling_params, images):
            request_id = f"gen-{next(self._ids)}"
            order.append(request_id)
            try:
                self.add_request(text, ids, params, request_id, images=_image_list(image))
            except RequestError as e:
                results[request_id] = RequestOutput(request_id, text, list(ids) if ids is not None else [], [],
                                                    None, True, "error", str(e))
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(order), desc="generating", unit="req")
        while any(rid not in results for rid in order):
            for out in self._step(finished_only=True):
                if out.finished and out.request_id in order:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        for rid in order:
            self._requests.pop(rid, None)
        return [results[rid] for rid in order]

    def stream(self, prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
               sampling_params: SamplingParams | None = None, images: Sequence[Any] | None = None
               ) -> Iterator[RequestOutput]:
        """Yields the request's output after every new token (other queued requests advance meanwhile)."""
        request_id = self.add_request(prompt, prompt_token_ids, sampling_params, f"stream-{next(self._ids)}",
                                      images=images)
        try:
            while True:
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(request_id)
            self._requests.pop(request_id, None)

    def warmup(self) -> int:
        """Compiles every bucketed prefill and decode shape now (rows of padding only: nothing is written but the
        scratch block and slot), decode shapes in their all-greedy and sampling variants and for every step count a
        dispatch may run (`trim_decode_steps`: 1 to `decode_steps`), the layout of each prefill bucket's tokens for
        each decode bucket (`overlap_prefill`), and the KDA slot and snapshot functions (compiled, not run), so
        serving never compiles. Returns how many of them this engine had not needed yet."""
        before = self.runner.num_compilations
        shapes = [(False, r, t, b) for r in self.prefill_row_buckets for t in self.prefill_len_buckets
                  for b in self.block_buckets]
        shapes += [(True, r, 1, b) for r in self.decode_buckets for b in self.block_buckets]
        counts = self.runner.decode_step_counts(self.config.decode_steps)
        for decode, n_rows, n_tok, n_blk in shapes:
            variants = [(s, n) for s in (False, True) for n in counts] if decode else [(False, 0)]
            for sampled, n_steps in variants:  # decode: all-greedy and sampling, each step count
                rows = self._padding(n_rows, n_tok, n_blk, decode)
                rows.temperature[0] = 1.0 if sampled else 0.0
                if decode:
                    rows.steps[0] = n_steps  # a padding row (invalid): only the dispatch's step count follows it
                self.runner.run(rows, decode)
        if self.config.overlap_decode and self.config.overlap_prefill:  # a decode launched ahead of a prefill's tokens
            for n_prefill in self.prefill_row_buckets:
                for n_rows in self.decode_buckets:
                    self.runner.warm_prefill_as_previous(n_prefill, (n_rows, self.config.decode_steps))
        self.runner.warm_slot_functions()
        return self.runner.num_compilations - before

    # ------------------------------------------------------------------ introspection
    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        return {"num_compilations": self.num_compilations, "blocks_total": s.pool.num_usable,
                "blocks_free": s.pool.num_free, "blocks_cached": s.cache.num_cached_blocks,
                "slots_free": s.slots.num_free, "running": len(s.running), "waiting": len(s.waiting),
                "prefix_hit_rate": s.cache.stats.hit_rate, "cache_bytes": self.cache_bytes}


def _image_list(image) -> list | None:
    """One prompt's `images` entry for add_request: None, one image, or a list of images."""
    if image is None:
        return None
    return list(image) if isinstance(image, (list, tuple)) else [image]
