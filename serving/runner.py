"""The device side of the engine: cache arrays, KDA state snapshots, and the jitted prefill and decode steps.

Prefill and decode are separate jitted functions (prefill: many tokens per row, chunked KDA and batched attention;
decode: one token per row and step, recurrent KDA, several steps per dispatch so host work overlaps less often). Each is compiled once per bucketed shape (rows, tokens, blocks per row)
with the cache donated, and samples the next token on the device. `num_compilations` counts the shapes compiled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dayzero import platforms
from dayzero.kernels import dispatch
from dayzero.model import sharding
from dayzero.model.cache import cache_shapes
from dayzero.model.config import LAYER_KDA
from dayzero.model.model import Model

from . import sampling


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n (buckets ascending)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def powers_of_two(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    """low, factor*low, ... up to and including the first value >= high."""
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * factor)
    return tuple(out)


@dataclass
class StepRows:
    """Host-side arrays of one step, already padded to the bucket: tokens/positions/valid [B, T], block_tables
    [B, NB], slots [B], the sampling arrays [B] (keys [B, 2]) and, for prefill steps of vision models, embeds
    [B, T, D] used where embeds_mask [B, T] (image features at their placeholder tokens)."""

    tokens: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    block_tables: np.ndarray
    slots: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    keys: np.ndarray
    embeds: np.ndarray | None = None
    embeds_mask: np.ndarray | None = None
    steps: np.ndarray | None = None  # decode: tokens each row may generate in this dispatch [B] (keys [B, n, 2])
    feed: np.ndarray | None = None  # decode [B]: flat index of row b's input token in `previous`, or -1

    @classmethod
    def padding(cls, n_rows: int, n_tokens: int, n_blocks: int, embed_dim: int = 0,
                embed_dtype=np.float32, decode_steps: int = 0) -> "StepRows":
        """Rows of padding only (invalid tokens, scratch block and slot, greedy); callers fill real rows in.
        `embed_dim` > 0 adds zeroed embeds [B, T, embed_dim] (and an all-False embeds_mask); `decode_steps` > 0
        makes a multi-step decode dispatch (keys [B, decode_steps, 2], steps [B] all 0, feed [B] all -1)."""
        embeds = np.zeros((n_rows, n_tokens, embed_dim), embed_dtype) if embed_dim else None
        return cls(tokens=np.zeros((n_rows, n_tokens), np.int32), positions=np.zeros((n_rows, n_tokens), np.int32),
                   valid=np.zeros((n_rows, n_tokens), bool), block_tables=np.zeros((n_rows, n_blocks), np.int32),
                   slots=np.zeros((n_rows,), np.int32), temperature=np.zeros((n_rows,), np.float32),
                   top_k=np.full((n_rows,), -1, np.int32), top_p=np.ones((n_rows,), np.float32),
                   min_p=np.zeros((n_rows,), np.float32),
                   keys=np.zeros((n_rows, decode_steps, 2) if decode_steps else (n_rows, 2), np.uint32),
                   embeds=embeds, embeds_mask=np.zeros((n_rows, n_tokens), bool) if embed_dim else None,
                   steps=np.zeros((n_rows,), np.int32) if decode_steps else None,
                   feed=np.full((n_rows,), -1, np.int32) if decode_steps else None)


# StepRows fields that travel to the device packed in one int32 array (one transfer instead of one per field: the
# host's share of a dispatch). The step functions read them through XLA ops only; block_tables, slots and positions,
# which Pallas kernels take as operands, and embeds travel as they are (a slice of a packed buffer handed to a
# kernel may cost a copy kernel).
PACKED_FIELDS = ("tokens", "valid", "temperature", "top_k", "top_p", "min_p", "keys", "steps", "feed", "embeds_mask")
_WORD = np.dtype(np.int32)


def pack_rows(rows: StepRows) -> tuple[dict[str, np.ndarray | None], tuple]:
    """-> (the arrays a step takes: "packed" int32 [N] holding every `PACKED_FIELDS` array that is not None, 4-byte
    ones bit for bit and booleans as 0 / 1, and the other fields as they are; the packing's layout, a hashable
    ((name, shape, dtype), ...) that `unpack_rows` takes as a static argument)."""
    layout, words = [], []
    for name in PACKED_FIELDS:
        value = getattr(rows, name)
        if value is None:
            continue
        if value.dtype == bool:
            words.append(value.astype(_WORD))
        elif value.dtype.itemsize == 4:
            words.append(np.ascontiguousarray(value).view(_WORD))
        else:
            raise TypeError(f"step input {name} is {value.dtype}: only 4-byte and boolean fields are packed")
        layout.append((name, value.shape, value.dtype.str))
    arrays = {name: value for name, value in vars(rows).items() if name not in PACKED_FIELDS}
    arrays["packed"] = np.concatenate([w.reshape(-1) for w in words])  # (tokens are always there)
    return arrays, tuple(layout)


def unpack_rows(arrays: dict, layout: tuple) -> dict:
    """`pack_rows`' arrays (traced) -> every StepRows field by name (the packed ones None where they were None)."""
    rows = {name: None for name in PACKED_FIELDS}
    rows.update({name: value for name, value in arrays.items() if name != "packed"})
    at = 0
    for name, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64))
        words = arrays["packed"][at:at + size].reshape(shape)
        at += size
        dtype = np.dtype(dtype)
        rows[name] = (words != 0 if dtype == bool else words if dtype == _WORD
                      else jax.lax.bitcast_convert_type(words, dtype))
    return rows


