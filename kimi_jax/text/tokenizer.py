"""Tokenizers: the Kimi tiktoken BPE (``tiktoken.model`` + ``tokenizer_config.json``) and HF ``tokenizer.json``.

Kimi (K2 / Kimi Linear / K3, K3_SPEC §6): byte-level BPE whose ``tiktoken.model`` holds one
``base64(token bytes) rank`` pair per line; the ``num_base`` ranks are followed by 256 reserved special ids,
named by ``tokenizer_config.json -> added_tokens_decoder`` (unnamed ones become ``<|reserved_token_{id}|>``).
``encode`` adds no BOS, and treats ``<|...|>`` in text as ordinary text unless ``allow_special`` is set:
user text can never forge a control token. Llama-shaped models ship ``tokenizer.json``, read with the
``tokenizers`` library.

The real Kimi vocabulary is not shipped here. :func:`write_demo_tokenizer` trains a small vocabulary in the
same file format (for the embedded tiny K3) with :func:`train_bpe`.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import collections
import json
import os
from typing import Iterator, Sequence

import regex
import tiktoken
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTok

# The K3 split pattern (identical to K2's). `&&` is a character-class intersection: Rust fancy-regex
# (tiktoken), Oniguruma (HF tokenizers) and Python `regex` in V1 mode understand it.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTION,
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

NUM_RESERVED_SPECIAL = 256
# Named specials of the K3 tokenizer_config, as offsets from the first special id (163584 in the release).
K3_SPECIAL_NAMES = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>", 19: "<|media_content|>",
    20: "<|media_end|>", 21: "<|media_pad|>", 254: "[UNK]", 255: "[PAD]",
}
END_OF_MSG = "<|end_of_msg|>"

# tiktoken panics on very long inputs and on very long runs of (non-)whitespace; the reference splits both.
_MAX_CHARS = 400_000
_MAX_RUN = 25_000


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read, or a token id / name that does not exist."""


class Tokenizer:
    """What generation and chat need from a tokenizer."""

    vocab_size: int  # ids are 0 .. vocab_size-1
    specials: dict[str, int]  # special-token name -> id
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        raise NotImplementedError

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def special_id(self, name: str) -> int:
        if name not in self.specials:
            raise TokenizerError(f"tokenizer has no special token {name!r}")
        return self.specials[name]

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenizer: feeds token ids, returns only complete UTF-8 text (multi-byte characters can
    be split across tokens)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        return self._utf8.decode(self.tokenizer.decode_bytes(ids)) if len(ids) else ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# -- Kimi tiktoken ------------------------------------------------------------------------------------------


def read_tiktoken_model(path) -> dict[bytes, int]:
    """Parse a ``tiktoken.model`` file: ``base64(token) rank`` per line, ranks exactly 0..n-1."""
    path = os.fspath(path)
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise TokenizerError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:80]!r}")
            try:
                token = base64.b64decode(parts[0], validate=True)
                rank = int(parts[1])
            except (binascii.Error, ValueError) as e:
                raise TokenizerError(f"{path}:{lineno}: unreadable entry {line[:80]!r} ({e})") from None
            if token in ranks:
                raise TokenizerError(f"{path}:{lineno}: token {token!r} listed twice (ranks {ranks[token]}, {rank})")
            ranks[token] = rank
    if not ranks:
        raise TokenizerError(f"{path}: empty tiktoken model")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} (each once)")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: byte-level BPE needs all 256 single bytes; missing {missing[:8]}...")
    return ranks


def write_tiktoken_model(path, ranks: dict[bytes, int]) -> None:
    with open(path, "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")


