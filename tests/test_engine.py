"""The serving engine: greedy output equal to repeated full-sequence forward passes (mixed lengths, prefix-cache
hits, preemption), bad requests failing alone, reproducible sampling, and a stress run that leaks nothing."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import numpy as np
import pytest

from dayzero.model import RequestError, load_checkpoint
from dayzero.serving.engine import Engine, EngineConfig
from dayzero.serving.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def config(**options) -> EngineConfig:
    """Small engines with few bucket shapes, shared by every test (compiled steps are shared per model)."""
    defaults = dict(max_num_seqs=4, max_model_len=256, max_prefill_tokens=64, max_prefill_rows=2,
                    prefill_len_buckets=(64,), block_buckets=(4,))
    return EngineConfig(**{**defaults, **options})


@pytest.fixture(scope="module")
def models(checkpoints):
    return {kind: load_checkpoint(checkpoints[kind], dtype="float32", progress=False)
            for kind in ("kimi_linear", "deepseek_v32")}


@contextlib.contextmanager
def xla_compilations():
    """Within: the compilations XLA makes in this process, whoever asks for them (a list that fills as they
    happen)."""
    seen = []

    def count(event, seconds, **kwargs):
        if "backend_compile" in event:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


def full_forward_greedy(model, prompt, n):
    """Greedy continuation by full-sequence forwards, padded to one length (the model is causal)."""
    window = np.zeros((1, len(prompt) + n), np.int32)
    window[0, :len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + n):
        window[0, i] = int(np.asarray(model(window))[0, i - 1].argmax())
    return window[0, len(prompt):].tolist()


def prompts_with_shared_prefix(seed, vocab):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, 70).tolist()  # > one 64-token block
    return [shared + rng.integers(3, vocab, k).tolist() for k in (5, 61)] + [rng.integers(3, vocab, 13).tolist()]


@pytest.mark.parametrize("kind", ["kimi_linear", "deepseek_v32"])
def test_greedy_equals_full_forward_with_prefix_hits(models, kind):
    model = models[kind]
    seed = int(np.random.default_rng().integers(1 << 31))
    prompts = prompts_with_shared_prefix(seed, 190)
    engine = Engine(model, None, config(seed=0))
    refs = [full_forward_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    first = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    second = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY)  # now served from the prefix cache
    for out, again, ref in zip(first, second, refs):
        assert out.token_ids == ref, f"seed {seed}"
        assert again.token_ids == ref, f"seed {seed} (prefix-cache hit)"
        assert out.finish_reason == "length" and out.ttft is not None and len(out.itl) == GREEDY.max_tokens - 1
    assert [o.num_cached_tokens for o in second[:2]] == [64, 128], "cached full blocks were not reused"
    assert engine.stats()["prefix_hit_rate"] > 0


def test_greedy_survives_preemption(models):
    model = models["kimi_linear"]
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 190, n).tolist() for n in (60, 58, 62)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # 4 usable blocks for three requests that each grow to two blocks: someone must be preempted.
    engine = Engine(model, None, config(max_num_seqs=3, max_model_len=128, num_blocks=5,
                                        enable_prefix_caching=False))
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    assert sum(o.num_preemptions for o in outs) > 0, "the scenario did not preempt: test is vacuous"
    for p, out in zip(prompts, outs):
        assert out.token_ids == full_forward_greedy(model, p, params.max_tokens), f"seed {seed}"
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_usable


def test_bad_requests_fail_alone(models):
    model = models["deepseek_v32"]
    engine = Engine(model, None, config(max_model_len=128))
    good = [5, 6, 7, 8]
    outs = engine.generate(
        prompt_token_ids=[good, [], list(range(3, 200)) * 2, [1, 2, 10_000], good],
        sampling_params=[GREEDY, GREEDY, GREEDY, GREEDY, SamplingParams(temperature=-1.0)])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == GREEDY.max_tokens
    assert outs[0].token_ids == full_forward_greedy(model, good, GREEDY.max_tokens)
    errors = [o.error for o in outs[1:]]
    assert all(o.finish_reason == "error" and not o.token_ids for o in outs[1:])
    assert "empty" in errors[0] and "maximum" in errors[1] and "outside the vocabulary" in errors[2]
    assert "temperature" in errors[3]
    with pytest.raises(RequestError, match="tokenizer"):
        engine.add_request(prompt="text needs a tokenizer")
    assert engine.scheduler.pool.num_free + engine.scheduler.cache.num_cached_blocks == engine.scheduler.pool.num_usable


def test_seeded_sampling_is_reproducible_and_batch_independent(models):
    model = models["kimi_linear"]
    engine = Engine(model, None, config(max_model_len=128))
    prompt = [9, 8, 7, 6, 5]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=1234, ignore_eos=True, logprobs=True)
    alone = engine.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    crowd = engine.generate(prompt_token_ids=[[3, 4], prompt, [11] * 20],
                            sampling_params=[SamplingParams(seed=1, max_tokens=3), params,
                                             SamplingParams(max_tokens=9)])[1]
    assert alone.token_ids == crowd.token_ids
    assert len(alone.logprobs) == 6 and all(lp <= 0 for lp in alone.logprobs)
    other = engine.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=1.0, max_tokens=6, seed=99, ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids  # another seed, another sample (equal with ~0 probability)


def test_stop_token_and_streaming(models):
    model = models["kimi_linear"]
    engine = Engine(model, None, config(max_num_seqs=2))
    prompt = [4, 5, 6, 7]
    ref = full_forward_greedy(model, prompt, 6)
    stop_at = ref[3]
    out = engine.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=6, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(stop_at) + 1]
    pieces = list(engine.stream(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True)))
    # the first token comes from the prefill, then one piece per decode dispatch of up to 4 steps
    assert [len(p.token_ids) for p in pieces] == [1, 5, 6] and pieces[-1].token_ids == ref
    assert all(p.token_ids == ref[:len(p.token_ids)] for p in pieces)
    single = Engine(model, None, config(max_num_seqs=2, decode_steps=1))
    pieces = list(single.stream(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True)))
    assert [len(p.token_ids) for p in pieces] == [1, 2, 3, 4, 5, 6] and pieces[-1].token_ids == ref


def test_multi_step_decode_matches_single_steps(models):
    """Several decode steps per dispatch give the same tokens as one step per dispatch: seeded sampling (keys
    per generated token), stops in the middle of a dispatch (later tokens dropped), max_tokens not a multiple of
    the steps, rows near max_model_len; nothing leaks."""
    model = models["kimi_linear"]
    prompts = [[9, 8, 7, 6, 5], [3, 4], [11] * 20, list(range(3, 60))]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=7, seed=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, max_tokens=5, seed=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    outs = {}
    for steps in (1, 3):
        engine = Engine(model, None, config(max_model_len=70, decode_steps=steps))
        outs[steps] = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        sched = engine.scheduler
        assert sched.pool.num_free + sched.cache.num_cached_blocks == sched.pool.num_usable
        assert sched.slots.num_free == sched.slots.num_usable
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[3]]
    assert [o.finish_reason for o in outs[3]] == ["length"] * 4
    assert len(outs[3][3].token_ids) == 70 - 57  # stopped by max_model_len, not max_tokens
    stop = outs[1][1].token_ids[4]
    engine = Engine(model, None, config(decode_steps=3))
    stopped = engine.generate(prompt_token_ids=[prompts[1]], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=9, stop_token_ids=[stop], ignore_eos=True))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == outs[1][1].token_ids[:outs[1][1].token_ids.index(stop) + 1]


def test_dispatch_runs_only_the_steps_its_rows_take(models, monkeypatch):
    """`trim_decode_steps`: a decode dispatch whose rows all take fewer than `decode_steps` steps (a request's last
    tokens) runs only as many as its longest row, with the same tokens and logprobs as running them all (seeded
    sampling, greedy, dispatches launched ahead and waited for); without it every dispatch runs all."""
    from dayzero.serving import runner as runner_module

    model = models["kimi_linear"]
    prompts = [[9, 8, 7, 6, 5], [3, 4, 5]]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=5, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=True)]
    ran, decode = [], runner_module._DECODE  # each decode dispatch's steps
    monkeypatch.setattr(runner_module, "_DECODE", lambda *args: ran.append(args[8]) or decode(*args))
    outs, counts = {}, {}
    for trim, overlap in ((False, True), (True, True), (True, False)):
        engine = Engine(model, None, config(decode_steps=4, trim_decode_steps=trim, overlap_decode=overlap))
        outs[trim, overlap] = [engine.generate(prompt_token_ids=[p], sampling_params=q)[0]
                               for p, q in zip(prompts, params)]
        counts[trim, overlap] = ran[:]
        ran.clear()
    # 5 and 6 decode tokens after the prefill's: 4 + 1 and 4 + 2 steps, or 4 + 4 and 4 + 4 untrimmed
    assert counts[False, True] == [4, 4, 4, 4]
    assert counts[True, True] == counts[True, False] == [4, 1, 4, 2]
    for key in ((True, True), (True, False)):
        for got, want in zip(outs[key], outs[False, True]):
            assert got.token_ids == want.token_ids and len(got.token_ids) in (6, 7), key
            np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6, err_msg=str(key))
    rows = runner_module.StepRows.padding(3, 1, 4, decode_steps=4)
    rows.steps[:] = [2, 3, 0]
    trimmed = Engine(model, None, config()).runner
    assert trimmed.dispatch_steps(rows) == 3
    assert Engine(model, None, config(trim_decode_steps=False)).runner.dispatch_steps(rows) == 4
    rows.steps[:] = 0  # padding only (as warm-up sends): one step
    assert trimmed.dispatch_steps(rows) == 1


def test_unrolled_decode_matches_the_loop(models, monkeypatch):
    """`unrolled_decode` compiles a dispatch's steps as straight-line code (no while loop in the lowered function)
    and gives the loop's tokens and logprobs: greedy and seeded sampling, max_tokens not a multiple of the steps."""
    from dayzero.serving import runner as runner_module

    model = models["kimi_linear"]
    prompts = [[9, 8, 7, 6, 5], list(range(3, 40))]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=7, seed=5, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)]
    outs, asked = {}, []  # the `unrolled` argument of every decode dispatch
    decode = runner_module._DECODE
    monkeypatch.setattr(runner_module, "_DECODE", lambda *args: asked.append(args[7]) or decode(*args))
    for unrolled in (False, True):
        engine = Engine(model, None, config(decode_steps=3, unrolled_decode=unrolled))
        outs[unrolled] = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        assert asked and set(asked) == {unrolled}, asked
        asked.clear()
        rows = runner_module.StepRows.padding(2, 1, 4, decode_steps=3)
        arrays, layout = runner_module.pack_rows(rows)
        compiled = jax.jit(runner_module._decode, static_argnums=(0, 4, 6, 7)).lower(
            model.module, model.params, engine.runner.cache, arrays, layout, np.zeros((2, 3), np.int32), False,
            unrolled).compile().as_text()  # the model's own loops (inside each step) are named below the step
        steps_loop = re.search(r'op_name="jit\(_decode\)/while"', compiled) is not None
        assert steps_loop != unrolled, f"unrolled={unrolled}, but a loop over the steps: {steps_loop}"
    for loop, straight in zip(outs[False], outs[True]):
        assert straight.token_ids == loop.token_ids and len(straight.token_ids) in (7, 8)
        np.testing.assert_allclose(straight.logprobs, loop.logprobs, rtol=1e-5, atol=1e-5)


