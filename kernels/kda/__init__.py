"""Kimi Delta Attention: `chunk_kda` (prefill) and `fused_recurrent_kda` (decode), flash-linear-attention semantics.

Layout [B, T, H, K]; `g` is the per-channel log-decay (already activated); state [B, H, K, V] float32. Both return
`(o, final_state)`; `final_state` is None unless `output_final_state`.
"""

from __future__ import annotations

from .. import dispatch
from . import reference

# Implementation modules by name, each exposing chunk_kda and fused_recurrent_kda; the Pallas module joins when it
# lands.
_IMPLS = {"reference": reference}


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, impl: str | None = None):
    """Chunked KDA over whole sequences (prefill). See `reference.chunk_kda` for the math."""
    kernel = _IMPLS[dispatch.choose(tuple(_IMPLS), impl)].chunk_kda
    return kernel(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, impl: str | None = None):
    """Token-by-token KDA (decode). See `reference.fused_recurrent_kda`."""
    kernel = _IMPLS[dispatch.choose(tuple(_IMPLS), impl)].fused_recurrent_kda
    return kernel(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