def _step(module, params, cache, arrays: dict, layout: tuple, decode: bool):
    rows = unpack_rows(arrays, layout)
    logits, cache = module.apply({"params": params}, rows["tokens"], rows["positions"], rows["valid"], cache,
                                 rows["block_tables"], rows["slots"], decode, rows["embeds"], rows["embeds_mask"],
                                 method="step")
    tokens, logprobs = sampling.sample(logits, rows["temperature"], rows["top_k"], rows["top_p"], rows["min_p"],
                                       rows["keys"])
    return tokens, logprobs, cache


def _decode(module, params, cache, arrays: dict, layout: tuple, previous, all_greedy: bool, unrolled: bool = False,
            n_steps: int | None = None):
    """`n_steps` (static; None: all n = keys.shape[1]) decode steps in one dispatch: each step samples a token that
    is the next step's input. Row b runs rows["steps"][b] <= n_steps of them; its later steps are padding (no cache or
    state change), and the columns past `n_steps` of the outputs are zeros. Row b's first
    input is previous.reshape(-1)[feed[b]] where feed[b] >= 0 (previous: an earlier decode dispatch's tokens
    [B, n] int32, still on the device), else tokens[b, 0]. `all_greedy` (static): every row is greedy, so no
    sampling path is compiled in. `unrolled` (static): the n steps as straight-line code instead of a loop (no XLA
    while loop: on a GPU, one launch of the whole dispatch rather than the loop body's kernels launched from the host
    each step; compiles about n_steps times the code). `arrays`, `layout`: the rows as `pack_rows` sends them.
    Returns (tokens [B, n], logprobs [B, n], cache): n columns whatever `n_steps`, so the next dispatch's `previous`
    has one shape."""
    rows = unpack_rows(arrays, layout)

    def one(carry, xs):
        cache, tokens, positions = carry
        index, keys = xs
        valid = rows["valid"] & (index < rows["steps"])[:, None]
        logits, cache = module.apply({"params": params}, tokens, positions, valid, cache, rows["block_tables"],
                                     rows["slots"], True, None, None, method="step")
        new, logprobs = sampling.sample(logits, rows["temperature"], rows["top_k"], rows["top_p"], rows["min_p"],
                                        keys, all_greedy)
        return (cache, new[:, None].astype(tokens.dtype), positions + 1), (new, logprobs)

    n = rows["keys"].shape[1]
    n_steps = n if n_steps is None else n_steps
    fed = previous.reshape(-1)[jnp.maximum(rows["feed"], 0)].astype(rows["tokens"].dtype)
    first = jnp.where((rows["feed"] >= 0)[:, None], fed[:, None], rows["tokens"])
    xs = (jnp.arange(n_steps, dtype=jnp.int32), jnp.swapaxes(rows["keys"][:, :n_steps], 0, 1))
    (cache, _, _), (tokens, logprobs) = jax.lax.scan(one, (cache, first, rows["positions"]), xs, unroll=unrolled)
    pad = ((0, 0), (0, n - n_steps))
    return jnp.pad(tokens.T, pad), jnp.pad(logprobs.T, pad), cache