def test_unrolled_decode_defaults_to_the_gpu(models):
    """The engine option's default (None) unrolls the steps on XLA:GPU platforms only; an explicit value wins."""
    from dayzero import platforms
    from dayzero.serving import runner as runner_module

    assert runner_module.unrolled_by_default("cuda") and runner_module.unrolled_by_default("rocm")
    assert runner_module.unrolled_by_default("gpu")  # what JAX's CUDA and ROCm devices report
    assert not runner_module.unrolled_by_default("cpu")
    model = models["kimi_linear"]
    assert model.platform == "cpu"
    assert Engine(model, None, config()).runner.unrolled_decode is False
    assert Engine(model, None, config(unrolled_decode=True)).runner.unrolled_decode is True

    class FakeGpu:  # a placement's device only lends its platform name here
        platform = "cuda"

    gpu_model = dataclasses.replace(model, placement=platforms.Placement(FakeGpu()))
    assert gpu_model.platform == "cuda"


def test_overlapped_decode_matches_waiting_for_each_dispatch(models):
    """Decode dispatches launched before the previous one's tokens are read (`overlap_decode`) give the same
    tokens and logprobs as waiting for each: seeded sampling, a stop token in the middle of a dispatch, token
    budgets and the model length reached; a request aborted while a dispatch ahead holds it; nothing leaks."""
    model = models["kimi_linear"]
    prompts = [[9, 8, 7, 6, 5], [3, 4], [11] * 20, list(range(3, 60))]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=11, seed=5, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=0.7, top_k=5, max_tokens=6, seed=6, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=True)]
    outs, ahead = {}, {}
    for overlap in (False, True):
        engine = Engine(model, None, config(max_model_len=70, decode_steps=3, overlap_decode=overlap))
        launched = []
        original = engine._dispatch_ahead
        engine._dispatch_ahead = lambda plan, tokens: launched.append(original(plan, tokens)) or launched[-1]
        outs[overlap] = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        ahead[overlap] = sum(x is not None for x in launched)
        sched = engine.scheduler
        assert sched.pool.num_free + sched.cache.num_cached_blocks == sched.pool.num_usable
        assert sched.slots.num_free == sched.slots.num_usable
    assert ahead[False] == 0 and ahead[True] >= 3, ahead
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in outs[True]]),
                               np.concatenate([o.logprobs for o in outs[False]]), rtol=1e-6, atol=1e-6)
    assert len(outs[True][3].token_ids) == 70 - 57  # the model length, reached inside a dispatch ahead

    stop = outs[False][1].token_ids[7]  # a stop token a few dispatches in: the dispatch ahead is thrown away
    engine = Engine(model, None, config(decode_steps=3))
    stopped, other = engine.generate(prompt_token_ids=[prompts[1], prompts[3]], sampling_params=[
        SamplingParams(temperature=0.0, max_tokens=17, stop_token_ids=[stop], ignore_eos=True), params[3]])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == outs[False][1].token_ids[:outs[False][1].token_ids.index(stop) + 1]
    longer = outs[False][3].token_ids  # cut by max_model_len 70 there, not here
    assert len(other.token_ids) == 30 and other.token_ids[:len(longer)] == longer

    engine = Engine(model, None, config(decode_steps=2))
    first = engine.add_request(prompt_token_ids=prompts[1], sampling_params=params[1])
    second = engine.add_request(prompt_token_ids=prompts[0], sampling_params=params[0])
    while engine._ahead is None:
        engine.step()
    engine.abort(first)  # held by the dispatch ahead: its tokens there are dropped
    rest = [o for _ in range(40) for o in engine.step()]
    finals = {o.request_id: o for o in rest if o.finished}
    assert first not in finals and finals[second].token_ids == outs[False][0].token_ids
    sched = engine.scheduler
    assert not sched.running and sched.slots.num_free == sched.slots.num_usable


