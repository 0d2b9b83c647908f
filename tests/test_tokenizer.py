"""The corpus tokenizer: exact round trips, vocabulary size, caching."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lslm.data.corpus import load_corpus_text
from lslm.data.tokenizer import EOT_TOKEN, get_tokenizer, tokenizer_path, train_tokenizer

pytestmark = pytest.mark.usefixtures("lslm_cache")  # conftest.py: a per-session cache, never ~/.cache


TRICKY = [
    "",
    " ",
    "  two leading spaces, two trailing  ",
    "tabs\tand\nnewlines\r\nand a lone \r carriage return",
    "\n\n\n",
    "héllo wörld — naïve café",
    "日本語のテキスト and 中文",
    "emoji 🎉🚀👩‍👩‍👧 and maths ∑∫√",
    "zero\u200bwidth\u00a0nbsp\ufeffbom",
    "Don't , stop . here ?",  # the "clean up" pass would eat these spaces
    f"a{EOT_TOKEN}b",
    "\x00\x01 control bytes \x7f",
]


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky_strings(text: str) -> None:
    tok = get_tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok(text)["input_ids"] == ids  # no bos/eos added behind our back


def test_round_trip_corpus_excerpts() -> None:
    tok = get_tokenizer()
    text = load_corpus_text()
    for start in (0, 123_457, 500_001, len(text) - 10_000):
        excerpt = text[start:start + 10_000]
        assert tok.decode(tok.encode(excerpt)) == excerpt
    # The corpus compresses: BPE earns its keep (about 2.4 bytes per token at 1024).
    sample = text[:50_000]
    assert len(tok.encode(sample)) < len(sample) / 2


@pytest.mark.parametrize("vocab_size", [300, 512, 1024])
def test_vocab_size_honoured(vocab_size: int) -> None:
    tok = get_tokenizer(vocab_size)
    assert len(tok) == vocab_size
    ids = tok.encode(load_corpus_text()[:20_000])
    assert max(ids) < vocab_size
    # Larger vocabularies give shorter encodings.
    if vocab_size > 300:
        assert len(ids) < len(get_tokenizer(300).encode(load_corpus_text()[:20_000]))


def test_special_token() -> None:
    tok = get_tokenizer()
    assert tok.eos_token == EOT_TOKEN and tok.pad_token == EOT_TOKEN
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok.decode([tok.eos_token_id]) == EOT_TOKEN


def test_cache_hit_returns_identical_encodings() -> None:
    first = get_tokenizer(1024)
    path = tokenizer_path(1024)
    assert path.is_file()
    mtime = path.stat().st_mtime_ns
    second = get_tokenizer(1024)
    assert path.stat().st_mtime_ns == mtime  # loaded, not retrained
    text = load_corpus_text()[:5_000] + TRICKY[7]
    assert first.encode(text) == second.encode(text)
    assert first.get_vocab() == second.get_vocab()


def test_training_is_deterministic() -> None:
    # Ranks racing to fill the cache must all produce the same file.
    assert train_tokenizer(400).to_str() == train_tokenizer(400).to_str()


def test_concurrent_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LSLM_CACHE_DIR", str(tmp_path))
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(get_tokenizer(600).encode("To be, or not to be"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 4 and all(r == results[0] for r in results)
    # Only the final file remains: no temporary files left behind.
    assert sorted(p.name for p in (tmp_path / "tokenizers").iterdir()) == [tokenizer_path(600).name]


@pytest.mark.parametrize("bad", [0, 256, -5, 1024.0, "1024", True])
def test_bad_vocab_size(bad: object) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        get_tokenizer(bad)  # type: ignore[arg-type]
