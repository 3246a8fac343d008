"""dayzero.serving.tokenizer: tokenizer.json and tiktoken.model loading, special tokens, incremental decoding.

Every fixture is built here at test time in a tmp dir: a byte-level BPE trained with `tokenizers` on a tiny
corpus (checked against transformers' AutoTokenizer), and a small Kimi-style tiktoken.model.
"""

from __future__ import annotations

import base64
import json

import pytest

from dayzero.model.errors import CheckpointError
from dayzero.serving.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

CORPUS = [
    "Hello world, hello tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "dayzero serves sparse mixture-of-experts models on the day they are published.",
    "Streaming text arrives one token at a time; 12345 + 678 = 13023.",
    "中文也可以，你好世界。",
    "emoji: 🙂 🚀 and accents: café naïve",
] * 4

STRINGS = [
    "Hello world",
    "the lazy fox jumps",
    "unseen wOrDs and 98765 digits!",
    "你好，世界 🙂🚀 café",
    "  leading spaces\nand\ttabs  ",
]


def _write_json(path, data):
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# tokenizer.json


def _train_bpe(post_processor: bool):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tok")
    _train_bpe(post_processor=True).save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
    })
    _write_json(path / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [1, 3]})
    return path


@pytest.fixture(scope="module")
def hf_tok(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, Tokenizer)
    return tok


def test_tokenizer_json_special_tokens(hf_tok, hf_dir):
    assert hf_tok.backend == "tokenizers"
    assert hf_tok.path == hf_dir / "tokenizer.json"
    assert hf_tok.bos_token_id == hf_tok.token_to_id("<s>") == 0
    # tokenizer_config's eos first, then generation_config's extra stop ids (<|im_end|> = 3), deduplicated.
    assert hf_tok.eos_token_ids == (1, 3)
    assert hf_tok.eos_token_id == 1
    assert hf_tok.special_token_ids == {0, 1, 2, 3}
    assert hf_tok.vocab_size == 400


def test_tokenizer_json_round_trip(hf_tok):
    for text in STRINGS:
        ids = hf_tok.encode(text)
        assert ids[0] == hf_tok.bos_token_id and ids.count(hf_tok.bos_token_id) == 1
        assert hf_tok.encode(text, add_special_tokens=False) == ids[1:]
        assert hf_tok.decode(ids) == text
        assert hf_tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    # Special-token text in the input becomes the special id; decode drops it unless asked to keep it.
    ids = hf_tok.encode("Hello</s>", add_special_tokens=False)
    assert ids[-1] == 1
    assert hf_tok.decode(ids) == "Hello"
    assert hf_tok.decode(ids, skip_special_tokens=False) == "Hello</s>"
    # Ids the tokenizer does not know (the model's padded vocabulary, negative) are dropped, not an error.
    assert hf_tok.decode([*hf_tok.encode("Hello", False), 10_000, -1]) == "Hello"


def test_tokenizer_json_matches_transformers(hf_tok, hf_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_dir))
    assert ref.bos_token_id == hf_tok.bos_token_id and ref.eos_token_id == hf_tok.eos_token_id
    for text in STRINGS + ["<s>inline special</s> tokens"]:
        ids = hf_tok.encode(text)
        assert ids == ref.encode(text), text
        assert hf_tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        assert hf_tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert hf_tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text