def _token_name(value) -> str | None:
    """``bos_token`` etc. in tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"unreadable token entry {value!r}")


def _split_long(text: str) -> Iterator[str]:
    """Pieces of at most _MAX_CHARS characters with no run of more than _MAX_RUN (non-)whitespace characters."""
    for start in range(0, len(text), _MAX_CHARS):
        chunk = text[start : start + _MAX_CHARS]
        begin, run, space = 0, 0, None
        for i, ch in enumerate(chunk):
            s = ch.isspace()
            run = run + 1 if s == space else 1
            space = s
            if run > _MAX_RUN:
                yield chunk[begin:i]
                begin, run = i, 1
        yield chunk[begin:]


class KimiTokenizer(Tokenizer):
    """tiktoken BPE with the K3 split pattern and 256 reserved special ids above the base vocabulary."""

    def __init__(self, tiktoken_path, config: dict | None = None, *, config_path: str | None = None):
        ranks = read_tiktoken_model(tiktoken_path)
        self.num_base = len(ranks)
        self.vocab_size = self.num_base + NUM_RESERVED_SPECIAL
        config = config or {}
        where = config_path or "tokenizer_config.json"
        named: dict[int, str] = {}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise TokenizerError(f"{where}: added_tokens_decoder key {key!r} is not a token id") from None
            if not self.num_base <= tid < self.vocab_size:
                raise TokenizerError(f"{where}: special id {tid} outside the reserved range "
                                     f"{self.num_base}..{self.vocab_size - 1} of {tiktoken_path}")
            named[tid] = _token_name(entry)
        self.specials = {}
        for tid in range(self.num_base, self.vocab_size):
            name = named.get(tid) or f"<|reserved_token_{tid}|>"
            if name in self.specials:
                raise TokenizerError(f"{where}: special token {name!r} names two ids ({self.specials[name]}, {tid})")
            self.specials[name] = tid
        self.names = {tid: name for name, tid in self.specials.items()}
        self._enc = tiktoken.Encoding(name=os.path.basename(os.fspath(tiktoken_path)), pat_str=KIMI_PAT_STR,
                                      mergeable_ranks=ranks, special_tokens=self.specials)
        self.bos_id = self._named_id(config, "bos_token", where)
        self.eos_id = self._named_id(config, "eos_token", where)

    def _named_id(self, config, key, where):
        name = _token_name(config.get(key))
        if name is None:
            return None
        if name not in self.specials:
            raise TokenizerError(f"{where}: {key} {name!r} is not a special token of this vocabulary")
        return self.specials[name]

    @classmethod
    def from_dir(cls, path) -> "KimiTokenizer":
        path = os.fspath(path)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        config = None
        if os.path.exists(cfg_path):
            try:
                with open(cfg_path) as f:
                    config = json.load(f)
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from None
        return cls(os.path.join(path, "tiktoken.model"), config, config_path=cfg_path)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        out: list[int] = []
        for piece in _split_long(text):
            if allow_special:
                out.extend(self._enc.encode(piece, allowed_special="all"))
            else:  # "<|open|>" typed by a user stays text
                out.extend(self._enc.encode(piece, allowed_special=set(), disallowed_special=()))
        return out

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} outside the vocabulary 0..{self.vocab_size - 1}")
        return self._enc.decode_bytes(ids)


# -- HF tokenizer.json --------------------------------------------------------------------------------------


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` (Llama-shaped models) through the ``tokenizers`` library.

    ``encode`` applies the file's post-processor (Llama's adds BOS, as HF transformers does by default).
    """

    def __init__(self, path, config: dict | None = None):
        try:
            self._tok = HFTok.from_file(os.fspath(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise TokenizerError(f"{path}: cannot read tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        config = config or {}
        self.bos_id = self._lookup(_token_name(config.get("bos_token")))
        self.eos_id = self._lookup(_token_name(config.get("eos_token")))

    def _lookup(self, name):
        return None if name is None else self._tok.token_to_id(name)

    @classmethod
    def from_dir(cls, path) -> "HFTokenizer":
        path = os.fspath(path)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        config = None
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                config = json.load(f)
        return cls(os.path.join(path, "tokenizer.json"), config)

    def encode(self, text: str, *, allow_special: bool = False, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        # The library always parses added special tokens in text; without allow_special the caller gets
        # an error instead of a silently forged control token.
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not allow_special:
            special_ids = set(self.specials.values())
            plain = self._tok.encode(text, add_special_tokens=False).ids
            if any(i in special_ids for i in plain):
                raise TokenizerError("text contains special-token markup; pass allow_special=True to encode it")
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} outside the vocabulary 0..{self.vocab_size - 1}")
        return self._tok.decode(ids, skip_special_tokens=False)

    def stream_decoder(self) -> "StreamDecoder":
        return _HFStreamDecoder(self)


class _HFStreamDecoder(StreamDecoder):
    """``tokenizers`` decodes whole sequences (byte-fallback pieces, SentencePiece spaces): re-decode the
    running sequence and emit the new suffix once it no longer ends in a replacement character."""

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer, self._ids, self._emitted = tokenizer, [], 0

    def push(self, ids):
        self._ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted :], len(text)
        return new

    def flush(self):
        text = self.tokenizer.decode(self._ids)
        new, self._emitted = text[self._emitted :], len(text)
        return new


# -- loading ------------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json")


def has_tokenizer(path) -> bool:
    path = os.fspath(path)
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a model directory: ``tiktoken.model`` (Kimi) or ``tokenizer.json`` (HF)."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, "tiktoken.model")):
        return KimiTokenizer.from_dir(path)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return HFTokenizer.from_dir(path)
    raise TokenizerError(f"{path}: no tokenizer files ({' or '.join(TOKENIZER_FILES)}); "
                         "pass token ids instead of text, or a tokenizer")


# -- a small vocabulary in the Kimi format (embedded demo) -------------------------------------------------


def train_bpe(text: str, num_base: int, pat_str: str = KIMI_PAT_STR) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then ``num_base - 256`` merges learned greedily from ``text``.

    Ties between equally frequent pairs go to the lexicographically smallest (left, right) bytes, so the
    result is deterministic.
    """
    if num_base < 256:
        raise ValueError(f"num_base {num_base} < 256: byte-level BPE needs every single byte")
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(tuple(bytes([b]) for b in w.encode()) for w in regex.findall(pat_str, text,
                                                                                              flags=regex.V1))
    while len(ranks) < num_base:
        pairs: collections.Counter = collections.Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        pairs = {p: n for p, n in pairs.items() if p[0] + p[1] not in ranks}
        if not pairs:
            raise ValueError(f"training text too small: only {len(ranks)} tokens for num_base {num_base}")
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        ranks[merged] = len(ranks)
        new_words: collections.Counter = collections.Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += n
        words = new_words
    return ranks


_DEMO_TEXT = """\
Kimi is a family of large language models. This tiny model has random weights, so what it writes is noise,
but every step of the pipeline is real: the checkpoint is written in the released layout, the tokenizer file
has the same format as the real one, and generation runs through the same jitted prefill and decode loop.
The quick brown fox jumps over the lazy dog. The capital of France is Paris. One, two, three, four, five.
A message has a role: the user asks, the assistant thinks and then gives a response. The system may declare
tools; a tool call names the tool and its arguments, and the tool answers with a result.
Linear attention keeps a recurrent state; latent attention keeps a compressed cache of keys and values.
Experts are chosen by a router, and each token visits only a few of them. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100
2024 3.14159. Punctuation, quotes "like this", (parentheses), [brackets], {braces}; colons: and dashes - too!
你好，世界。今天天气很好。我们一起学习语言模型。
Bonjour le monde. Hallo Welt. Hola mundo. Привет, мир.
def generate(model, prompt): return model.sample(prompt, max_new_tokens=32, temperature=0.7, top_p=0.9)
Once upon a time, in a small village by the sea, there lived an old fisherman who told stories every evening.
Children gathered around him to hear about storms, whales, distant islands and the stars that guided sailors.
Science asks questions: why is the sky blue, how do plants grow, what makes the weather change each season?
Mathematics gives answers with proofs; computers check them quickly, and engineers build useful machines.
"""


def learn_bpe(texts: Sequence[str], num_base: int, pat_str: str = KIMI_PAT_STR):
    """Byte-level BPE learned from ``texts`` by HF ``tokenizers``' trainer (Rust; what :func:`train_bpe` does, fast
    enough for megabytes of text). Returns ``(ranks, hf_tokenizer)``: the 256 bytes, then the merges in the order
    they were learned, and the trained ``tokenizers.Tokenizer``.

    Ranks in merge order make tiktoken's lowest-rank-first merging reproduce the trained BPE, so a
    :class:`KimiTokenizer` over ``ranks`` and ``hf_tokenizer`` give the same ids (the demo recipe checks it on its
    whole corpus)."""
    if num_base < 256:
        raise ValueError(f"num_base {num_base} < 256: byte-level BPE needs every single byte")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pat_str), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=num_base, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(byte_level_bytes(left + right), len(ranks))
    return ranks, tok


def byte_level_bytes(token: str) -> bytes:
    """The bytes behind a token of HF's byte-level BPE, whose alphabet is GPT-2's byte -> printable character map
    (printable Latin-1 bytes as themselves, the other 68 bytes as U+0100 onwards, in byte order)."""
    if not hasattr(byte_level_bytes, "_map"):
        keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
        moved = [b for b in range(256) if b not in keep]
        byte_level_bytes._map = {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(moved)}}
    return bytes(byte_level_bytes._map[c] for c in token)


def write_kimi_tokenizer(path, ranks: dict[bytes, int]) -> KimiTokenizer:
    """Write ``tiktoken.model`` + ``tokenizer_config.json`` in the K3 layout: ``ranks``, then the 256 specials with
    K3's names at K3's offsets (``<|end_of_msg|>`` = first special + 2)."""
    num_base = len(ranks)
    os.makedirs(path, exist_ok=True)
    write_tiktoken_model(os.path.join(path, "tiktoken.model"), ranks)
    decoder = {str(num_base + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": True}
               for off, name in sorted(K3_SPECIAL_NAMES.items())}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
              "unk_token": "[UNK]", "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return KimiTokenizer.from_dir(path)


def write_demo_tokenizer(path, vocab_size: int = 1024) -> KimiTokenizer:
    """The tokenizer of the random-weight tiny K3: ``vocab_size - 256`` BPE ranks trained on a built-in text, in the
    K3 layout (:func:`write_kimi_tokenizer`)."""
    return write_kimi_tokenizer(path, train_bpe(_DEMO_TEXT * 4, vocab_size - NUM_RESERVED_SPECIAL))
