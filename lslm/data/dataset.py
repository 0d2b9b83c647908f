"""The text pipeline: corpus → ``datasets`` rows → token ids → fixed-length blocks → rank shards.

Every rank builds the same blocks in the same order (no randomness anywhere) and
then keeps its own contiguous slice, so data-parallel ranks see disjoint data
without communicating. Shuffling happens later, per epoch, in :func:`batches`,
from an explicit seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from lslm.data.corpus import cache_dir, corpus_files, corpus_sha256
from lslm.data.tokenizer import MIN_VOCAB_SIZE, get_tokenizer, tokenizer_path
from lslm.runtime.files import atomic_write_bytes

__all__ = ["token_blocks", "batches", "num_batches", "next_token_batches"]

# In-process memos: tests, notebooks and recipes ask for the same data many times.
_IDS: dict[tuple[str, str, int], np.ndarray] = {}
_BLOCKS: dict[tuple[str, str, int, int], datasets.Dataset] = {}
# Bump when the tokenization or file layout below changes, to invalidate disk caches.
_CACHE_VERSION = 1


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    # The "Generating train split" / "Map" bars are noise in notebooks and rank logs.
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _tokenize_corpus(vocab_size: int) -> np.ndarray:
    """Run the datasets pipeline: text rows -> batched tokenization -> one flat id array."""
    tok = get_tokenizer(vocab_size)
    files = [str(p) for p in corpus_files()]
    with _quiet_datasets():
        # The "text" builder ships with datasets, so this needs no network. Each row is
        # one line *with* its newline, so concatenating rows gives back the corpus.
        lines = datasets.load_dataset(
            "text", data_files=files, split="train", keep_linebreaks=True,
            cache_dir=str(cache_dir() / "datasets"),
        )

        def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            return {"input_ids": tok(batch["text"], return_attention_mask=False)["input_ids"]}

        # keep_in_memory + an explicit fingerprint: no cache files for ranks to race on,
        # and no attempt to hash the tokenizer object (slow, and not always stable).
        fingerprint = hashlib.sha1(f"lslm-tok-{_CACHE_VERSION}-{corpus_sha256()}-{vocab_size}".encode()).hexdigest()
        rows = lines.map(tokenize, batched=True, remove_columns=["text"], keep_in_memory=True,
                         new_fingerprint=fingerprint)
    # Concatenate the rows in order (document boundaries are just newlines in this corpus).
    # Flatten on the Arrow table: iterating 40k rows through a formatter takes ~10 s.
    ids = pc.list_flatten(rows.data.column("input_ids")).to_numpy()
    # uint16 holds any vocabulary up to 65,536 and halves the cache file.
    return ids.astype(np.uint16 if vocab_size <= 2**16 else np.int32)


def _token_ids(vocab_size: int) -> np.ndarray:
    """The whole corpus as token ids, cached in memory and on disk (``.npy``, atomic write).

    A fresh process (a new rank, a notebook kernel) then loads ids in milliseconds
    instead of re-tokenizing for a second or two.
    """
    key = (str(cache_dir()), corpus_sha256(), vocab_size)
    if key in _IDS:
        return _IDS[key]
    # Named after the tokenizer's cache file, so a new tokenizer recipe never meets stale ids.
    path = cache_dir() / "tokens" / f"ids-v{_CACHE_VERSION}-{tokenizer_path(vocab_size).stem}.npy"
    ids = None
    if path.is_file():
        try:
            ids = np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            ids = None  # a damaged cache file is rebuilt below, not fatal
    if ids is None:
        ids = _tokenize_corpus(vocab_size)
        buf = io.BytesIO()
        np.save(buf, ids, allow_pickle=False)
        atomic_write_bytes(path, buf.getvalue())
    ids.setflags(write=False)  # shared by every caller: make accidental edits fail loudly
    _IDS[key] = ids
    return ids


def _build_blocks(block_size: int, vocab_size: int) -> datasets.Dataset:
    ids = _token_ids(vocab_size)
    # Blocks of block_size + 1 tokens with stride block_size: neighbouring blocks share
    # one token, so every (token, next token) pair is a target exactly once. Only the
    # global tail shorter than a block is dropped.
    n = max(0, (len(ids) - 1) // block_size)
    index = np.arange(n)[:, None] * block_size + np.arange(block_size + 1)[None, :]
    return datasets.Dataset.from_dict({"input_ids": ids[index].astype(np.int64)})


def token_blocks(
    block_size: int,
    vocab_size: int = 1024,
    *,
    rank: int = 0,
    world_size: int = 1,
    max_blocks: int | None = None,
) -> datasets.Dataset:
    """Blocks of ``block_size + 1`` token ids from the corpus, this rank's contiguous shard.

    Column ``input_ids`` (torch format, int64, shape ``(block_size + 1,)`` per row):
    the model input is ``block[:-1]``, the target ``block[1:]``. The unsharded blocks
    are cut to a multiple of ``world_size`` (and to ``max_blocks`` first, if given),
    then rank ``r`` gets rows ``[r*m, (r+1)*m)`` with ``m = total // world_size``: all
    ranks hold the same number of blocks, disjoint, and together a prefix of the
    ``world_size=1`` blocks. Deterministic. Token ids are cached on disk (per
    vocabulary size) and blocks in memory, so repeated calls are cheap.
    """
    _check_int("block_size", block_size, 1)
    _check_int("world_size", world_size, 1)
    _check_int("vocab_size", vocab_size, MIN_VOCAB_SIZE)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    if max_blocks is not None:
        _check_int("max_blocks", max_blocks, world_size)

    key = (str(cache_dir()), corpus_sha256(), block_size, vocab_size)
    if key not in _BLOCKS:
        _BLOCKS[key] = _build_blocks(block_size, vocab_size)
    blocks = _BLOCKS[key]

    total = len(blocks) if max_blocks is None else min(max_blocks, len(blocks))
    per_rank = total // world_size
    if per_rank == 0:
        raise ValueError(
            f"block_size={block_size} leaves {len(blocks)} blocks, fewer than world_size={world_size}; "
            "use a smaller block_size"
        )
    # Equal shard sizes keep every rank in lock-step: the same number of steps per epoch.
    kept = blocks.select(range(per_rank * world_size))
    shard = kept.shard(num_shards=world_size, index=rank, contiguous=True)
    # with_format returns a new view; the memoised dataset stays format-free.
    return shard.with_format("torch")


def num_batches(dataset: datasets.Dataset, batch_size: int, *, drop_last: bool = True) -> int:
    """How many batches :func:`batches` yields for ``dataset`` in one epoch."""
    _check_int("batch_size", batch_size, 1)
    n = len(dataset)
    return n // batch_size if drop_last else -(-n // batch_size)


def batches(
    dataset: datasets.Dataset,
    batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(x, y)`` int64 batches of shape ``(batch_size, block_size)`` for one epoch.

    The order is a permutation drawn from ``(seed, epoch)`` only (NumPy's
    ``SeedSequence``, stable across versions and machines), so a run is reproducible
    and every epoch is shuffled differently. ``shuffle=False`` keeps dataset order.
    The last partial batch is dropped unless ``drop_last=False``.
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("seed", seed, 0)
    _check_int("epoch", epoch, 0)
    n = len(dataset)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    rows = dataset.with_format("torch")  # accept a dataset in any format
    for i in range(num_batches(dataset, batch_size, drop_last=drop_last)):
        idx = order[i * batch_size:(i + 1) * batch_size].tolist()
        block = torch.as_tensor(rows[idx]["input_ids"], dtype=torch.long)
        yield block[:, :-1], block[:, 1:]


def next_token_batches(loader: Any, device: Any) -> Iterator[tuple[Any, Any]]:
    """Endless ``(inputs, targets)`` from a DataLoader of token blocks: each block ``b`` gives ``b[:, :-1], b[:, 1:]``.

    The loader's sampler gets a new epoch each pass (``set_epoch``), the same on every rank,
    as DDP's ``DistributedSampler`` needs; the tensors move to ``device``.
    """
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        for b in loader:
            block = b["input_ids"].to(device)
            yield block[:, :-1], block[:, 1:]
        epoch += 1