def test_add_bos_token_without_post_processor(tmp_path):
    _train_bpe(post_processor=False).save(str(tmp_path / "tokenizer.json"))
    _write_json(tmp_path / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>"})
    plain = load_tokenizer(tmp_path)
    assert plain.encode("Hello world") == plain.encode("Hello world", add_special_tokens=False)
    assert plain.encode("Hello world")[0] != 0
    _write_json(tmp_path / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    with_bos = load_tokenizer(tmp_path)
    assert with_bos.encode("Hello world") == [0, *plain.encode("Hello world")]
    assert with_bos.encode("Hello world", add_special_tokens=False) == plain.encode("Hello world")


def test_added_token_only_in_tokenizer_config(tmp_path):
    tok = _train_bpe(post_processor=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    _write_json(tmp_path / "tokenizer_config.json", {
        "eos_token": "<|eot|>",
        "added_tokens_decoder": {"400": {"content": "<|eot|>", "special": True}},
    })
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token_ids == (400,)
    assert loaded.encode("Hi<|eot|>")[-1] == 400
    assert loaded.decode(loaded.encode("Hi<|eot|>")) == "Hi"


# ---------------------------------------------------------------------------------------------------------------
# tiktoken.model (Kimi)

MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"12", b"123", b"1234",
          "中".encode()[:2], "中".encode(), "文".encode()[:2], "文".encode(), "中文".encode(),
          "文".encode() + b"a", b"ab", b"abc"]
NUM_BASE = 256 + len(MERGES)


def _write_tiktoken(path):
    lines = [base64.b64encode(bytes([b])).decode() + f" {b}" for b in range(256)]
    lines += [base64.b64encode(token).decode() + f" {256 + i}" for i, token in enumerate(MERGES)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_tok")
    _write_tiktoken(path)
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": {
            str(NUM_BASE): {"content": "[BOS]", "special": True},
            str(NUM_BASE + 1): {"content": "[EOS]", "special": True},
            str(NUM_BASE + 2): {"content": "<|im_end|>", "special": True},
            str(NUM_BASE + 3): {"content": "<|plain_added|>", "special": False},
        },
    })
    _write_json(path / "generation_config.json", {"eos_token_id": NUM_BASE + 2})
    return path


@pytest.fixture(scope="module")
def kimi_tok(kimi_dir):
    return load_tokenizer(kimi_dir)


def test_tiktoken_special_tokens(kimi_tok, kimi_dir):
    assert kimi_tok.backend == "tiktoken"
    assert kimi_tok.path == kimi_dir / "tiktoken.model"
    assert kimi_tok.bos_token_id == NUM_BASE
    assert kimi_tok.eos_token_ids == (NUM_BASE + 1, NUM_BASE + 2)
    assert kimi_tok.vocab_size == NUM_BASE + 256  # Kimi reserves 256 special ids after the ranks
    assert kimi_tok.token_to_id("<|im_end|>") == NUM_BASE + 2
    assert kimi_tok.token_to_id(f"<|reserved_token_{NUM_BASE + 10}|>") == NUM_BASE + 10
    assert kimi_tok.token_to_id("hello") == 256 + MERGES.index(b"hello")
    assert NUM_BASE + 3 not in kimi_tok.special_token_ids and NUM_BASE + 10 in kimi_tok.special_token_ids