def test_decode_launched_ahead_of_a_prefill(models):
    """The first decode dispatch of a prompt is launched before the prefill's token is read (its input taken on the
    device): the same tokens and logprobs as waiting for the prefill, seeded sampling included; and a prompt of
    whole blocks, whose KDA snapshot is saved at its end, leaves the prompt's state there, not a decode step's: a
    later request restoring it gets the logprobs of a fresh prefill."""
    model = models["kimi_linear"]
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 31)))
    prompt = rng.integers(3, 190, 128).tolist()  # two whole blocks: a snapshot at the prompt's end
    longer = prompt + rng.integers(3, 190, 9).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=11, ignore_eos=True, logprobs=True)]
    outs = {}
    for name, options in (("waited", dict(overlap_decode=False)), ("decode only", dict(overlap_prefill=False)),
                          ("ahead", {})):
        # every dispatch runs all its steps: warm-up then compiles a quarter of the decode functions (the stress
        # test below checks warm-up with the step counts of `trim_decode_steps`)
        engine = Engine(model, None, config(seed=0, trim_decode_steps=False, **options))
        after_prefill = []  # per dispatch ahead tried after a prefill step: launched or not
        original = engine._dispatch_ahead

        def counted(plan, tokens, original=original, after_prefill=after_prefill):
            launched = original(plan, tokens)
            if not plan.decode:
                after_prefill.append(launched is not None)
            return launched

        engine._dispatch_ahead = counted
        if name == "ahead":
            engine.warmup()  # what the dispatches ahead of a prefill's token need included
        with xla_compilations() as compiled:
            outs[name] = [engine.generate(prompt_token_ids=[prompt], sampling_params=p)[0] for p in params]
            outs[name].append(engine.generate(prompt_token_ids=[longer], sampling_params=params[0])[0])
        assert name != "ahead" or not compiled, f"XLA compiled {len(compiled)} functions after warm-up"
        assert outs[name][-1].num_cached_tokens == 128, "the longer prompt missed the snapshot at 128"
        assert any(after_prefill) == (name == "ahead"), (name, after_prefill)
    for name in ("decode only", "ahead"):
        for waited, ahead in zip(outs["waited"], outs[name]):
            assert ahead.token_ids == waited.token_ids and len(ahead.itl) == len(ahead.token_ids) - 1, name
            np.testing.assert_allclose(ahead.logprobs, waited.logprobs, rtol=1e-6, atol=1e-6, err_msg=name)
    fresh = Engine(model, None, config(seed=0, enable_prefix_caching=False)).generate(
        prompt_token_ids=[longer], sampling_params=params[0])[0]
    assert outs["ahead"][-1].token_ids == fresh.token_ids
    np.testing.assert_allclose(outs["ahead"][-1].logprobs, fresh.logprobs, rtol=1e-6, atol=1e-6)


