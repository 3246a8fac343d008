"""Whole-model, layer-by-layer drift of MXFP4 experts: online conversion vs offline-dequantized vs the original.

Three runs of the same tokens: the original checkpoint (bf16/f32 experts), the MXFP4 checkpoint with experts
converted online (the kernels' path: fused or through the workspace), and the same MXFP4 weights dequantized once
into dense experts (`mxfp4_offline.dequantize_experts`). Per entry (embeddings, each layer, logits computed from the
final hidden states in float64) it reports the relative max error (max |a - b| / max |b|) of online vs offline (the
kernels' own error: rounding only), offline vs original (the quantization error) and online vs original, plus the
workspace hit rate of the online run. Per pair it also counts the (token, MoE layer) choices that picked another
expert set: a router near-tie that rounding tips the other way moves that token's hidden state by a whole expert's
output, so one such change explains an online-vs-offline error far above rounding.
`dayzero-drift --model DIR` quantizes DIR itself (into a temporary directory) unless `--mxfp4 DIR` is given.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dayzero import platforms

from .compare import Comparison, compare_hidden_states, entry_names
from .config import ModelConfig, MXFP4Execution
from .errors import DayzeroError
from .model import Model, load_checkpoint
from .mxfp4_offline import dequantize_experts
from .quantize import quantize_checkpoint

PAIRS = ("online vs offline", "offline vs original", "online vs original")


@dataclass(frozen=True)
class Drift:
    """The three comparisons (see PAIRS), each a `Comparison` over the same entries, and the online run's workspace
    counters (None when that run converted tile by tile, without the workspace)."""

    comparisons: tuple[Comparison, Comparison, Comparison]
    workspace_hits: int | None
    workspace_misses: int | None
    execution: MXFP4Execution
    route_changes: tuple[int, int, int]  # per pair: (token, MoE layer) choices of another expert set
    routed_choices: int  # (token, MoE layer) choices in each run

    def format(self) -> str:
        lines = [f"{'entry':<34}" + "".join(f"{p:>22}" for p in PAIRS) + "   (relative max error)"]
        rows = list(zip(*(c.rows + ((c.logits,) if c.logits else ()) for c in self.comparisons)))
        for row in rows:
            lines.append(f"{row[0].name:<34}" + "".join(f"{r.rel:>22.3e}" for r in row))
        lines.append(f"{'routing changes':<34}" + "".join(f"{f'{n} of {self.routed_choices}':>22}"
                                                         for n in self.route_changes)
                     + "   ((token, MoE layer) choices of another expert set)")
        ex = self.execution
        if self.workspace_hits is None:
            lines.append(f"online run: mode {ex.mode!r}, impl {ex.impl or 'default'}, experts converted tile by tile "
                         "before each MMA (no workspace)")
        else:
            total = self.workspace_hits + self.workspace_misses
            rate = self.workspace_hits / total if total else float("nan")
            lines.append(f"online run: mode {ex.mode!r}, impl {ex.impl or 'default'}, {ex.workspace_dtype} workspace: "
                         f"{self.workspace_misses} conversions, {self.workspace_hits} reused (hit rate {rate:.1%})")
        return "\n".join(lines)


def forward_intermediates(model: Model, token_ids) -> dict:
    """The "intermediates" collection of one jitted forward pass of `token_ids` [B, T]: the MXFP4 workspace's
    counters (`Decoder`) and each MoE layer's routed experts (`MoE`). The DSA layers' top-k keys (`Indexer`'s
    "index_selection", [B, T, k] a layer: gigabytes at a long T) are dropped inside the jit, never copied out."""
    def forward(params, ids):
        state = model.module.apply({"params": params}, ids, mutable=["intermediates"])[1]
        return _without(state.get("intermediates", {}), "index_selection")

    with platforms.activate(model.placement):
        return jax.device_get(jax.jit(forward)(model.params, jnp.asarray(token_ids, jnp.int32)))


def _without(tree: dict, name: str) -> dict:
    """`tree` (nested dicts) without its entries called `name`, at any depth."""
    return {k: _without(v, name) if isinstance(v, dict) else v for k, v in tree.items() if k != name}


def workspace_counters(intermediates: dict) -> tuple[int, int] | None:
    """(hits, misses) of the MXFP4 workspace over the forward pass that recorded `intermediates`, None when it is not
    used."""
    found = intermediates.get("mxfp4_workspace")
    if not found:
        return None
    hits, misses = (int(v) for v in np.asarray(found[0]))
    return hits, misses


def sown_per_layer(intermediates: dict, path: tuple[str, ...]) -> list[np.ndarray]:
    """The first value sown at `path` (module names, then the entry's name) under each decoder layer, sorted along its
    last axis, in layer order; layers without that entry are left out."""
    layers = sorted((k for k in intermediates if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
    found = []
    for layer in layers:
        entry = intermediates[layer]
        for name in path:
            entry = entry.get(name, {})
        if entry:
            found.append(np.sort(np.asarray(entry[0]), axis=-1))
    return found


def routed_experts(intermediates: dict) -> list[np.ndarray]:
    """Each MoE layer's routed experts [B * T, k] int32, sorted along k, in layer order."""
    return sown_per_layer(intermediates, ("mlp", "routed_experts"))


def index_selections(intermediates: dict) -> list[np.ndarray]:
    """Each DSA layer's top-k key positions [B, T, k] int32 (-1 = none), sorted along k, in layer order."""
    return sown_per_layer(intermediates, ("self_attn", "indexer", "index_selection"))


def route_changes(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    """How many (token, layer) choices of expert set differ between two runs' `routed_experts`."""
    return sum(int(np.any(x != y, axis=-1).sum()) for x, y in zip(a, b, strict=True))


def _logits(model: Model, final: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] in float64 from the final hidden states (after the final norm): one forward pass per run
    gives both the layers and the logits."""
    p = model.params
    head = np.asarray(p["embed_tokens"], np.float64).T if model.config.tie_word_embeddings else np.asarray(
        p["lm_head"], np.float64)
    return np.asarray(final, np.float64) @ head


def drift_report(original: str, mxfp4_dir: str, token_ids: np.ndarray, dtype: str = "float32",
                 execution: MXFP4Execution | None = None,
                 platform: platforms.PlatformConfig | str | None = None) -> Drift:
    """Runs the three models on token_ids [B, T] (on `platform`, see `load_checkpoint`) and compares them entry by
    entry."""
    execution = execution or MXFP4Execution()
    base = load_checkpoint(original, dtype=dtype, progress=False, platform=platform)
    packed = load_checkpoint(mxfp4_dir, dtype=dtype, progress=False, platform=platform)
    online = Model(packed.config.replace(mxfp4=execution), packed.params, packed.dtype, placement=packed.placement)
    offline = dequantize_experts(packed)
    offline.placement = packed.placement  # the converted experts live there too; keep the kernel policy
    runs, recorded = [], []
    for m in (online, offline, base):
        hidden = [np.asarray(h) for h in m.hidden_states(token_ids)]
        runs.append((_logits(m, hidden[-1]), hidden))
        recorded.append(forward_intermediates(m, token_ids))
    choices = [routed_experts(r) for r in recorded]
    names = entry_names(base.config)
    pairs = ((0, 1), (1, 2), (0, 2))
    comparisons = tuple(compare_hidden_states(runs[a][1], runs[b][1], rtol=float("inf"), names=names,
                                              logits=(runs[a][0], runs[b][0])) for a, b in pairs)
    changes = tuple(route_changes(choices[a], choices[b]) for a, b in pairs)
    counters = workspace_counters(recorded[0])
    hits, misses = counters if counters is not None else (None, None)
    return Drift(comparisons, hits, misses, execution, changes, sum(c.shape[0] for c in choices[2]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dayzero-drift", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="original checkpoint (bf16/f16/f32 experts)")
    parser.add_argument("--mxfp4", help="its MXFP4 checkpoint (default: dayzero-quantize --model into a temp dir)")
    parser.add_argument("--length", type=int, default=64, help="random prompt length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="param/compute dtype of all three runs")
    parser.add_argument("--mode", default="auto", choices=("auto", "fused", "workspace"),
                        help="MXFP4 execution of the online run")
    parser.add_argument("--workspace-dtype", default="float8_e4m3fn", choices=("float8_e4m3fn", "bfloat16"))
    parser.add_argument("--impl", choices=("pallas", "interpret", "reference"),
                        help="force the experts' kernels (default: the platform's choice)")
    platforms.add_cli_options(parser)
    args = parser.parse_args(argv)
    try:
        execution = MXFP4Execution(mode=args.mode, workspace_dtype=args.workspace_dtype, impl=args.impl)
        platform = platforms.from_cli_args(args, init=True)  # before quantizing starts JAX
        with tempfile.TemporaryDirectory() as tmp:
            mxfp4_dir = args.mxfp4
            if mxfp4_dir is None:
                mxfp4_dir = tmp
                print(quantize_checkpoint(args.model, tmp).format())
            vocab = ModelConfig.from_pretrained(args.model).vocab_size
            ids = np.random.default_rng(args.seed).integers(0, vocab, (args.batch, args.length))
            report = drift_report(args.model, mxfp4_dir, ids, args.dtype, execution, platform)
    except DayzeroError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
