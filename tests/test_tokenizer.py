"""Tokenizers: our tiktoken-format loader against HF tokenizers' independent BPE engine and regex, the K3
special-id layout on a full-size (163,584-rank) file, HF tokenizer.json against transformers, bad files."""

import base64
import json
import os

import numpy as np
import pytest

from kimi_jax.text import tokenizer as T

TEXTS = [
    "Hello world! The capital of France is Paris.",
    "你好，世界。今天天气很好abc混合Text",
    "I'm HERE they're We'LL it's DON'T",
    "  \n\n  spaces\t\ttabs   end  \r\n",
    "ÀÉÎõü naïve café Ωμέγα",
    "12345678 3.14159 1,000,000",
    "Привет, мир!",
    "CamelCaseWordsAndMORECaps x_y-z",
    "def f(x):\n    return {'a': [1, 2]}\n",
    "<|open|>message role=\"user\"<|sep|> literal markers",
    "emoji 🙂🚀 and combining e\u0301",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo_tok")
    return str(path), T.write_demo_tokenizer(path, vocab_size=1024)


def _hf_from_tiktoken(path):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    return TikTokenConverter(vocab_file=path, pattern=T.KIMI_PAT_STR).converted()


def test_demo_vocabulary_layout(demo):
    path, tok = demo
    assert tok.num_base == 768 and tok.vocab_size == 1024
    # K3's specials at K3's offsets from the first special id (163584 + k in the release).
    assert tok.specials["[BOS]"] == 768 and tok.specials["[EOS]"] == 769
    assert tok.specials["<|end_of_msg|>"] == 770
    assert [tok.specials[m] for m in ("<|open|>", "<|close|>", "<|sep|>")] == [771, 772, 773]
    assert tok.specials["[PAD]"] == 1023 and tok.specials["<|reserved_token_800|>"] == 800
    assert tok.bos_id == 768 and tok.eos_id == 769
    # the file is exactly the documented format: base64 token, space, rank
    lines = open(os.path.join(path, "tiktoken.model")).read().splitlines()
    assert len(lines) == 768
    tok0, rank0 = lines[0].split(" ")
    assert base64.b64decode(tok0) == b"\x00" and rank0 == "0"


def test_encode_matches_hf_tokenizers_engine(demo):
    """HF tokenizers (Rust BPE + Oniguruma regex, via transformers' TikTokenConverter) is an implementation
    we did not write: same ids for every text."""
    path, tok = demo
    hf = _hf_from_tiktoken(os.path.join(path, "tiktoken.model"))
    for text in TEXTS:
        ours = tok.encode(text)
        assert ours == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ours) == text


def test_split_pattern_behaviour():
    """The K3 pattern: Han runs split from other letters, contractions attach, digits in groups of <= 3."""
    import regex

    split = lambda s: regex.findall(T.KIMI_PAT_STR, s, flags=regex.V1)
    assert split("你好abc") == ["你好", "abc"]
    assert split("they're") == ["they're"]
    assert split("12345") == ["123", "45"]
    assert split("HTTPServer") == ["HTTPServer"]
    assert split("hello  world") == ["hello", " ", " world"]
    # HF's Oniguruma engine splits identically
    from tokenizers import Regex, pre_tokenizers

    pre = pre_tokenizers.Split(Regex(T.KIMI_PAT_STR), behavior="isolated")
    for text in TEXTS:
        assert [p for p, _ in pre.pre_tokenize_str(text)] == split(text), text


def test_special_markup_in_text_stays_text(demo):
    _, tok = demo
    ids = tok.encode("<|end_of_msg|>")
    assert tok.specials["<|end_of_msg|>"] not in ids and len(ids) > 1
    assert tok.encode("<|end_of_msg|>", allow_special=True) == [770]
    assert tok.decode([770, 771]) == "<|end_of_msg|><|open|>"