def test_stress_no_leaks_no_recompilation(models):
    """200+ requests with random lengths, shared prefixes and cancellations."""
    model = models["kimi_linear"]
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    # 2 steps per dispatch: warm-up compiles each decode shape for 1 and 2 steps (`trim_decode_steps`), half of
    # what the default 4 would take on the CPU
    engine = Engine(model, None, config(max_num_seqs=8, max_prefill_rows=4, num_blocks=24, num_snapshots=8,
                                        seed=seed, max_model_len=192, decode_steps=2))
    prefixes = [rng.integers(3, 190, 64).tolist() for _ in range(3)]

    def random_request():
        body = rng.integers(3, 190, int(rng.integers(1, 60))).tolist()
        prompt = (prefixes[int(rng.integers(3))] + body) if rng.random() < 0.5 else body
        return prompt, SamplingParams(temperature=float(rng.choice([0.0, 0.8])), max_tokens=int(rng.integers(1, 12)),
                                      ignore_eos=True)

    warm = engine.warmup()
    assert engine.num_compilations == warm
    with xla_compilations() as backend_compiles:
        submitted, cancelled, finished = 0, 0, 0
        live = []
        while submitted < 200 or engine.has_unfinished():
            while submitted < 200 and len(live) < 12:
                prompt, params = random_request()
                live.append(engine.add_request(prompt_token_ids=prompt, sampling_params=params))
                submitted += 1
            if live and rng.random() < 0.1:
                victim = live.pop(int(rng.integers(len(live))))
                engine.abort(victim)
                cancelled += 1
            for out in engine.step():
                if out.finished:
                    finished += 1
                    assert out.finish_reason in ("length", "stop"), out
                    if out.request_id in live:
                        live.remove(out.request_id)
    assert cancelled > 5 and finished + cancelled >= 200, (seed, cancelled, finished)
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    assert sched.slots.num_free == sched.slots.num_usable
    sched.pool.check_invariants()
    sched.cache.check_invariants()
    for snap in sched.cache.evict_all():
        sched.snapshot_ids.free(snap)
    assert sched.pool.num_free == sched.pool.num_usable, f"leaked blocks (seed {seed})"
    assert sched.snapshot_ids.num_free == sched.snapshot_ids.num_usable, f"leaked snapshots (seed {seed})"
    assert engine.num_compilations == warm, f"compiled after warm-up: {engine.num_compilations} > {warm}"
    assert not backend_compiles, f"XLA compiled {len(backend_compiles)} functions after warm-up"


