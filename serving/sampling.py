"""Sampling: per-request parameters, a jittable batched sampler, reproducible per-request keys, stop checks.

Device side: `sample` turns fp32 logits [B, V] and per-row parameter arrays into token ids (one jitted call for a
batch whose rows all have different settings). Host side: `SamplingParams` (validated per request),
`request_key` / `request_keys` (the PRNG key of one request at one step, independent of batch composition) and
`StopChecker` (finish reasons and where to cut the text, checked incrementally).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dayzero.model.errors import RequestError

__all__ = [
    "GREEDY_EPS",
    "KEY_IMPL",
    "SamplingParams",
    "StopChecker",
    "key_stream",
    "request_key",
    "request_keys",
    "stream_keys",
    "sample",
]

GREEDY_EPS = 1e-5
"""Rows with temperature below this are greedy (vLLM's threshold; avoids overflow from dividing by ~0)."""

KEY_IMPL = "threefry2x32"
"""PRNG implementation of the raw key data `sample` takes: uint32 [B, 2] per row."""


# --------------------------------------------------------------------------------------------------- parameters
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _as_tuple(value, scalar_types):
    """None -> (); a lone scalar -> (scalar,); any other iterable -> tuple; anything else is kept for validate()."""
    if value is None:
        return ()
    if isinstance(value, scalar_types):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        return value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM names and defaults).

    temperature: 0 (anything < GREEDY_EPS) means greedy. top_k: -1 or 0 = off. top_p: nucleus mass in (0, 1].
    min_p: drop tokens whose probability is below min_p * the top token's. max_tokens: generated tokens at most.
    stop_token_ids / stop: token ids / strings that end the request (lists and lone values are accepted and
    stored as tuples). ignore_eos: keep going past the model's eos ids. seed: per-request seed (None = the
    engine's own randomness). logprobs: return the chosen token's log-probability.
    Construction does not check values; call `validate(request_id)`.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop", _as_tuple(self.stop, (str, bytes)))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, (int, np.integer)))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self, request_id: str | int | None = None) -> SamplingParams:
        """Returns self, or raises RequestError(request_id, ...) naming the first bad field."""

        def bad(field: str, message: str):
            raise RequestError(request_id, f"sampling parameter '{field}' {message}")

        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", f"must be an integer >= -1 (-1 or 0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop_token_ids, tuple):
            bad("stop_token_ids", f"must be a sequence of token ids, got {self.stop_token_ids!r}")
        for i in self.stop_token_ids:
            if not _is_int(i) or i < 0:
                bad("stop_token_ids", f"must hold non-negative integer token ids, got {i!r}")
        if not isinstance(self.stop, tuple):
            bad("stop", f"must be a sequence of strings, got {self.stop!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", f"must hold non-empty strings, got {s!r}")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", f"must be an integer or None, got {self.seed!r}")
        return self


# ------------------------------------------------------------------------------------------------------ sampler
def sample(logits, temperature, top_k, top_p, min_p, keys, all_greedy: bool | None = None):
    """Samples one token per row; jittable, every setting a per-row array.

    logits f32[B, V] (other float dtypes are cast to f32); temperature f32[B] (< GREEDY_EPS = greedy argmax);
    top_k i32[B] (<= 0 = off); top_p f32[B] in (0, 1]; min_p f32[B] in [0, 1]; keys uint32[B, 2] raw
    threefry2x32 key data (see `request_key`), or a typed key array [B].
    Sampled rows: logits / temperature, then top-k, then top-p on the top-k-renormalised distribution (the
    smallest set of top tokens whose mass >= top_p), then min-p (drop p < min_p * p_max); the top token is always
    kept. One full sort per row (`lax.top_k` with k = V, ties lower id first like argmax), then
    `jax.random.categorical` with the row's own key, so a row's token depends only on its logits, settings and
    key, never on other rows. `all_greedy` (static) says whether every row is greedy: True runs argmax only, False
    the sampling path for every row (greedy rows take the argmax); None decides on the device, skipping the sort
    when every row is greedy. That is a conditional, which a GPU runs by waiting for its predicate on the host:
    fine once per prefill step, not inside decode steps (the engine passes True or False there).

    Returns (token_ids i32[B], logprobs f32[B]). The logprob is that of the chosen token under the *unmodified*
    model distribution, log_softmax(logits) (before temperature and filters), as vLLM reports by default.
    """
    logits = jnp.asarray(logits, jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature < GREEDY_EPS
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        return jnp.where(greedy, greedy_ids, _sample_filtered(logits, temperature, top_k, top_p, min_p, keys))

    if all_greedy is None:
        ids = jax.lax.cond(jnp.all(greedy), lambda: greedy_ids, sampled)
    else:
        ids = greedy_ids if all_greedy else sampled()
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), ids[:, None], axis=-1)[:, 0]
    return ids, logprobs