def test_tiktoken_round_trip_unicode(kimi_tok):
    for text in STRINGS + ["hello world", "中文汉字 mixed with English and 😀👍🏽 emoji\n\nnew lines"]:
        ids = kimi_tok.encode(text)
        assert kimi_tok.encode(text, add_special_tokens=False) == ids  # Kimi adds no BOS
        assert kimi_tok.decode(ids) == text
    assert kimi_tok.encode("hello world") == [256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")]


def test_tiktoken_uses_kimi_pretokenizer(kimi_tok):
    rank = {t: 256 + i for i, t in enumerate(MERGES)}
    # Han runs are split from Latin letters: the "文a" merge exists but must not cross the boundary.
    assert kimi_tok.encode("中文abc") == [rank["中文".encode()], rank[b"abc"]]
    # Numbers go in groups of at most three digits: "1234" is a token but "12345" -> "123" "45".
    assert kimi_tok.encode("12345") == [rank[b"123"], ord("4"), ord("5")]


def test_tiktoken_special_ids_decode_and_skip(kimi_tok):
    ids = kimi_tok.encode("[BOS]hello<|im_end|>中文[EOS]")
    assert ids[0] == NUM_BASE and ids[-1] == NUM_BASE + 1 and NUM_BASE + 2 in ids
    assert kimi_tok.decode(ids) == "hello中文"
    assert kimi_tok.decode(ids, skip_special_tokens=False) == "[BOS]hello<|im_end|>中文[EOS]"
    reserved = NUM_BASE + 100
    assert kimi_tok.decode([reserved], skip_special_tokens=False) == f"<|reserved_token_{reserved}|>"
    assert kimi_tok.decode([reserved, 256 + MERGES.index(b"hello")]) == "hello"
    # A non-special added token stays in the text; unknown ids are dropped.
    assert kimi_tok.decode([NUM_BASE + 3, kimi_tok.vocab_size, -5]) == "<|plain_added|>"


def test_tiktoken_add_bos_token(tmp_path):
    _write_tiktoken(tmp_path)
    _write_json(tmp_path / "tokenizer_config.json", {
        "add_bos_token": True,
        "added_tokens_decoder": {str(NUM_BASE): {"content": "[BOS]", "special": True},
                                 str(NUM_BASE + 1): {"content": "[EOS]", "special": True}},
    })
    tok = load_tokenizer(tmp_path)  # bos/eos default to Kimi's [BOS]/[EOS]
    assert (tok.bos_token_id, tok.eos_token_ids) == (NUM_BASE, (NUM_BASE + 1,))
    assert tok.encode("hello") == [NUM_BASE, 256 + MERGES.index(b"hello")]
    assert tok.encode("hello", add_special_tokens=False) == [256 + MERGES.index(b"hello")]


# ---------------------------------------------------------------------------------------------------------------
# IncrementalDecoder

STREAM_TEXT = "Hi 你好 🙂🚀 café — naïve 中文 😀👍🏽 done"


@pytest.mark.parametrize("which", ["hf", "kimi"])
def test_incremental_decoder_multibyte(which, hf_tok, kimi_tok):
    tok = hf_tok if which == "hf" else kimi_tok
    ids = tok.encode(STREAM_TEXT, add_special_tokens=False) + [tok.eos_token_id]
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    tail = decoder.finish()
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + tail == tok.decode(ids) == STREAM_TEXT
    assert tail == ""
    # Characters split over several byte tokens were held back, then emitted whole.
    assert "" in pieces[:-1]
    assert any(p == "🙂" or p.endswith("🙂") for p in pieces)


def test_incremental_decoder_keeps_special_tokens_when_asked(kimi_tok):
    ids = kimi_tok.encode("[BOS]hello 中文[EOS]")
    decoder = IncrementalDecoder(kimi_tok, skip_special_tokens=False)
    assert decoder.push_many(ids) + decoder.finish() == "[BOS]hello 中文[EOS]"


def test_incremental_decoder_prompt_context_metaspace(tmp_path):
    """SentencePiece-style decoders strip the first token's leading space; the window keeps it mid-stream."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁": 3, "!": 4}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.decode([1, 2]) == "Hello world" and loaded.decode([2]) == "world"
    decoder = IncrementalDecoder(loaded, prompt_ids=[1])
    assert decoder.push(2) == " world"
    assert decoder.push(2) == " world"
    assert IncrementalDecoder(loaded).push(1) == "Hello"


def test_incremental_decoder_finish_flushes_incomplete(kimi_tok):
    decoder = IncrementalDecoder(kimi_tok)
    first_bytes = list("🙂".encode())[:2]
    assert decoder.push_many(first_bytes) == ""
    assert decoder.finish() == "\ufffd"


# ---------------------------------------------------------------------------------------------------------------
# Missing and corrupt files


def test_no_tokenizer_files_returns_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
    _write_json(tmp_path / "tokenizer_config.json", {"eos_token": "</s>"})
    assert load_tokenizer(tmp_path) is None


def test_missing_directory_raises(tmp_path):
    with pytest.raises(CheckpointError, match="does-not-exist"):
        load_tokenizer(tmp_path / "does-not-exist")


def test_corrupt_tokenizer_json_names_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def test_corrupt_tokenizer_config_names_file(hf_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer_config.json") in str(info.value)
    _write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<|not-a-token|>"})
    with pytest.raises(CheckpointError, match="eos_token"):
        load_tokenizer(tmp_path)


def test_corrupt_tiktoken_model_names_file(tmp_path):
    _write_tiktoken(tmp_path)
    with open(tmp_path / "tiktoken.model", "a") as f:
        f.write("!!!not-base64!!! 9999\n")
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tiktoken.model") in str(info.value) and "line" in str(info.value)
