"""Data for the GPT recipes: an embedded generated corpus and loaders for a user's own files.

The default corpus needs no download. It is a token stream from a random Markov chain whose
transition matrix is doubly stochastic with exactly ``branching`` equally likely successors per
token, so its statistics are known in closed form:
  - unigram entropy  = log(V)          (the stationary distribution is uniform)
  - entropy rate     = log(branching)  (the best achievable next-token loss, in nats)
A model that learns the corpus drives its loss from ~log(V) towards log(branching); a test
checks the loss falls below a bound derived from these numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class WindowDataset(Dataset):
    """Non-overlapping windows of ``seq_length + 1`` tokens -> (inputs, targets), each (T,) int64."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_length: int, *, name: str = "data") -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        if len(tokens) < seq_length + 1:
            raise ValueError(
                f"{name} has {len(tokens)} tokens, fewer than seq_length + 1 = {seq_length + 1} needed for one "
                "training window; use a shorter seq_length or more data"
            )
        self.tokens = tokens
        self.seq_length = seq_length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_length
        window = torch.as_tensor(np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64))
        return window[:-1], window[1:]


@dataclass(frozen=True, kw_only=True)
class MarkovChain:
    """Token i is followed by one of ``branching`` distinct successors, each with probability 1/branching.

    Successor j of token i is ``perms[j][i]`` for ``branching`` random permutations: each token then
    also has exactly ``branching`` predecessors, the matrix is doubly stochastic, and the chain's
    stationary distribution is uniform.
    """

    vocab_size: int
    branching: int
    seed: int = 1234

    def __post_init__(self) -> None:
        if not 1 <= self.branching <= self.vocab_size:
            raise ValueError(f"branching={self.branching} must be in [1, vocab_size={self.vocab_size}]")

    @property
    def entropy_rate(self) -> float:
        """Best achievable cross-entropy in nats per token."""
        return math.log(self.branching)

    @property
    def unigram_entropy(self) -> float:
        """Cross-entropy of a model that ignores context (uniform stationary distribution)."""
        return math.log(self.vocab_size)

    def successors(self) -> np.ndarray:
        """(V, branching) table: successor j of token i is sigma[(tau[i] + j) mod V].

        For a fixed j that map is a bijection, so every token is some token's j-th successor exactly
        once: each column of the transition matrix sums to 1 as well as each row.
        """
        rng = np.random.default_rng(self.seed)
        sigma, tau = rng.permutation(self.vocab_size), rng.permutation(self.vocab_size)
        offsets = tau[:, None] + np.arange(self.branching)[None, :]
        return sigma[offsets % self.vocab_size]

    def sample(self, num_tokens: int, stream_seed: int) -> np.ndarray:
        """A stream of ``num_tokens`` tokens (uint16 when the vocabulary fits)."""
        rng = np.random.default_rng(stream_seed)
        table = self.successors()
        choices = rng.integers(0, self.branching, size=num_tokens)
        out = np.empty(num_tokens, dtype=np.int64)
        out[0] = rng.integers(0, self.vocab_size)
        for t in range(1, num_tokens):
            out[t] = table[out[t - 1], choices[t]]
        return out


class WindowDataModule(L.LightningDataModule):
    """Shared loader logic: subclasses provide the train and validation token arrays."""

    def __init__(self, *, seq_length: int = 64, batch_size: int = 16, shuffle: bool = True, num_workers: int = 0):
        super().__init__()
        if seq_length < 1 or batch_size < 1:
            raise ValueError(f"seq_length={seq_length} and batch_size={batch_size} must both be >= 1")
        self.seq_length = seq_length
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.vocab_size = 256

    def train_tokens(self) -> np.ndarray:
        raise NotImplementedError

    def val_tokens(self) -> np.ndarray:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        self.train_set = WindowDataset(self.train_tokens(), self.seq_length, name=f"{type(self).__name__} train split")
        self.val_set = WindowDataset(self.val_tokens(), self.seq_length, name=f"{type(self).__name__} val split")

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=shuffle, drop_last=True, num_workers=self.num_workers
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)