def _sample_filtered(logits, temperature, top_k, top_p, min_p, keys):
    """Token ids i32[B] sampled after temperature, top-k, top-p and min-p (greedy rows give garbage)."""
    b, v = logits.shape
    temperature = jnp.where(temperature < GREEDY_EPS, 1.0, temperature)[:, None]
    top_k = jnp.asarray(top_k, jnp.int32)[:, None]
    top_p = jnp.asarray(top_p, jnp.float32)[:, None]
    min_p = jnp.asarray(min_p, jnp.float32)[:, None]

    rank = jax.lax.broadcasted_iota(jnp.int32, (b, v), 1)
    scaled, order = jax.lax.top_k(logits / temperature, v)  # descending, ties lower id first; order[:, r] = id
    rel = jnp.exp(scaled - scaled[:, :1])  # p / p_max, in [0, 1]

    keep = rank < jnp.where(top_k <= 0, v, top_k)
    mass = jnp.where(keep, rel, 0.0)
    cum = jnp.cumsum(mass, axis=1)
    keep &= ((cum - mass) < top_p * cum[:, -1:]) | (top_p >= 1.0)  # mass strictly before this rank < top_p
    keep &= rel >= min_p  # ratios survive renormalisation, so min-p after top-k/top-p is min-p on p_max
    keep |= rank == 0
    masked = jnp.where(keep, scaled, -jnp.inf)

    keys = jnp.asarray(keys) if _is_typed_key(keys) else jax.random.wrap_key_data(
        jnp.asarray(keys, jnp.uint32), impl=KEY_IMPL)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.take_along_axis(order, choice[:, None].astype(jnp.int32), axis=1)[:, 0]


def _is_typed_key(keys) -> bool:
    return hasattr(keys, "dtype") and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)


# --------------------------------------------------------------------------------------------------------- keys
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_UNSEEDED = 0x6A09E667F3BCC909  # domain tag: keys of unseeded requests never follow a seeded stream by design


def _mix64(x):
    """splitmix64's finaliser (a bijection on 64-bit ints): a Python int, or a uint64 numpy array (element-wise,
    wrapping modulo 2**64; call it under np.errstate(over="ignore"))."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def key_stream(seed: int | None, request_index: int) -> int:
    """The 64-bit splitmix64 state a request's keys derive from (see `request_key`): fixed for the request."""
    if seed is None:
        return _mix64(_mix64(int(request_index) & _MASK64) ^ _UNSEEDED)
    return _mix64(int(seed) & _MASK64)


def stream_keys(streams: Sequence[int], first_steps: Sequence[int], n: int) -> np.ndarray:
    """`request_key` for n consecutive steps of each row: row b's keys at steps first_steps[b] .. + n - 1 of
    stream streams[b] (`key_stream`) -> uint32 [B, n, 2]. Vectorised in uint64 numpy (wrapping modulo 2**64, as
    splitmix64 wants) for large batches; small ones stay in Python, where numpy's per-call cost would dominate."""
    if len(streams) * n <= 32:
        out = np.empty((len(streams), n, 2), np.uint32)
        for b, (state, first) in enumerate(zip(streams, first_steps)):
            for s in range(n):
                h = _mix64((state + (int(first) + s + 1) * _GOLDEN) & _MASK64)
                out[b, s] = h >> 32, h & 0xFFFFFFFF
        return out
    with np.errstate(over="ignore"):
        steps = np.asarray(first_steps, np.uint64)[:, None] + np.arange(1, n + 1, dtype=np.uint64)
        x = _mix64(np.asarray(streams, np.uint64)[:, None] + steps * np.uint64(_GOLDEN))
    return np.stack([(x >> 32).astype(np.uint32), (x & 0xFFFFFFFF).astype(np.uint32)], -1)


def request_key(seed: int | None, request_index: int, step: int) -> np.ndarray:
    """The raw key data uint32[2] (threefry2x32) of one request at one decode step; pure Python, ~1 us.

    `step` counts the request's generated tokens (0 for the first). With a `seed`, the key depends on (seed,
    step) only, so the same seed gives the same tokens whatever the batch, slot or arrival order (and two
    requests with the same seed get the same stream, as in vLLM). With seed=None, `request_index` is the
    caller's per-request entropy (e.g. a random 63-bit number drawn once per request, or a request counter
    mixed with an engine seed picked at start-up) and must differ between requests.
    The key is the `step`-th output of a splitmix64 stream whose state derives from the seed (`key_stream`),
    split into (high, low) 32-bit words. Python ints of any sign are taken modulo 2**64.
    """
    h = _mix64((key_stream(seed, request_index) + (int(step) + 1) * _GOLDEN) & _MASK64)
    return np.array([h >> 32, h & 0xFFFFFFFF], dtype=np.uint32)