def test_text_prompts_and_stop_strings_with_a_tokenizer(models, tmp_path):
    """Text in, text out through a checkpoint-style tokenizer.json; a stop string cuts the text before it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from dayzero.serving.tokenizer import load_tokenizer

    model = models["kimi_linear"]
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    hf = HFTokenizer(WordLevel(vocab, unk_token="w0"))
    hf.pre_tokenizer = Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path)
    engine = Engine(model, tokenizer, config(max_num_seqs=2))
    prompt = "w4 w5 w6 w7"
    ref = full_forward_greedy(model, [4, 5, 6, 7], 6)
    plain = engine.generate([prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert plain.token_ids == ref and plain.text == tokenizer.decode(ref)
    stop = f"w{ref[2]}"
    cut = engine.generate([prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                   stop=[stop]))[0]
    n = next(n for n in range(1, len(ref) + 1) if stop in tokenizer.decode(ref[:n]))  # first time the text has it
    assert cut.finish_reason == "stop" and cut.token_ids == ref[:n]
    text = tokenizer.decode(ref[:n])
    assert cut.text == text[:text.index(stop)] and stop not in cut.text


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_mxfp4_checkpoint_served_greedy_equals_full_forward(checkpoints, tmp_path, impl):
    """A kimi_linear checkpoint quantized by dayzero-quantize (routed experts packed MXFP4) served by the engine,
    with prefix-cache hits. `reference`: greedy tokens equal the same model's full-sequence forwards. `interpret`:
    the experts' Pallas kernels in interpret mode, whose decode kernels (fp16 activation blocks) and prefill kernels
    round apart by ~3e-4: each token is the full forward's top token to 1e-3 of the logits' scale."""
    from dayzero.model import Model
    from dayzero.model.config import MXFP4Execution
    from dayzero.model.quantize import quantize_checkpoint
    from mxfp4_cases import assert_forward_top_tokens

    quantize_checkpoint(checkpoints["kimi_linear"], str(tmp_path / "mxfp4"))
    loaded = load_checkpoint(str(tmp_path / "mxfp4"), dtype="float32", progress=False)
    experts = loaded.params["layers_1"]["mlp"]["experts"]
    assert experts["w_gate_blocks"].dtype == np.uint8, "the routed experts were not kept packed"
    model = Model(loaded.config.replace(mxfp4=MXFP4Execution(impl=impl)), loaded.params, loaded.dtype)
    seed = int(np.random.default_rng().integers(1 << 31))
    prompts = prompts_with_shared_prefix(seed, 190)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = Engine(model, None, config(seed=0))
    first = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    second = engine.generate(prompt_token_ids=prompts, sampling_params=params)  # served from the prefix cache
    for prompt, out, again in zip(prompts, first, second):
        assert len(out.token_ids) == len(again.token_ids) == params.max_tokens
        if impl == "reference":
            ref = full_forward_greedy(model, prompt, params.max_tokens)
            assert out.token_ids == ref, f"seed {seed}"
            assert again.token_ids == ref, f"seed {seed} (prefix-cache hit)"
        else:
            assert_forward_top_tokens(model, prompt, out.token_ids, 1e-3)
            assert_forward_top_tokens(model, prompt, again.token_ids, 1e-3)
    assert [o.num_cached_tokens for o in second[:2]] == [64, 128]
