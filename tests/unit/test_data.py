"""The embedded corpus' known statistics and the file loaders' errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from recipes.data import MarkovChain, MarkovDataModule, TextFileDataModule, TokenFileDataModule, WindowDataset


def test_markov_chain_is_doubly_stochastic_with_distinct_successors():
    chain = MarkovChain(vocab_size=50, branching=5, seed=3)
    table = chain.successors()
    assert table.shape == (50, 5)
    assert all(len(set(row)) == 5 for row in table)
    assert np.bincount(table.ravel(), minlength=50).tolist() == [5] * 50  # every token has 5 predecessors


def test_markov_stream_has_the_stated_entropy():
    chain = MarkovChain(vocab_size=16, branching=4, seed=0)
    stream = chain.sample(200_000, stream_seed=1)
    table = chain.successors()
    # every transition is one of the table's successors...
    assert all(stream[t + 1] in table[stream[t]] for t in range(0, 5000))
    # ...and the empirical conditional entropy approaches log(branching)
    pairs = np.bincount(stream[:-1] * 16 + stream[1:], minlength=256).reshape(16, 16).astype(float)
    conditional = pairs / pairs.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.nansum(pairs / pairs.sum() * np.where(conditional > 0, np.log(conditional), 0.0))
    assert abs(h - math.log(4)) < 0.01
    assert abs(chain.unigram_entropy - math.log(16)) < 1e-12


def test_loss_bound_lies_between_floor_and_unigram():
    dm = MarkovDataModule(vocab_size=256, branching=4)
    assert dm.chain.entropy_rate < dm.loss_bound() < dm.chain.unigram_entropy


def test_windows_shift_targets_by_one():
    ds = WindowDataset(np.arange(100), seq_length=10)
    assert len(ds) == 9
    x, y = ds[2]
    assert x.tolist() == list(range(20, 30)) and y.tolist() == list(range(21, 31))


def test_text_and_token_files(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"abcdefghij" * 50)
    dm = TextFileDataModule(text, seq_length=8, batch_size=2)
    dm.setup()
    assert dm.train_set[0][0].tolist() == list(b"abcdefgh")
    tokens = tmp_path / "train.bin"
    np.arange(1000, 1500, dtype=np.uint16).tofile(tokens)
    dm = TokenFileDataModule(tokens, val_path=tokens, seq_length=16, batch_size=2)
    dm.setup()
    assert dm.train_set[0][0][:3].tolist() == [1000, 1001, 1002]
    assert len(dm.val_set) == len(dm.train_set) == 499 // 16


def test_missing_empty_and_short_files_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train_path='.*nope.txt' does not exist"):
        TextFileDataModule(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"train_path='.*empty.txt' is empty"):
        TextFileDataModule(empty)
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 40)
    with pytest.raises(ValueError, match=r"has \d+ tokens, fewer than seq_length \+ 1 = 65; use a shorter seq_length"):
        TextFileDataModule(short, seq_length=64)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"x" * 101)
    with pytest.raises(ValueError, match=r"101 bytes, not a multiple of uint16"):
        TokenFileDataModule(odd, seq_length=4)
    with pytest.raises(ValueError, match=r"MarkovDataModule\(val_tokens=10\) is shorter than seq_length \+ 1 = 65"):
        MarkovDataModule(val_tokens=10, seq_length=64)