def request_keys(seeds: Sequence[int | None], request_indices: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """`request_key` for each row of a batch: uint32[B, 2], ready for `sample`."""
    rows = [request_key(s, i, t) for s, i, t in zip(seeds, request_indices, steps, strict=True)]
    return np.stack(rows) if rows else np.zeros((0, 2), np.uint32)


# --------------------------------------------------------------------------------------------------------- stop
class StopChecker:
    """Decides when one request is finished and what its text is; host side, one per request.

    `check(generated_token_ids)` is called after every step with all the request's generated ids so far (a list
    that grows; several new ids at once are fine, each is checked in order). It returns (finish_reason,
    text_trim): finish_reason is "stop" (last id is a stop id, or an eos id unless ignore_eos, or the text now
    contains a stop string), "length" (max_tokens ids generated), or None. Stop wins over length on the same
    token. text_trim is None unless the request stopped and a `decode` was given: then the output text is
    decode(generated[:num_tokens])[:text_trim], i.e. cut before the stop string, or without the stop/eos
    token's own text (vLLM's defaults). `text` holds the output text so far (final once finished),
    `stop_reason` the matched stop id or string, `num_tokens` the ids consumed up to the finish (ids past it
    are not part of the output).

    Incremental: each new id is decoded in a short window (the previous step's ids as left context, the way
    vLLM/TGI detokenise; text ending in an incomplete UTF-8 char, U+FFFD, is held back), appended to `text`,
    and stop strings are searched only in the new text plus the last max(len(stop)) - 1 characters before it,
    so matches spanning token boundaries are found. Once, at the finish, the output is decoded in full, so
    `text` and text_trim agree exactly with `decode` even for tokenizers whose piecewise decoding differs
    slightly from a full decode. A list that is not an extension of the previous call's (shorter, or a
    different id at the last checked position) restarts from scratch.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] | int | None = (),
                 decode: Callable[[Sequence[int]], str] | None = None, request_id: str | int | None = None):
        eos = _as_tuple(eos_token_ids, (int, np.integer))
        self.max_tokens = params.max_tokens
        self._stop_ids = frozenset(int(i) for i in params.stop_token_ids)
        self._eos_ids = frozenset() if params.ignore_eos else frozenset(int(i) for i in eos)
        self._stop_strs = tuple(params.stop)
        if self._stop_strs and decode is None:
            raise RequestError(request_id, "sampling parameter 'stop' (stop strings) needs a tokenizer to decode "
                                           "text, and none is loaded")
        self._overlap = max((len(s) for s in self._stop_strs), default=1) - 1
        self._decode = decode
        self.reset()

    def reset(self) -> None:
        """Forgets all progress (the next `check` starts from its first id)."""
        self.text = ""
        self.stop_reason: int | str | None = None
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self._last = None
        self._prefix = 0  # ids[_prefix:_read] are the decoded left context
        self._read = 0  # ids[:_read] are in `text`
        self._trim: int | None = None

    def check(self, generated_token_ids: Sequence[int]) -> tuple[str | None, int | None]:
        ids = generated_token_ids
        n = len(ids)
        if n < self.num_tokens or (self.num_tokens and ids[self.num_tokens - 1] != self._last):
            self.reset()
        while self.finish_reason is None and self.num_tokens < n:
            self._consume(ids, self.num_tokens)
        return self.finish_reason, self._trim

    # -- internals
    def _consume(self, ids: Sequence[int], i: int) -> None:
        """Checks id i (ids[:i] already consumed)."""
        tok = ids[i]
        self.num_tokens, self._last = i + 1, tok
        if int(tok) in self._stop_ids or int(tok) in self._eos_ids:
            self._finish("stop", int(tok), ids, i)  # the stop id's own text is left out
        elif self._decode is not None and (hit := self._append(self._decode_window(ids, i + 1))) is not None:
            self._finish("stop", hit, ids, i + 1)
        elif i + 1 >= self.max_tokens:
            self._finish("length", None, ids, i + 1)

    def _decode_window(self, ids: Sequence[int], end: int) -> str:
        """New text of ids[_read:end], decoded with ids[_prefix:_read] as context; '' while incomplete."""
        context = self._decode(list(ids[self._prefix:self._read])) if self._read > self._prefix else ""
        full = self._decode(list(ids[self._prefix:end]))
        if len(full) > len(context) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, end
            return full[len(context):]
        return ""

    def _append(self, new: str) -> str | None:
        """Appends new text; returns the stop string now in `text` (earliest one), if any."""
        if not new or not self._stop_strs:
            self.text += new
            return None
        start = max(0, len(self.text) - self._overlap)
        self.text += new
        hits = [(pos, s) for s in self._stop_strs if (pos := self.text.find(s, start)) >= 0]
        return min(hits, key=lambda h: h[0])[1] if hits else None

    def _finish(self, reason: str, stop_reason, ids: Sequence[int], end: int) -> None:
        """Final text from one full decode of ids[:end]: cut before its earliest stop string, if any."""
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self._decode is None:
            return
        full = self._decode(list(ids[:end]))
        hits = [(pos, s) for s in self._stop_strs if (pos := full.find(s)) >= 0]
        if hits:  # also a stop string only visible in held-back text, or found at another offset in `full`
            pos, s = min(hits, key=lambda h: h[0])
            self.finish_reason, self.stop_reason, self.text, self._trim = "stop", s, full[:pos], pos
        elif isinstance(stop_reason, str):  # piecewise decoding saw a stop string the full decode lacks
            self._trim = self.text.find(stop_reason)
            self.text = full[:self._trim]
        else:
            self.text = full
            self._trim = len(full) if reason == "stop" else None
