"""A byte-level BPE tokenizer trained locally on the shipped corpus.

Why byte-level BPE (the GPT-2 scheme): every string maps to bytes first, so any
text, including emoji and odd whitespace, encodes without an unknown token and
decodes back exactly. Training on the 1 MB corpus takes well under a second, so
we train instead of downloading GPT-2's files, and cache the result as JSON in
the lslm cache directory keyed by vocabulary size and corpus hash.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lslm.data.corpus import cache_dir, corpus_sha256, load_corpus_text
from lslm.runtime.files import atomic_write_bytes

__all__ = ["EOT_TOKEN", "MIN_VOCAB_SIZE", "get_tokenizer", "train_tokenizer", "tokenizer_path"]

#: The one special token: marks the end of a document and doubles as padding.
EOT_TOKEN = "<|endoftext|>"
#: 256 byte symbols plus the end-of-text token: the smallest vocabulary that can encode anything.
MIN_VOCAB_SIZE = 256 + 1
# Bump when the training recipe changes, so stale cached tokenizers are not reused.
_RECIPE_VERSION = 1


def _check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} (256 bytes + {EOT_TOKEN}); try 1024"
        )


def tokenizer_path(vocab_size: int) -> Path:
    """Where the trained tokenizer JSON for ``vocab_size`` is cached."""
    _check_vocab_size(vocab_size)
    key = f"bpe-v{_RECIPE_VERSION}-{vocab_size}-{corpus_sha256()[:16]}"
    return cache_dir() / "tokenizers" / f"{key}.json"


def train_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries on the corpus (no caching).

    Training is deterministic: the same corpus and size give the same JSON, so ranks
    that race to build the cache all produce identical tokenizers.
    """
    _check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would be invented on encode and the
    # round trip would no longer be exact. use_regex keeps GPT-2's word splitting.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # A merge seen once is noise; twice is the smallest useful evidence.
        min_frequency=2,
        special_tokens=[EOT_TOKEN],
        # All 256 bytes up front, so bytes absent from Shakespeare still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Lines with their newline, exactly the rows the datasets pipeline tokenizes.
    tok.train_from_iterator(load_corpus_text().splitlines(keepends=True), trainer=trainer)
    return tok


def _load_or_train(vocab_size: int) -> Tokenizer:
    path = tokenizer_path(vocab_size)
    if not path.is_file():
        atomic_write_bytes(path, train_tokenizer(vocab_size).to_str().encode("utf-8"))
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - a corrupt cache entry (disk full, manual edit) is rebuilt, not fatal
        atomic_write_bytes(path, train_tokenizer(vocab_size).to_str().encode("utf-8"))
        return Tokenizer.from_file(str(path))


def get_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """The corpus BPE tokenizer with ``vocab_size`` entries, as a ``transformers`` tokenizer.

    The first call trains it (about half a second) and caches the JSON under
    ``<cache_dir()>/tokenizers``; later calls, in any process, load the cache.
    ``<|endoftext|>`` (id 0) is the eos and pad token; no token is added on encode,
    and ``decode(encode(text)) == text`` for any string.
    """
    backend = _load_or_train(vocab_size)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOT_TOKEN,
        pad_token=EOT_TOKEN,
        # The "clean up" pass deletes spaces before punctuation: lossy, so off.
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )
    if len(tok) != vocab_size:
        # BPE stops early when the corpus runs out of pairs seen min_frequency times.
        raise ValueError(
            f"the corpus supports at most {len(tok)} tokens at min_frequency=2, "
            f"not vocab_size={vocab_size}; choose a smaller vocab_size"
        )
    return tok


def _main() -> None:
    # Tiny CLI for a quick look: python -m lslm.data.tokenizer [VOCAB_SIZE]
    import sys
    import time

    vocab_size = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    t0 = time.perf_counter()
    train_tokenizer(vocab_size)
    t1 = time.perf_counter()
    tok = get_tokenizer(vocab_size)
    ids = tok(load_corpus_text())["input_ids"]
    print(json.dumps({"vocab_size": len(tok), "train_s": round(t1 - t0, 3), "corpus_tokens": len(ids),
                      "cache": str(tokenizer_path(vocab_size))}))


if __name__ == "__main__":
    _main()