class MarkovDataModule(WindowDataModule):
    """The embedded corpus (see the module docstring): generated on the fly, deterministic in ``seed``."""

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        branching: int = 4,
        train_tokens: int = 200_000,
        val_tokens: int = 20_000,
        seed: int = 1234,
        **loader_kwargs,
    ) -> None:
        super().__init__(**loader_kwargs)
        self.chain = MarkovChain(vocab_size=vocab_size, branching=branching, seed=seed)
        self.vocab_size = vocab_size
        self.num_train_tokens, self.num_val_tokens = train_tokens, val_tokens
        for split, count in (("train_tokens", train_tokens), ("val_tokens", val_tokens)):
            if count < self.seq_length + 1:
                raise ValueError(
                    f"MarkovDataModule({split}={count}) is shorter than seq_length + 1 = {self.seq_length + 1}; "
                    f"raise {split} or lower seq_length"
                )

    def train_tokens(self) -> np.ndarray:
        return self.chain.sample(self.num_train_tokens, stream_seed=self.chain.seed + 1)

    def val_tokens(self) -> np.ndarray:
        return self.chain.sample(self.num_val_tokens, stream_seed=self.chain.seed + 2)

    def loss_bound(self, fraction_learned: float = 0.9) -> float:
        """A loss a model that has learned ``fraction_learned`` of the structure gets under:
        entropy_rate + (1 - fraction) * (unigram_entropy - entropy_rate)."""
        gap = self.chain.unigram_entropy - self.chain.entropy_rate
        return self.chain.entropy_rate + (1.0 - fraction_learned) * gap


def _check_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}={str(path)!r} does not exist or is not a file; check the path")
    if path.stat().st_size == 0:
        raise ValueError(f"{what}={str(path)!r} is empty; point it at a file with data")
    return path


class _FileDataModule(WindowDataModule):
    """One training file (validation from its tail) or separate train and validation files."""

    dtype: np.dtype = np.dtype(np.uint8)

    def __init__(
        self, train_path: str | Path, *, val_path: str | Path | None = None, val_fraction: float = 0.1, **loader_kwargs
    ) -> None:
        super().__init__(**loader_kwargs)
        if val_path is None and not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1) when no val_path is given")
        self.train_path = _check_file(train_path, "train_path")
        self.val_path = None if val_path is None else _check_file(val_path, "val_path")
        self.val_fraction = val_fraction
        for name, tokens in (("train split", self.train_tokens()), ("val split", self.val_tokens())):
            if len(tokens) < self.seq_length + 1:
                raise ValueError(
                    f"{type(self).__name__}: the {name} has {len(tokens)} tokens, fewer than seq_length + 1 = "
                    f"{self.seq_length + 1}; use a shorter seq_length or more data"
                )

    def _tokens(self, path: Path) -> np.ndarray:
        if path.stat().st_size % self.dtype.itemsize:
            raise ValueError(f"{path} has {path.stat().st_size} bytes, not a multiple of {self.dtype} size")
        return np.memmap(path, dtype=self.dtype, mode="r")

    def _split_at(self) -> int:
        return int(len(self._tokens(self.train_path)) * (1.0 - self.val_fraction))

    def train_tokens(self) -> np.ndarray:
        tokens = self._tokens(self.train_path)
        return tokens if self.val_path is not None else tokens[: self._split_at()]

    def val_tokens(self) -> np.ndarray:
        if self.val_path is not None:
            return self._tokens(self.val_path)
        return self._tokens(self.train_path)[self._split_at() :]


class TextFileDataModule(_FileDataModule):
    """A user's text files as byte-level tokens (vocabulary 256, no tokenizer needed)."""

    dtype = np.dtype(np.uint8)


class TokenFileDataModule(_FileDataModule):
    """Pre-tokenized uint16 token files (nanoGPT / Megatron ``.bin``), memory-mapped."""

    dtype = np.dtype(np.uint16)

    def __init__(self, train_path: str | Path, *, vocab_size: int = 65536, **kwargs) -> None:
        super().__init__(train_path, **kwargs)
        self.vocab_size = vocab_size