def _prefill_as_previous(tokens, shape: tuple[int, int]):
    """A prefill step's sampled tokens [P] int32 laid out as a decode dispatch's `previous` [B, n] int32: token p at
    [p, 0] (the rows past B are padding: a prefill feeding a decode dispatch has no more real rows than it)."""
    rows = min(tokens.shape[0], shape[0])
    return jnp.zeros(shape, jnp.int32).at[:rows, 0].set(tokens[:rows].astype(jnp.int32))


def _reset(cache, slots):
    return {k: v.at[:, slots].set(0) if k in ("conv", "state") else v for k, v in cache.items()}


def _save(cache, snaps, slot, snap):
    return {k: snaps[k].at[:, snap].set(cache[k][:, slot]) for k in snaps}


def _restore(cache, snaps, slot, snap):
    return {k: v.at[:, slot].set(snaps[k][:, snap]) if k in snaps else v for k, v in cache.items()}


# Module-level jits: engines over equal modules (same config and dtype) share compiled steps.
_STEP = dispatch.PlatformJit(_step, static_argnums=(0, 4, 5), donate_argnums=(2,))
_DECODE = dispatch.PlatformJit(_decode, static_argnums=(0, 4, 6, 7, 8), donate_argnums=(2,))
_PREFILL_AS_PREVIOUS = jax.jit(_prefill_as_previous, static_argnums=(1,))
_RESET = jax.jit(_reset, donate_argnums=(0,))
_SAVE = jax.jit(_save, donate_argnums=(1,))
_RESTORE = jax.jit(_restore, donate_argnums=(0,))


def _zeros(config, shapes: dict[str, tuple[tuple[int, ...], Any]], mesh) -> dict[str, jax.Array]:
    """Zeroed arrays {name: (shape, dtype)}: on the default device, or with a `mesh` created straight on their
    `sharding.CACHE_RULES` shardings (no device ever holds a whole sharded array)."""
    if mesh is None:
        return {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}
    placements = sharding.cache_shardings(config, mesh, {name: shape for name, (shape, _) in shapes.items()})
    return {name: jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=placements[name])()
            for name, (shape, dtype) in shapes.items()}


UNROLLED_PLATFORMS = ("cuda", "rocm")  # where a decode dispatch's steps compile unrolled by default


def unrolled_by_default(platform: str) -> bool:
    """Whether decode dispatches on `platform` (as JAX names it: its "gpu" alias resolved by
    `dispatch.canonical_platform`) compile their steps unrolled when the engine option is None. On XLA:GPU a scan's
    while loop runs from the host, launching the body's command buffers step by step, and unrolled the H200 decodes
    faster at every batch (benchmarks/NOTES_serving.md, thirty-third session); XLA:CPU copies the conv and latent
    caches more often in the unrolled program and compiles it several times longer."""
    return dispatch.canonical_platform(platform) in UNROLLED_PLATFORMS


