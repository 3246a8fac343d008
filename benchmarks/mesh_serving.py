"""Serving on a device mesh against one device: the medium hybrid preset (random weights, bf16) with expert
parallelism over the GPUs of one host.

    python3 benchmarks/mesh_serving.py [--mesh expert=2] [--batches 16,64] [--max-tokens 48] [--dtype float32]

The same weights (same seed) are built once on one GPU and once sharded by `dayzero.model.sharding`'s rules on the
mesh. Both engines run the same greedy requests (prompts of 128 tokens): the script reports the full-forward logits'
relative difference on a few prompts, whether every request's tokens are equal, and per batch size the ITL (median of per-request means) and tokens/s, each shape compiled before
it is timed. Appends one dated line to the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import jax
import numpy as np

from dayzero.model import Model, sharding
from dayzero.model.presets import get_preset
from dayzero.serving import Engine, EngineConfig, SamplingParams

from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path


def engine_for(model: Model, max_batch: int) -> Engine:
    return Engine(model, None, EngineConfig(
        max_num_seqs=max_batch, max_model_len=1024, max_prefill_tokens=4096, max_prefill_rows=16,
        prefill_len_buckets=(128, 2048, 4096), num_snapshots=8, enable_prefix_caching=False, seed=0))


def run_batches(engine: Engine, prompts: dict[int, list[list[int]]], params: SamplingParams) -> tuple[dict, dict]:
    """-> ({batch: figures}, {batch: generated token ids per request}); each batch run once to compile, once timed."""
    figures, tokens = {}, {}
    for batch, batch_prompts in prompts.items():
        engine.generate(prompt_token_ids=batch_prompts, sampling_params=params)
        start = time.perf_counter()
        outs = engine.generate(prompt_token_ids=batch_prompts, sampling_params=params)
        wall = time.perf_counter() - start
        itl = float(np.median([o.mean_itl for o in outs]))
        generated = sum(len(o.token_ids) for o in outs)
        figures[batch] = {"itl_ms": round(itl * 1e3, 3), "tok_s": round(generated / wall, 1),
                          "decode_tok_s": round(batch / itl, 1)}
        tokens[batch] = [list(o.token_ids) for o in outs]
    figures["compilations"] = engine.num_compilations
    return figures, tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two generations differ (None: equal over their common length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def divergences(models: dict[str, Model], prompts: dict, generated: dict) -> list[dict]:
    """Where a request's greedy tokens differ, the full-forward logits of both models at the first differing token
    (prompt + the tokens both generated before it): each model's gap between its own pick and the other's, and the
    largest absolute difference between the two models' logits there. A gap smaller than that difference is a
    near-tie that the two summation orders break differently. All such sequences run as one batch (zero-padded at
    the end to one length: the forward is causal), so each model compiles once."""
    found, sequences = [], []
    for batch, outs in generated["one_gpu"].items():
        for index, (one, sharded) in enumerate(zip(outs, generated["mesh"][batch])):
            at = first_difference(one, sharded)
            if at is not None:
                found.append({"batch": batch, "request": index, "token": at, "picks": (one[at], sharded[at])})
                sequences.append(prompts[batch][index] + one[:at])
    if not found:
        return []
    ids = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = sequence
    last = np.asarray([len(s) - 1 for s in sequences])
    logits = {label: np.asarray(model(ids), np.float32)[np.arange(len(sequences)), last]
              for label, model in models.items()}
    for row, entry in enumerate(found):
        pick_one, pick_mesh = entry.pop("picks")
        one, sharded = logits["one_gpu"][row], logits["mesh"][row]
        entry.update({"one_gpu_gap": float(one[pick_one] - one[pick_mesh]),
                      "mesh_gap": float(sharded[pick_mesh] - sharded[pick_one]),
                      "max_abs_logit_diff": float(np.abs(sharded - one).max()), "logit_std": float(one.std())})
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--mesh", default="expert=2")
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--preset", default="medium_hybrid", help="a smaller preset (tiny) for a CPU smoke run")
    parser.add_argument("--dtype", default="bfloat16", help="params and compute dtype (float32 for an exactness run)")
    args = parser.parse_args(argv)
    if args.dtype == "float32":  # exactness run: no TF32 in the XLA matmuls, so both sides round the same way
        jax.config.update("jax_default_matmul_precision", "highest")
    sizes = sharding.parse_mesh(args.mesh)
    mesh = sharding.make_mesh(**sizes)
    batches = [int(b) for b in args.batches.split(",")]
    config = get_preset(args.preset)
    rng = np.random.default_rng(0)
    prompts = {b: [rng.integers(3, config.vocab_size, 128).tolist() for _ in range(b)] for b in batches}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    results, generated = {}, {}
    logits, models = {}, {}
    probe = np.asarray(prompts[batches[0]][:4])  # full-forward logits of a few prompts, compared below
    for label, build in (("one_gpu", lambda: Model.random(config, dtype=args.dtype, seed=0)),
                         ("mesh", lambda: Model.random(config, dtype=args.dtype, seed=0, mesh=mesh))):
        start = time.perf_counter()
        model = models[label] = build()
        jax.block_until_ready(model.params)
        print(f"{label}: {args.preset} built in {time.perf_counter() - start:.1f} s")
        logits[label] = np.asarray(model(probe), np.float32)
        results[label], generated[label] = run_batches(engine_for(model, max(batches)), prompts, params)
        print(label, json.dumps(results[label]))
    diff = logits["mesh"] - logits["one_gpu"]
    results["full_forward_logits_rel_err"] = float(np.linalg.norm(diff) / np.linalg.norm(logits["one_gpu"]))
    results["full_forward_argmax_agree"] = float((logits["mesh"].argmax(-1) == logits["one_gpu"].argmax(-1)).mean())
    same = {b: sum(a == m for a, m in zip(generated["one_gpu"][b], generated["mesh"][b])) for b in batches}
    first_diff = {b: min((len(a) if (at := first_difference(a, m)) is None else at
                          for a, m in zip(generated["one_gpu"][b], generated["mesh"][b])), default=None)
                  for b in batches}
    results["greedy_equal_requests"] = {b: f"{same[b]}/{b}" for b in batches}
    results["earliest_differing_token"] = first_diff
    results["divergences"] = divergences(models, prompts, generated)
    device = jax.devices()[0]
    print("\n| batch | 1 GPU ITL ms | mesh ITL ms | 1 GPU tok/s | mesh tok/s | greedy equal |\n|---|---|---|---|---|---|")
    for b in batches:
        one, sh = results["one_gpu"][b], results["mesh"][b]
        print(f"| {b} | {one['itl_ms']} | {sh['itl_ms']} | {one['tok_s']} | {sh['tok_s']} | {same[b]}/{b} |")
    line = (f"- {datetime.date.today()} mesh_serving.py, {len(jax.devices())} x {device.device_kind}, commit "
            f"{git_commit()}, jax {jax.__version__}, {args.preset} (random {args.dtype} weights), mesh {sizes} against one "
            f"GPU in the same run, prompts 128, {args.max_tokens} new tokens, greedy: {json.dumps(results)}\n")
    append_line(args.results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
