"""Byte-level text data: an embedded corpus (no download) cut into fixed-length windows.

The default corpus is the text of Python's own help topics (``pydoc_data.topics``,
about 0.47 MB of English prose and code that ships with every CPython), so the
demo needs no network. ``--data FILE`` trains on any other text file. Bytes are
the tokens (vocabulary 256), so no tokenizer is needed either.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

VOCAB_SIZE = 256


def load_corpus(path: str | Path | None = None) -> bytes:
    """The bytes of ``path``, or the pydoc help topics (in a fixed order) when it is None."""
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data file '{path}' does not exist")
    data = path.read_bytes()
    if not data:
        raise ValueError(f"--data file '{path}' is empty")
    return data


def split_corpus(data: bytes, held_out: float = 0.1) -> tuple[Tensor, Tensor]:
    """(train, held-out) token tensors: the last ``held_out`` fraction is held out."""
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out must be in (0, 1), got {held_out}")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1.0 - held_out))
    return tokens[:cut], tokens[cut:]


class WindowDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens every ``stride`` tokens: item ``i`` is
    ``(x, y) = (w[:-1], w[1:])``, the inputs and their next-token targets."""

    def __init__(self, tokens: Tensor, seq_len: int, stride: int | None = None):
        stride = stride or seq_len
        if seq_len < 1 or stride < 1:
            raise ValueError(f"seq_len and stride must be >= 1, got {seq_len} and {stride}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"text of {len(tokens)} tokens is shorter than one window of seq_len + 1 = "
                f"{seq_len + 1}; use a shorter --seq-len or a longer --data file"
            )
        self.tokens, self.seq_len, self.stride = tokens, seq_len, stride
        self.n = (len(tokens) - seq_len - 1) // stride + 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"window {i} out of range [0, {self.n})")
        w = self.tokens[i * self.stride : i * self.stride + self.seq_len + 1]
        return w[:-1], w[1:]


def decode(tokens: Tensor | list[int]) -> str:
    """Bytes back to text (invalid UTF-8 sequences shown as U+FFFD)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def encode(text: str) -> Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
