"""Layer-by-layer comparison against a reference implementation (transformers), for bringing up a checkpoint.

`compare_hidden_states(ours, theirs)` lines up two lists of hidden states (embeddings, then the output of every
layer, the last one after the final norm, as transformers' `output_hidden_states` gives them) and reports, per
entry, the max abs difference and the relative error (max abs diff / max abs reference value), marking the first
entry where the two implementations part. `dayzero-compare --model DIR` runs both on the same tokens.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dayzero import platforms

from .config import ModelConfig


@dataclass(frozen=True)
class LayerDiff:
    name: str
    max_abs: float
    rel: float
    ok: bool


@dataclass(frozen=True)
class Comparison:
    """Per-entry differences; `first_divergence` is the first entry over tolerance (None when all agree)."""

    rows: tuple[LayerDiff, ...]
    logits: LayerDiff | None
    rtol: float

    @property
    def first_divergence(self) -> LayerDiff | None:
        return next((r for r in self.rows if not r.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_divergence is None and (self.logits is None or self.logits.ok)

    def format(self) -> str:
        lines = [f"{'entry':<34} {'max |diff|':>12} {'rel err':>11}  (tolerance {self.rtol:g})"]
        for r in self.rows + ((self.logits,) if self.logits else ()):
            mark = "" if r.ok else "   <-- parts here" if r is self.first_divergence else "   over"
            lines.append(f"{r.name:<34} {r.max_abs:12.4e} {r.rel:11.3e}{mark}")
        first = self.first_divergence
        lines.append("all entries agree" if self.ok else
                     f"first divergence: {first.name}" if first else "hidden states agree; logits do not")
        return "\n".join(lines)


def _diff(name: str, ours, theirs, rtol: float) -> LayerDiff:
    a = np.asarray(ours, np.float64)
    b = np.asarray(theirs, np.float64)
    if a.shape != b.shape:
        return LayerDiff(f"{name} shape {a.shape} vs {b.shape}", float("inf"), float("inf"), False)
    max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
    rel = max_abs / max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-30)
    return LayerDiff(name, max_abs, rel, bool(np.isfinite(rel) and rel <= rtol))


def entry_names(config: ModelConfig) -> list[str]:
    names = ["embeddings"]
    for i, (attn, mlp) in enumerate(zip(config.layer_types, config.mlp_types)):
        names.append(f"layer {i} ({attn}, {mlp})")
    names[-1] += " + final norm"
    return names


def compare_hidden_states(ours: Sequence, theirs: Sequence, rtol: float = 1e-4, names: Sequence[str] | None = None,
                          logits: tuple | None = None) -> Comparison:
    """Compares two equally long lists of hidden states (and optionally a (ours, theirs) logits pair)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} hidden states against {len(theirs)}: the lists must line up")
    names = list(names) if names is not None else [f"entry {i}" for i in range(len(ours))]
    rows = tuple(_diff(n, a, b, rtol) for n, a, b in zip(names, ours, theirs))
    return Comparison(rows, _diff("logits", *logits, rtol) if logits is not None else None, rtol)


def reference_outputs(path: str, token_ids: np.ndarray, dtype: str = "float32"):
    """Runs transformers' implementation of the checkpoint: returns (hidden states list, logits) as numpy."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(token_ids)), output_hidden_states=True)
    return [h.float().numpy() for h in out.hidden_states], out.logits.float().numpy()


def compare_checkpoint(path: str, token_ids: np.ndarray, dtype: str = "float32", rtol: float = 1e-4,
                       platform: platforms.PlatformConfig | str | None = None) -> Comparison:
    """Loads `path` with dayzero (on `platform`, see `load_checkpoint`) and with transformers, runs both on
    `token_ids` [B, T], compares layer by layer."""
    from .model import load_checkpoint

    model = load_checkpoint(path, dtype=dtype, progress=False, platform=platform)
    ours = [np.asarray(h) for h in model.hidden_states(token_ids)]
    our_logits = np.asarray(model(token_ids))
    theirs, their_logits = reference_outputs(path, token_ids, dtype)
    return compare_hidden_states(ours, theirs, rtol, entry_names(model.config), logits=(our_logits, their_logits))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dayzero-compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--tokens", help="comma-separated token ids (default: random ids)")
    parser.add_argument("--length", type=int, default=67, help="random prompt length when --tokens is absent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="param/compute dtype for both sides")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative error that counts as agreement")
    platforms.add_cli_options(parser)
    args = parser.parse_args(argv)
    config = ModelConfig.from_pretrained(args.model)
    if args.tokens:
        ids = np.array([[int(t) for t in args.tokens.split(",")]])
    else:
        ids = np.random.default_rng(args.seed).integers(0, config.vocab_size, (1, args.length))
    report = compare_checkpoint(args.model, ids, args.dtype, args.rtol, platforms.from_cli_args(args))
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