class ModelRunner:
    """Owns the cache (and snapshot) arrays of one model and runs steps on them. For a model on a mesh
    (`Model.mesh`), the cache and snapshots live on their `sharding.CACHE_RULES` shardings (KDA heads over
    `tensor`; latents and indexer keys replicated) and the step inputs are replicated over the mesh.
    `unrolled_decode`: decode dispatches compiled as straight-line steps (`_decode`'s `unrolled`); None: where the
    model runs on a GPU (`unrolled_by_default`). `trim_decode_steps`: a decode dispatch runs as many steps as its
    longest row takes (`dispatch_steps`; each count compiled apart), not always all its keys' steps."""

    def __init__(self, model: Model, num_blocks: int, num_slots: int, num_snapshots: int, block_size: int = 64,
                 unrolled_decode: bool | None = None, trim_decode_steps: bool = True):
        self.model = model
        self.block_size = block_size
        self.trim_decode_steps = trim_decode_steps
        self.unrolled_decode = (unrolled_by_default(model.platform) if unrolled_decode is None
                                else unrolled_decode)
        self.has_kda = LAYER_KDA in model.config.layer_types
        self.snapshots = {}
        with platforms.activate(model.placement):  # the cache lives on the model's device (or its mesh)
            shapes = cache_shapes(model.config, num_blocks, num_slots, model.dtype, block_size)
            self.cache = _zeros(model.config, shapes, model.mesh)
            if self.has_kda and num_snapshots > 0:
                self.snapshots = _zeros(model.config, {k: ((s[0], num_snapshots, *s[2:]), dt)
                                                       for k, (s, dt) in shapes.items() if k in ("conv", "state")},
                                        model.mesh)
        self._inputs = None if model.mesh is None else NamedSharding(model.mesh, PartitionSpec())
        self._shapes: set[tuple] = set()
        self._no_previous: dict[tuple[int, int], jax.Array] = {}  # zeros standing in for `previous`, by shape

    @property
    def num_compilations(self) -> int:
        """Distinct (kind, shape) functions this runner has needed (each compiled once per process): the steps, the
        layouts of a prefill's tokens for a decode launched ahead, and the KDA slot and snapshot functions."""
        return len(self._shapes)

    def run(self, rows: StepRows, decode: bool) -> tuple[np.ndarray, np.ndarray]:
        """One dispatch; returns (sampled token ids, their logprobs) as numpy: [B] for prefill, [B, n] for a
        decode of n steps. This waits for the device."""
        tokens, logprobs = self.dispatch(rows, decode)
        return np.asarray(tokens), np.asarray(logprobs)

    def dispatch(self, rows: StepRows, decode: bool, previous: jax.Array | None = None):
        """Launches one dispatch and returns device arrays without waiting (JAX dispatch is asynchronous).
        `previous` (decode): the sampled tokens of the dispatch just before, still on the device, which `rows.feed`
        indexes: a decode dispatch's [B, n] of this one's shape, or a prefill step's [P] (token p read as [p, 0])."""
        steps = self.dispatch_steps(rows) if decode else 0
        greedy = decode and bool(np.all(rows.temperature < sampling.GREEDY_EPS))  # decode compiles both variants
        self._shapes.add(("decode" if decode else "prefill", rows.tokens.shape, rows.block_tables.shape[1],
                          rows.keys.shape[1] if decode else 0, steps, greedy))
        with platforms.activate(self.model.placement):  # the model's device in use: dispatch picks its kernels
            arrays, layout = pack_rows(rows)
            arrays = jax.device_put(arrays, self._inputs)  # None stays None
            if decode:
                previous = self._previous(previous, rows.keys.shape[:2])
                tokens, logprobs, self.cache = _DECODE(self.model.module, self.model.params, self.cache, arrays,
                                                       layout, previous, greedy, self.unrolled_decode, steps)
            else:
                tokens, logprobs, self.cache = _STEP(self.model.module, self.model.params, self.cache, arrays,
                                                     layout, False)
        return tokens, logprobs

    def decode_step_counts(self, decode_steps: int) -> tuple[int, ...]:
        """The step counts a decode dispatch of `decode_steps` keys may run (`dispatch_steps`), each compiled apart:
        1 to `decode_steps` with `trim_decode_steps`, else `decode_steps` alone."""
        return tuple(range(1, decode_steps + 1)) if self.trim_decode_steps else (decode_steps,)

    def dispatch_steps(self, rows: StepRows) -> int:
        """The steps a decode dispatch of `rows` runs: all n of its keys [B, n, 2], or with `trim_decode_steps` as
        many as its longest row takes (`rows.steps`; at least 1). The steps past that would be padding in every
        row, each costing a whole step of the device: a request's last dispatch often has fewer tokens to make."""
        n = rows.keys.shape[1]
        return min(max(int(rows.steps.max(initial=0)), 1), n) if self.trim_decode_steps else n

    def _previous(self, previous: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
        """`previous` for a decode dispatch of `shape` [B, n]: zeros where there is none, a prefill's [P] tokens
        laid out as [B, n] (one small function per (P, B, n), counted in `num_compilations`)."""
        if previous is None:
            if shape not in self._no_previous:
                self._no_previous[shape] = jax.device_put(np.zeros(shape, np.int32), self._inputs)
            return self._no_previous[shape]
        if self._inputs is not None:  # placed as the step inputs are (as `warm_prefill_as_previous` compiled it)
            previous = jax.device_put(previous, self._inputs)
        if previous.ndim == 1:
            self._shapes.add(("prefill_as_previous", previous.shape[0], shape))
            return _PREFILL_AS_PREVIOUS(previous, shape)
        if previous.shape != shape:
            raise ValueError(f"previous tokens {previous.shape} do not match this dispatch's {shape}")
        return previous

    def warm_prefill_as_previous(self, prefill_rows: int, shape: tuple[int, int]) -> None:
        """Compiles the layout of a prefill's [prefill_rows] tokens as a decode dispatch's [B, n] `previous`."""
        with platforms.activate(self.model.placement):
            tokens = jax.device_put(np.zeros((prefill_rows,), np.int32), self._inputs)
            self._previous(tokens, shape).block_until_ready()

    def reset_slots(self, slots: list[int]) -> None:
        """Zeroes the KDA states of `slots` (a request starting from scratch)."""
        for slot in slots if self.has_kda else ():
            self._shapes.add(("slot_reset",))
            with platforms.activate(self.model.placement):
                self.cache = _RESET(self.cache, np.asarray([slot], np.int32))

    def save_snapshot(self, slot: int, snapshot: int) -> None:
        self._shapes.add(("snapshot_save",))
        with platforms.activate(self.model.placement):
            self.snapshots = _SAVE(self.cache, self.snapshots, np.int32(slot), np.int32(snapshot))

    def restore_snapshot(self, snapshot: int, slot: int) -> None:
        self._shapes.add(("snapshot_restore",))
        with platforms.activate(self.model.placement):
            self.cache = _RESTORE(self.cache, self.snapshots, np.int32(slot), np.int32(snapshot))

    def warm_slot_functions(self) -> None:
        """Compiles `reset_slots`, `save_snapshot` and `restore_snapshot` (those a model without KDA layers or
        snapshots never calls are left out) without running them: nothing changes in the cache or snapshots. Like
        every call here, under the model's placement (its default device is part of jit's cache key)."""
        if not self.has_kda:
            return
        slot, index = np.zeros((1,), np.int32), np.int32(0)
        with platforms.activate(self.model.placement):
            self._shapes.add(("slot_reset",))
            _RESET.lower(self.cache, slot).compile()
            if self.snapshots:
                self._shapes.update({("snapshot_save",), ("snapshot_restore",)})
                _SAVE.lower(self.cache, self.snapshots, index, index).compile()
                _RESTORE.lower(self.cache, self.snapshots, index, index).compile()
