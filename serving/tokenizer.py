"""Tokenizers for published checkpoints, and incremental detokenization for streaming.

`load_tokenizer(checkpoint_dir)` looks, in this order, for

- `tokenizer.json` (Hugging Face `tokenizers` format; DeepSeek-V3/V3.2 and most hub models), loaded with the
  `tokenizers` library. Special tokens are the file's `added_tokens` marked special (plus any special entry of
  `tokenizer_config.json`'s `added_tokens_decoder` that the file lacks, added at its declared id);
- `tiktoken.model` (Kimi, Kimi-Linear, Kimi-K2/K2.5): one `base64(token bytes) rank` line per mergeable token,
  run by `tiktoken` with Kimi's pre-tokenization regex. The special tokens sit right after the mergeable ranks
  (163584+ for Kimi): `tokenizer_config.json`'s `added_tokens_decoder` names them; the rest of the 256 reserved
  ids are `<|reserved_token_{id}|>`, as in Kimi's own `tokenization_kimi.py`.

and returns None when neither exists (the engine then takes raw token ids only).

`bos_token`/`eos_token` come from `tokenizer_config.json` (a string or an `{"content": ...}` object).
`eos_token_ids` is that eos followed by every `eos_token_id` of `generation_config.json` (chat models stop on
`<|im_end|>` there), falling back to `config.json`'s when neither file names one. `add_bos_token: true` in
`tokenizer_config.json` makes `encode(..., add_special_tokens=True)` start with BOS when the tokenizer's own
post-processor did not put it there; without it, a `tokenizer.json` post-processor decides (as in
`transformers` 5) and the tiktoken path adds nothing (as Kimi's tokenizer).

Files that exist but cannot be read or parsed raise `CheckpointError` naming the file.
"""

from __future__ import annotations

import abc

import base64
import binascii
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dayzero.model.errors import CheckpointError

__all__ = ["IncrementalDecoder", "KIMI_PAT_STR", "Tokenizer", "load_tokenizer"]

# Kimi's pre-tokenization regex (tokenization_kimi.py `TikTokenTokenizer.pat_str`): runs of Han characters are
# split from other letters; letters follow the cl100k/o200k shape with `&&[^\p{Han}]` class intersections (which
# tiktoken's fancy-regex engine supports); numbers in groups of at most three.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256
# Kimi's tokenizer defaults when tokenizer_config.json names no bos/eos.
_KIMI_DEFAULT_BOS, _KIMI_DEFAULT_EOS = "[BOS]", "[EOS]"
# tiktoken is slow (quadratic) on very long runs of whitespace or non-whitespace and panics on huge inputs
# (openai/tiktoken#195); such text is encoded in pieces, as Kimi's tokenizer does.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000


class Tokenizer:
    """A checkpoint's tokenizer: `tokenizers` (tokenizer.json) or `tiktoken` (tiktoken.model) underneath.

    Attributes: `vocab_size` (ids the tokenizer knows, special tokens included; the model's embedding may be
    larger), `bos_token_id` (int or None), `eos_token_ids` (tuple, possibly empty), `eos_token_id` (the first of
    them or None), `special_token_ids` (frozenset; dropped by `decode(..., skip_special_tokens=True)`),
    `backend` ("tokenizers" or "tiktoken"), `path` (the file it was read from).
    """

    def __init__(self, backend: _Backend, *, path: Path, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos_token: bool = False):
        self._backend = backend
        self.path = Path(path)
        self.backend = backend.name
        self.vocab_size: int = backend.vocab_size
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.special_token_ids: frozenset[int] = frozenset(backend.special_ids)
        self.add_bos_token = bool(add_bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token strings in the text become their ids (as in `transformers`).
        `add_special_tokens` applies the tokenizer's post-processor (BOS and the like) and `add_bos_token`."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids the tokenizer does not know (negative, or in the padding between the tokenizer's and
        the model's vocabulary) are dropped; byte sequences that are not valid UTF-8 decode to U+FFFD."""
        keep = [i for i in (int(t) for t in ids) if 0 <= i < self.vocab_size]
        if skip_special_tokens:
            keep = [i for i in keep if i not in self.special_token_ids]
        return self._backend.decode(keep, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of one token given as its vocabulary string (special tokens by their text), or None."""
        return self._backend.token_to_id(token)

    def __repr__(self) -> str:
        return (f"Tokenizer(backend={self.backend!r}, path='{self.path}', vocab_size={self.vocab_size}, "
                f"bos_token_id={self.bos_token_id}, eos_token_ids={self.eos_token_ids})")


class IncrementalDecoder:
    """Streams text as tokens arrive: `push(token_id)` returns the newly completed text ('' while a character
    is still incomplete, e.g. the first bytes of a multi-byte UTF-8 character), `finish()` whatever is held back.

    Prefix-offset technique (as in vLLM / TGI): keep a short window of already-emitted tokens, decode the window
    with and without the new tokens and emit the difference once it does not end in U+FFFD. Decoding the window
    rather than the new token alone keeps word-boundary effects (SentencePiece's leading space, byte-level
    merges) right. `prompt_ids` (their last `context` tokens) seed the window so the first generated token
    decodes as it would after the prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, context: int = 5):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids][-context:] if context > 0 else []
        self._prefix = 0  # window start: tokens before it are emitted and no longer needed
        self._read = len(self._ids)  # tokens before it are emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._advance()
            return new_text[len(prefix_text):]
        return ""

    def _advance(self) -> None:
        # Everything is emitted: the next window is the tokens emitted last; drop the ones before it.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def finish(self) -> str:
        """Text still held back at the end of the stream (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._advance()
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


# ---------------------------------------------------------------------------------------------------------------
# Backends


class _Backend(abc.ABC):
    """What `Tokenizer` needs from a tokenizer library."""

    name: str
    vocab_size: int
    special_ids: frozenset[int]

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`."""

    @abc.abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Text of `ids`."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of one token string, or None."""


