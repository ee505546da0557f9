"""Tokenizer and IncrementalDetokenizer, on the built-in byte-level BPE tokenizer and on a
SentencePiece-style (Metaspace + byte fallback) tokenizer built here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megaserve.models.builtin import resolve_model
from megaserve.tokenizer import DEFAULT_CHAT_TEMPLATE, IncrementalDetokenizer, Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGASERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return resolve_model("builtin:tiny-moe")


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def _copy_tokenizer(src: Path, dst: Path, **configs: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    for name, obj in configs.items():
        (dst / f"{name}.json").write_text(json.dumps(obj))
    return dst


# -- Tokenizer --------------------------------------------------------------------------------


def test_builtin_tokenizer_properties(tok):
    assert tok.vocab_size == 512
    eot, im_start, im_end = (tok.backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert tok.eos_token_ids == (eot, im_end)  # tokenizer_config eos, then generation_config's list
    assert tok.bos_token_id is None
    assert tok.is_special(im_start) and tok.is_special(eot) and not tok.is_special(tok.encode("a")[0])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_encode_as_one_id_and_are_skipped(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.backend.token_to_id("<|im_start|>") and ids[-1] == tok.backend.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_merges_compress_english(tok):
    text = "The experts of every layer send the tokens back to the attention workers."
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_decode_rejects_out_of_vocab_ids(tok):
    with pytest.raises(ValueError, match="512"):
        tok.decode([1, 512])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])


def test_decode_token_is_decode_of_one_id_remembered(tok):
    for i in (0, 5, 97, 300, tok.vocab_size - 1):
        for skip in (True, False):
            assert tok.decode_token(i, skip) == tok.decode([i], skip_special_tokens=skip)
    merged = max(tok.encode(" the quick brown fox"))  # a merge: text of several characters
    assert len(tok.decode_token(merged)) > 1
    assert tok.decode_token(merged) is tok.decode_token(merged)  # the same object: remembered
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode_token(tok.vocab_size)


def test_missing_or_corrupt_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_config_names_the_file(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path)
    (d / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)


def test_config_fallbacks_dict_tokens_and_add_bos(tiny_dir, tmp_path):
    # eos/bos as AddedToken dicts, add_bos_token prepends BOS once.
    d = _copy_tokenizer(
        tiny_dir,
        tmp_path / "a",
        tokenizer_config={"bos_token": {"content": "<|im_start|>"}, "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True},
    )
    t = Tokenizer.from_dir(d)
    bos = t.backend.token_to_id("<|im_start|>")
    assert t.bos_token_id == bos and t.eos_token_ids == (t.backend.token_to_id("<|im_end|>"),)
    assert t.encode("hi")[0] == bos and t.encode("hi", add_special_tokens=False)[0] != bos
    assert t.encode("<|im_start|>hi").count(bos) == 1
    # no tokenizer eos and no generation_config: config.json's list is used.
    d = _copy_tokenizer(tiny_dir, tmp_path / "b", config={"eos_token_id": [7, 9]})
    assert Tokenizer.from_dir(d).eos_token_ids == (7, 9)
    # generation_config's int wins over config.json.
    d = _copy_tokenizer(tiny_dir, tmp_path / "c", config={"eos_token_id": 7}, generation_config={"eos_token_id": 8})
    assert Tokenizer.from_dir(d).eos_token_ids == (8,)


def test_chat_template_chatml_and_sources(tok, tiny_dir, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"
    # A separate chat_template.jinja (what newer transformers saves) wins.
    d = _copy_tokenizer(tiny_dir, tmp_path / "j", tokenizer_config={"chat_template": "X"})
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(d).apply_chat_template(messages) == "Be brief.!"
    # A list of named templates: the default one.
    d = _copy_tokenizer(
        tiny_dir, tmp_path / "l", tokenizer_config={"chat_template": [{"name": "tool", "template": "T"}, {"name": "default", "template": "D"}]}
    )
    assert Tokenizer.from_dir(d).chat_template == "D"


def test_default_chat_template_when_none(tiny_dir, tmp_path):
    t = Tokenizer.from_dir(_copy_tokenizer(tiny_dir, tmp_path))
    assert t.chat_template is None
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    assert DEFAULT_CHAT_TEMPLATE


def test_chat_template_errors_are_value_errors(tiny_dir, tmp_path):
    t = Tokenizer.from_dir(_copy_tokenizer(tiny_dir, tmp_path / "ok"))
    with pytest.raises(ValueError, match="content"):
        t.apply_chat_template([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="non-empty"):
        t.apply_chat_template([])
    d = _copy_tokenizer(tiny_dir, tmp_path / "raise", tokenizer_config={"chat_template": "{{ raise_exception('no system role') }}"})
    with pytest.raises(ValueError, match="no system role"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    # The sandbox refuses attribute access to Python internals.
    d = _copy_tokenizer(tiny_dir, tmp_path / "evil", tokenizer_config={"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


# -- IncrementalDetokenizer: byte-level BPE ---------------------------------------------------


def test_emoji_split_over_byte_tokens_is_held_back(tok):
    emoji_bytes = [tok.backend.token_to_id(tok.backend.id_to_token(b)) for b in "😀".encode()]
    assert emoji_bytes == list("😀".encode())  # byte token id == byte value
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    deltas = [detok.add(i) for i in [*tok.encode(" hi "), *emoji_bytes]]
    assert "".join(deltas[:-4]) == " hi " and deltas[-4:] == ["", "", "", "😀"]
    assert detok.flush() == "" and detok.text == " hi 😀"


def test_incomplete_tail_is_released_only_by_flush(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.add(tok.encode("a")[0]) == "a"
    assert detok.add(0xE2) == "" and detok.add(0x82) == ""  # two bytes of the 3-byte "€"
    assert REPLACEMENT not in detok.text
    assert detok.flush() == REPLACEMENT and detok.text == tok.decode([tok.encode("a")[0], 0xE2, 0x82])


def _multibyte_ids(text: str) -> list[int]:
    return list(text.encode())  # byte-level: token id of byte b is b


generated_ids = st.lists(
    st.one_of(
        st.integers(0, 511),  # anything, including special tokens and lone continuation bytes
        st.sampled_from(["é", "€", "😀", "🎉", "漢", "ü"]).map(_multibyte_ids),
        st.integers(0x80, 0xFF),  # stray high bytes
    ),
    max_size=40,
).map(lambda parts: [i for p in parts for i in (p if isinstance(p, list) else [p])])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.sampled_from(["", "Hi", "Say: 😀", "a b c d e f g h"]), ids=generated_ids, skip=st.booleans())
def test_deltas_concatenate_to_decode_of_generated_ids(tok, prompt, ids, skip):
    expected = tok.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), skip_special_tokens=skip)
    deltas = []
    for i in ids:
        deltas.append(detok.add(i))
        # Never ahead of the truth: whatever was emitted is final (no leaked U+FFFD tail).
        assert expected.startswith(detok.text)
        assert not detok.text.endswith(REPLACEMENT) or expected[len(detok.text) - 1] == REPLACEMENT
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == expected
    if REPLACEMENT not in expected:
        assert all(REPLACEMENT not in d for d in deltas)


# -- IncrementalDetokenizer: SentencePiece-style (decode of a suffix != suffix of decode) -----


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    """A Llama-style tokenizer: Metaspace words, <0xNN> byte fallback, leading space stripped."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in ["▁Hello", "▁world", "▁the", "▁", "Hello", "ing", "!", "▁sea", "."]:
        vocab[word] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    d = tmp_path_factory.mktemp("sp")
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