def test_stream_decoder_handles_split_utf8(demo):
    _, tok = demo
    ids = tok.encode("héllo 你好 🙂")
    dec = tok.stream_decoder()
    pieces = [dec.push([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == "héllo 你好 🙂"
    assert all("\ufffd" not in p for p in pieces)


def test_long_runs_are_split_like_the_reference(demo):
    _, tok = demo
    text = "a" * 60_000 + " " * 30_000 + "b"
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def _full_size_file(path):
    """163,584 distinct ranks (all bytes, all byte pairs, then 3-byte tokens): the real file's size."""
    toks = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    n3 = 163_584 - len(toks)
    toks += [bytes([a, b, c]) for a in range(97, 123) for b in range(256) for c in range(256)][:n3]
    T.write_tiktoken_model(path, {t: i for i, t in enumerate(toks)})


def test_full_size_vocabulary_special_ids(tmp_path):
    """The real layout: 163,584 base ranks, specials 163584..163839 named by tokenizer_config.json."""
    _full_size_file(tmp_path / "tiktoken.model")
    decoder = {str(163584 + k): {"content": v, "special": True} for k, v in T.K3_SPECIAL_NAMES.items()}
    json.dump({"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}},
              open(tmp_path / "tokenizer_config.json", "w"))
    tok = T.load_tokenizer(str(tmp_path))
    assert isinstance(tok, T.KimiTokenizer)
    assert tok.vocab_size == 163840
    assert tok.specials["<|end_of_msg|>"] == 163586 and tok.eos_id == 163585 and tok.bos_id == 163584
    assert tok.specials["<|media_pad|>"] == 163605 and tok.specials["[PAD]"] == 163839
    assert tok.specials["<|reserved_token_163700|>"] == 163700
    text = "The capital of France is Paris. 你好"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|open|>", allow_special=True) == [163587]


@pytest.mark.parametrize("content,msg", [
    ("AAAA 0\nAAAA 1\n", "listed twice"),
    ("not-base64! 0\n", "unreadable"),
    ("QQ== 0 extra\n", "expected"),
    ("QQ== 5\n", "ranks must be exactly"),
])
def test_bad_tiktoken_files(tmp_path, content, msg):
    (tmp_path / "tiktoken.model").write_text(content)
    with pytest.raises(T.TokenizerError, match=msg) as e:
        T.load_tokenizer(str(tmp_path))
    assert "tiktoken.model" in str(e.value)


def test_bad_tokenizer_config(tmp_path, demo):
    src, _ = demo
    (tmp_path / "tiktoken.model").write_bytes(open(os.path.join(src, "tiktoken.model"), "rb").read())
    json.dump({"added_tokens_decoder": {"5": {"content": "<|x|>"}}}, open(tmp_path / "tokenizer_config.json", "w"))
    with pytest.raises(T.TokenizerError, match="outside the reserved range"):
        T.load_tokenizer(str(tmp_path))
    json.dump({"eos_token": "<|nope|>"}, open(tmp_path / "tokenizer_config.json", "w"))
    with pytest.raises(T.TokenizerError, match="eos_token"):
        T.load_tokenizer(str(tmp_path))


def test_directory_without_tokenizer(tmp_path):
    with pytest.raises(T.TokenizerError, match="no tokenizer files"):
        T.load_tokenizer(str(tmp_path))


def test_hf_tokenizer_json_matches_transformers(tmp_path):
    """A Llama-style tokenizer.json (trained here with the tokenizers library) read by our wrapper and by
    transformers' AutoTokenizer: same ids, same text, BOS added by the post-processor."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import AutoTokenizer

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(TEXTS * 3, trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(tmp_path / "tokenizer.json"))
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"},
              open(tmp_path / "tokenizer_config.json", "w"))
    ours = T.load_tokenizer(str(tmp_path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(ours, T.HFTokenizer) and ours.bos_id == 1 and ours.eos_id == 2
    for text in TEXTS[:-2]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"] and ids[0] == 1
        assert ours.decode(ids[1:]) == ref.decode(ids[1:])
    dec = ours.stream_decoder()
    ids = ours.encode("héllo 你好", add_special_tokens=False)
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == "héllo 你好"


def test_bpe_training_is_deterministic():
    text = "the cat sat on the mat; a dog ate the hat " * 5
    a, b = T.train_bpe(text, 270), T.train_bpe(text, 270)
    assert a == b and len(a) == 270
    assert sorted(a.values()) == list(range(270))
    with pytest.raises(ValueError, match="too small"):
        T.train_bpe("ab", 300)
    assert np.all([a[bytes([i])] == i for i in range(256)])
