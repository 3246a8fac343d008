"""Kimi Delta Attention: `chunk_kda` (prefill), `fused_recurrent_kda` (decode) and `fused_recurrent_kda_slots`
(decode on a state pool, in place), flash-linear-attention semantics.

Layout [B, T, H, K]; `g` the per-channel log-decay (already activated); state [B, H, K, V] float32. All return
`(o, final_state)` (`final_state` None unless `output_final_state`); `chunk_kda` with `output_chunk_states` adds the
state after every 64-token chunk. `lengths` [B] makes rows of different lengths one call. Which implementation runs
is `dispatch.choose`'s decision: the Pallas kernels (`pallas`) on CUDA/ROCm, the plain-jnp `reference` elsewhere,
`impl="interpret"` for the Pallas code on CPU.
"""

from __future__ import annotations

from .. import dispatch
from . import pallas, reference

_AVAILABLE = ("reference", "pallas")


def _pick(name: str, impl: str | None):
    """(function, extra kwargs) of the chosen implementation of op `name`."""
    choice = dispatch.choose("kda", _AVAILABLE, impl)
    if choice == "reference":
        return getattr(reference, name), {}
    return getattr(pallas, name), {"interpret": choice == "interpret"}


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, lengths=None, output_chunk_states=False, impl: str | None = None):
    """Chunked KDA over whole sequences (prefill). See `reference.chunk_kda` for the math."""
    kernel, extra = _pick("chunk_kda", impl)
    return kernel(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lengths=lengths,
                  output_chunk_states=output_chunk_states, **extra)


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, lengths=None, impl: str | None = None):
    """Token-by-token KDA (decode). See `reference.fused_recurrent_kda`."""
    kernel, extra = _pick("fused_recurrent_kda", impl)
    return kernel(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lengths=lengths, **extra)


def fused_recurrent_kda_slots(q, k, v, g, beta, state_pool, slots, layer: int = 0, scale=None,
                              use_qk_l2norm_in_kernel=False, lengths=None, impl: str | None = None):
    """Decode on a state pool [L, S, H, K, V] f32: row b reads and writes state_pool[layer, slots[b]].

    Returns (o [B, T, H, V], updated pool). The Pallas kernel updates the pool in place (head dims must be powers
    of two >= 16; other sizes gather, run the recurrent kernel and scatter back).
    """
    kernel, extra = _pick("fused_recurrent_kda_slots", impl)
    if kernel is pallas.fused_recurrent_kda_slots and not pallas.slots_supported(state_pool.shape):
        o, state = pallas.fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=state_pool[layer, slots],
                                              output_final_state=True,
                                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lengths=lengths,
                                              **extra)
        return o, state_pool.at[layer, slots].set(state)
    return kernel(q, k, v, g, beta, state_pool, slots, layer=layer, scale=scale,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lengths=lengths, **extra)