def test_sentencepiece_suffix_keeps_its_space(sp_dir):
    t = Tokenizer.from_dir(sp_dir)
    world = t.backend.token_to_id("▁world")
    assert t.decode([world]) == "world"  # decode of the suffix alone loses the space
    detok = IncrementalDetokenizer(t, [t.backend.token_to_id("▁Hello")])
    assert detok.add(world) == " world" and detok.add(t.backend.token_to_id("!")) == "!"


sp_pieces = st.lists(
    st.one_of(
        st.sampled_from(["▁Hello", "▁world", "▁the", "▁", "ing", "!", "▁sea", "."]),
        st.sampled_from(["é", "€", "😀", "漢"]).map(lambda c: [f"<0x{b:02X}>" for b in c.encode()]),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=sp_pieces)
def test_sentencepiece_stream_matches_full_decode(sp_dir, pieces):
    t = Tokenizer.from_dir(sp_dir)
    ids = [t.backend.token_to_id(p) for piece in pieces for p in (piece if isinstance(piece, list) else [piece])]
    prompt = [t.backend.token_to_id(p) for p in ["<s>", "▁Hello", "▁the", "▁sea"]]
    expected = t.decode(prompt + ids)[len(t.decode(prompt)) :]
    detok = IncrementalDetokenizer(t, prompt)
    for i in ids:
        detok.add(i)
        assert expected.startswith(detok.text)
    detok.flush()
    assert detok.text == expected and REPLACEMENT not in expected
