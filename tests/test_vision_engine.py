"""kimi_k25 through the serving engine: greedy image description equal to full-forward greedy (image tokens straddling
prefill chunks, prefix-cache hits), no prefix sharing between equal prompts with different images, bad image
requests failing alone, and dayzero-generate with images."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tiny_checkpoints import KIMI_K25_IMAGE_TOKEN as IMAGE
from dayzero.model import RequestError, load_checkpoint
from dayzero.model.image_processing import expand_placeholders, preprocess_images, tokens_per_image
from dayzero.serving.engine import Engine, EngineConfig
from dayzero.serving.sampling import SamplingParams

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "vision")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SMALL = ["--no-progress", "--dtype", "float32", "--max-model-len", "128", "--max-prefill-tokens", "64",
         "--max-num-seqs", "2"]  # few step shapes to compile


def image(name: str) -> str:
    return os.path.join(FIXTURES, f"{name}.png")


def config(**options) -> EngineConfig:
    """16-token blocks and 16-token prefill chunks, so images straddle chunk and block boundaries; one step shape
    each for prefill and decode."""
    defaults = dict(max_num_seqs=4, max_model_len=192, block_size=16, max_prefill_tokens=16, max_prefill_rows=1,
                    prefill_len_buckets=(16,), block_buckets=(16,), decode_buckets=(4,))
    return EngineConfig(**{**defaults, **options})


@pytest.fixture(scope="module")
def model(kimi_k25):
    return load_checkpoint(kimi_k25[0], dtype="float32", progress=False)


def full_forward_greedy(model, prompt, images, n, with_logprobs=False):
    """Greedy continuation by full-sequence forwards with the images (placeholders expanded as the engine does);
    with `with_logprobs`, also the chosen tokens' log-probabilities. A generated placeholder id is fed back as id 0,
    which is how it embeds (as in transformers' generate)."""
    pixel_values, grid = preprocess_images(images or [], model.image_processor)
    ids = expand_placeholders(prompt, IMAGE, tokens_per_image(grid, 2))
    window = np.zeros((1, 64), np.int32)  # one shape for every prompt (the model is causal: the tail is ignored)
    window[0, :len(ids)] = ids
    logprobs = []
    for i in range(len(ids), len(ids) + n):
        feed = window.copy()
        feed[0, len(ids):i][feed[0, len(ids):i] == IMAGE] = 0
        logits = np.asarray(model(feed, pixel_values, grid) if images else model(feed), np.float64)[0, i - 1]
        window[0, i] = int(logits.argmax())
        logprobs.append(float(logits[window[0, i]] - logits.max() - np.log(np.exp(logits - logits.max()).sum())))
    tokens = window[0, len(ids):len(ids) + n].tolist()
    return (tokens, np.asarray(logprobs)) if with_logprobs else tokens


def test_greedy_description_equals_full_forward(model, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    text = lambda n: rng.integers(3, 200, n).tolist()  # noqa: E731
    inverted = 255 - np.asarray(Image.open(image("noise_101x67")).convert("RGB"))  # same 8x6 grid, other picture
    shared = text(18) + [IMAGE] + text(3)  # its 12 image tokens (18..29) straddle a block and a chunk boundary
    prompts = [
        (text(13) + [IMAGE] + text(5) + [IMAGE] + text(4), [image("noise_101x67"), image("alpha_64x129")]),
        (shared, [image("noise_101x67")]),
        (shared, [inverted]),  # equal token ids, another image
        (text(9), None),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
    refs = [full_forward_greedy(model, p, imgs, params.max_tokens, with_logprobs=True) for p, imgs in prompts]
    # Wrongly shared image blocks would show in the log-probabilities (compared to 2e-5) if not in the tokens.
    assert refs[1][0] != refs[2][0] or np.max(np.abs(refs[1][1] - refs[2][1])) > 1e-3, \
        f"the two images gave the same continuation: test is vacuous (seed {seed})"
    engine = Engine(model, None, config(seed=0))
    ids = [p for p, _ in prompts]
    images = [imgs for _, imgs in prompts]
    first = engine.generate(prompt_token_ids=ids, sampling_params=params, images=images)
    again = engine.generate(prompt_token_ids=ids[::-1], sampling_params=params, images=images[::-1])[::-1]
    for out, repeat, (tokens, logprobs) in zip(first, again, refs):
        assert out.error is None and out.token_ids == tokens, f"seed {seed}"
        assert repeat.token_ids == tokens, f"seed {seed} (prefix-cache hit)"
        np.testing.assert_allclose(out.logprobs, logprobs, atol=2e-5, err_msg=f"seed {seed}")
        np.testing.assert_allclose(repeat.logprobs, logprobs, atol=2e-5, err_msg=f"seed {seed} (prefix-cache hit)")
    # On the repeat every request reuses its own full blocks (at most len - 1 tokens), images included.
    assert [o.num_cached_tokens for o in again] == [48, 32, 32, 0]
    # A third picture behind the same ids reuses the text block (0..15) but not the block holding image tokens.
    mirrored = np.ascontiguousarray(inverted[:, ::-1])
    tokens, logprobs = full_forward_greedy(model, shared, [mirrored], params.max_tokens, with_logprobs=True)
    third = engine.generate(prompt_token_ids=[shared], sampling_params=params, images=[[mirrored]])[0]
    assert third.num_cached_tokens == 16, "blocks holding another image's tokens were shared"
    assert third.token_ids == tokens, f"seed {seed}"
    np.testing.assert_allclose(third.logprobs, logprobs, atol=2e-5, err_msg=f"seed {seed}")
    stats = engine.stats()
    assert stats["prefix_hit_rate"] > 0 and stats["running"] == stats["waiting"] == 0


def test_bad_image_requests_fail_alone(model, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    engine = Engine(model, None, config(max_image_patches=64))
    good = [5, 6, IMAGE, 7, 8]
    outs = engine.generate(
        prompt_token_ids=[good, good, good, [5, IMAGE, 6, IMAGE], [5, 6, 7], good],
        sampling_params=GREEDY,
        images=[image("gradient_37x53"), str(broken), image("wide_150x113"), image("gray_45x45"), None, None])
    assert outs[0].error is None and outs[0].token_ids == full_forward_greedy(
        model, good, [image("gradient_37x53")], GREEDY.max_tokens)
    errors = [o.error for o in outs[1:]]
    assert all(o.finish_reason == "error" and not o.token_ids for i, o in enumerate(outs) if i not in (0, 4))
    assert "cannot be read as an image" in errors[0] and "broken.png" in errors[0]
    assert "120 patches" in errors[1] and "max_image_patches" in errors[1]
    assert "2 image placeholder token(s)" in errors[2] and "1 image(s)" in errors[2]
    assert errors[3] is None and len(outs[4].token_ids) == GREEDY.max_tokens  # text only: fine
    assert "1 image placeholder token(s)" in errors[4] and "0 image(s)" in errors[4]
    with pytest.raises(RequestError, match="maximum"):  # 8x6 patches -> 12 tokens push the prompt past 192
        engine.add_request(prompt_token_ids=[5] * 185 + [IMAGE], images=[image("noise_101x67")],
                           sampling_params=GREEDY)
    sched = engine.scheduler
    assert sched.pool.num_free + sched.cache.num_cached_blocks == sched.pool.num_usable


def _until_eos(tokens, eos_ids):
    """The CLI has no ignore-eos flag: its greedy output ends at (and includes) the first of the model's eos ids."""
    ends = [i for i, t in enumerate(tokens) if t in eos_ids]
    return tokens[:ends[0] + 1] if ends else tokens


def test_generate_cli_with_images(kimi_k25, model, tmp_path, capsys):
    """--prompt/--image with a tokenizer whose vocabulary has the placeholder, and a JSONL with image fields."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from dayzero.serving.cli import main

    path = tmp_path / "ckpt"
    shutil.copytree(kimi_k25[0], path)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    vocab["<|media_pad|>"] = vocab.pop(f"w{IMAGE}")
    hf = HFTokenizer(WordLevel(vocab, unk_token="w0"))
    hf.pre_tokenizer = Whitespace()
    hf.add_special_tokens([AddedToken("<|media_pad|>", special=True)])
    hf.save(str(path / "tokenizer.json"))
    out = tmp_path / "text.jsonl"
    assert main(["--model", str(path), "--prompt", "w4 w5 <|media_pad|> w6", "--image", image("gray_45x45"),
                 "--max-tokens", "3", "--output", str(out), *SMALL]) == 0
    row = json.loads(out.read_text())
    eos = model.config.eos_token_ids
    assert row["token_ids"] == _until_eos(full_forward_greedy(model, [4, 5, IMAGE, 6], [image("gray_45x45")], 3), eos)
    shutil.copy(image("gradient_37x53"), tmp_path / "picture.png")
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in [
        {"prompt_token_ids": [9, IMAGE, 10], "image": "picture.png", "max_tokens": 2},
        {"prompt_token_ids": [9, IMAGE, 10], "images": ["absent.png"], "max_tokens": 2}]) + "\n")
    out = tmp_path / "ids.jsonl"
    assert main(["--model", str(path), "--input", str(src), "--output", str(out), *SMALL]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["token_ids"] == _until_eos(full_forward_greedy(model, [9, IMAGE, 10], [image("gradient_37x53")], 2),
                                              eos)
    assert rows[1]["finish_reason"] == "error" and "absent.png" in rows[1]["error"]
    assert "rejected" in capsys.readouterr().err