class _HFBackend(_Backend):
    name = "tokenizers"

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text, add_special_tokens):
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token):
        return self.tok.token_to_id(token)


class _TiktokenBackend(_Backend):
    name = "tiktoken"

    def __init__(self, enc, special_tokens: dict[str, int], special_ids: Iterable[int]):
        self.enc = enc
        self.vocab_size = enc.n_vocab
        self.special_ids = frozenset(special_ids)
        self._special_by_text = dict(special_tokens)

    def encode(self, text, add_special_tokens):
        ids: list[int] = []
        for piece in _tiktoken_pieces(text):
            ids.extend(self.enc.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids, skip_special_tokens):
        return self.enc.decode(ids, errors="replace")

    def token_to_id(self, token):
        if token in self._special_by_text:
            return self._special_by_text[token]
        try:
            return self.enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None


def _tiktoken_pieces(text: str) -> Iterator[str]:
    """Splits text so no piece has more than _TIKTOKEN_MAX_RUN consecutive whitespace or non-whitespace chars."""
    if len(text) <= _TIKTOKEN_MAX_RUN:
        yield text
        return
    for start in range(0, len(text), _TIKTOKEN_MAX_CHARS):
        chunk = text[start:start + _TIKTOKEN_MAX_CHARS]
        piece_start, run, run_is_space = 0, 0, None
        for i, ch in enumerate(chunk):
            is_space = ch.isspace()
            if is_space != run_is_space:
                run, run_is_space = 1, is_space
            else:
                run += 1
                if run > _TIKTOKEN_MAX_RUN:
                    yield chunk[piece_start:i]
                    piece_start, run = i, 1
        yield chunk[piece_start:]


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(checkpoint_dir: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer published with a checkpoint (see the module docstring), or None when it ships none."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    config = _read_json(directory / "tokenizer_config.json")
    if (directory / "tokenizer.json").is_file():
        return _load_hf(directory, config)
    if (directory / "tiktoken.model").is_file():
        return _load_tiktoken(directory, config)
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def _token_content(value: Any, path: Path, field: str) -> str | None:
    """A special-token field of tokenizer_config.json: a string, an AddedToken object, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(f"{path}: field '{field}' is neither a string nor an object with a 'content' string")


def _added_tokens_decoder(config: dict | None, path: Path) -> dict[int, tuple[str, bool]]:
    """tokenizer_config.json's added_tokens_decoder as {id: (content, special)}."""
    raw = (config or {}).get("added_tokens_decoder") or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: field 'added_tokens_decoder' is not an object")
    out = {}
    for key, entry in raw.items():
        try:
            index = int(key)
        except ValueError:
            raise CheckpointError(f"{path}: field 'added_tokens_decoder' has a non-integer id {key!r}") from None
        content = _token_content(entry, path, f"added_tokens_decoder.{key}")
        if content is None:
            raise CheckpointError(f"{path}: field 'added_tokens_decoder.{key}' has no content")
        special = bool(entry.get("special", True)) if isinstance(entry, dict) else True
        out[index] = (content, special)
    return out


def _id_of(backend: _Backend, token: str | None, config_path: Path, field: str) -> int | None:
    if token is None:
        return None
    index = backend.token_to_id(token)
    if index is None:
        raise CheckpointError(f"{config_path}: field '{field}' names {token!r}, which is not in the vocabulary")
    return index


def _ids_field(value: Any, path: Path, field: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{path}: field '{field}' is not an integer or a list of integers")
    return list(values)


def _special_ids_from_configs(directory: Path, key: str) -> list[int]:
    """`key` (bos_token_id / eos_token_id) from generation_config.json, else config.json (top level or
    text_config)."""
    path = directory / "generation_config.json"
    ids = _ids_field((_read_json(path) or {}).get(key), path, key)
    if ids:
        return ids
    path = directory / "config.json"
    config = _read_json(path) or {}
    ids = _ids_field(config.get(key), path, key)
    if not ids and isinstance(config.get("text_config"), dict):
        ids = _ids_field(config["text_config"].get(key), path, f"text_config.{key}")
    return ids


def _finish(backend: _Backend, directory: Path, file: Path, config: dict | None,
            default_bos: str | None = None, default_eos: str | None = None) -> Tokenizer:
    config_path = directory / "tokenizer_config.json"
    config = config or {}
    bos_name = _token_content(config.get("bos_token", default_bos), config_path, "bos_token")
    eos_name = _token_content(config.get("eos_token", default_eos), config_path, "eos_token")
    if "bos_token" not in config and bos_name is not None and backend.token_to_id(bos_name) is None:
        bos_name = None  # a backend default that this vocabulary does not have
    if "eos_token" not in config and eos_name is not None and backend.token_to_id(eos_name) is None:
        eos_name = None
    bos = _id_of(backend, bos_name, config_path, "bos_token")
    eos = _id_of(backend, eos_name, config_path, "eos_token")
    eos_ids = ([eos] if eos is not None else []) + _special_ids_from_configs(directory, "eos_token_id")
    if bos is None:
        bos_ids = _special_ids_from_configs(directory, "bos_token_id")
        bos = bos_ids[0] if bos_ids else None
    add_bos = config.get("add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise CheckpointError(f"{config_path}: field 'add_bos_token' is not a boolean")
    return Tokenizer(backend, path=file, bos_token_id=bos, eos_token_ids=eos_ids, add_bos_token=add_bos)


def _load_hf(directory: Path, config: dict | None) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    file = directory / "tokenizer.json"
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a plain Exception on bad JSON or an unknown model
        raise CheckpointError(f"{file}: cannot load tokenizer: {e}") from None
    # Special tokens tokenizer_config.json declares but tokenizer.json lacks (transformers adds them too).
    config_path = directory / "tokenizer_config.json"
    for index, (content, special) in sorted(_added_tokens_decoder(config, config_path).items()):
        if tok.token_to_id(content) is not None:
            continue
        if index != tok.get_vocab_size(with_added_tokens=True):
            raise CheckpointError(f"{config_path}: added token {content!r} (id {index}) is not in {file} and "
                                  f"cannot be added at that id")
        tok.add_tokens([AddedToken(content, special=special, normalized=not special)])
    return _finish(_HFBackend(tok), directory, file, config)


def _read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    try:
        data = file.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{file}: line {lineno} is not 'base64-token rank'") from None
    if not ranks:
        raise CheckpointError(f"{file}: no tokens")
    if len(set(ranks.values())) != len(ranks):
        raise CheckpointError(f"{file}: duplicate ranks")
    return ranks


def _load_tiktoken(directory: Path, config: dict | None) -> Tokenizer:
    import tiktoken

    file = directory / "tiktoken.model"
    config_path = directory / "tokenizer_config.json"
    ranks = _read_tiktoken_ranks(file)
    num_base = max(ranks.values()) + 1
    added = _added_tokens_decoder(config, config_path)
    # Special tokens follow the mergeable ranks; ids tokenizer_config.json does not name are reserved.
    last = max([num_base + KIMI_NUM_RESERVED_SPECIAL_TOKENS - 1, *added])
    special_tokens: dict[str, int] = {}
    skip: set[int] = set()
    for index in range(num_base, last + 1):
        content, special = added.get(index, (f"<|reserved_token_{index}|>", True))
        if content in special_tokens:
            raise CheckpointError(f"{config_path}: added token {content!r} appears twice "
                                  f"(ids {special_tokens[content]} and {index})")
        special_tokens[content] = index
        if special:
            skip.add(index)
    try:
        enc = tiktoken.Encoding(name=f"dayzero:{file}", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                special_tokens=special_tokens)
    except Exception as e:
        raise CheckpointError(f"{file}: cannot build a tiktoken encoding: {e}") from None
    return _finish(_TiktokenBackend(enc, special_tokens, skip), directory, file, config,
                   default_bos=_KIMI_DEFAULT_BOS, default_eos=_KIMI_DEFAULT_EOS)
