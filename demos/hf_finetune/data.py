"""Offline data for the fine-tune demo: byte-level text to pre-train on, and a span task.

Both come from the text of Python's own help topics (``pydoc_data.topics``, shipped with
every CPython; ``demos/gpt/data.py`` loads it): the first 90% for training, the last 10%
held out. Bytes are the tokens (vocabulary 256), so no tokenizer is needed.

**Pre-training**: next-byte prediction on windows of the training text.

**Fine-tuning, "find the indented blocks"**: in a window of help text, tag every word as
inside an indented block (code examples, grammar rules, tables: ``"C"``) or in running
prose (``"P"``). The model writes the tag at the last byte of each word instead of the
next byte: token classification with the causal LM's own head, so the loss is on word
ends only (``labels`` -100 elsewhere) and the same batches train in every layout,
sequence parallelism included. Scores: accuracy over words and F1 of the ``"C"`` spans.
Windows start at a line start; a short last window is padded on the right with an
``attention_mask`` (the Hugging Face convention).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from demos.gpt.data import VOCAB_SIZE, WindowDataset, load_corpus, split_corpus  # noqa: E402

CODE, PROSE = ord("C"), ord("P")
PAD = 0
INDENT = b"   "  # the help topics indent code, grammar and tables by three spaces or more

__all__ = ["CODE", "PROSE", "VOCAB_SIZE", "BlockDataset", "lm_datasets", "task_datasets"]


def lm_datasets(seq_len: int) -> tuple[WindowDataset, WindowDataset]:
    """(train, held-out) next-byte windows: items are ``(input_ids, labels)`` shifted by one."""
    train, held_out = split_corpus(load_corpus())
    return WindowDataset(train, seq_len), WindowDataset(held_out, seq_len)


def tags(window: bytes) -> list[tuple[int, bool]]:
    """(index of each word's last byte, inside an indented line?) for a window of text."""
    out, indented, line_start = [], False, True
    for j, b in enumerate(window):
        if line_start:
            indented, line_start = window[j : j + len(INDENT)] == INDENT, False
        if b == ord("\n"):
            line_start = True
        ends_word = j + 1 == len(window) or window[j + 1] in b" \n"
        if b not in b" \n" and ends_word:
            out.append((j, indented))
    return out


class BlockDataset(Dataset):
    """``n`` windows of ``text`` (seeded, each from a line start) as dicts of ``input_ids``,
    ``attention_mask`` and ``labels`` (aligned: ``labels[t]`` is the target of position t)."""

    def __init__(self, text: bytes, n: int, seq_len: int, seed: int):
        rng = random.Random(seed)
        starts = [0] + [i + 1 for i, b in enumerate(text[:-seq_len]) if b == ord("\n")]
        self.text, self.seq_len = text, seq_len
        self.starts = [rng.choice(starts) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        window = self.text[self.starts[i] : self.starts[i] + self.seq_len]
        ids = torch.full((self.seq_len,), PAD, dtype=torch.long)
        ids[: len(window)] = torch.tensor(list(window))
        mask = torch.zeros(self.seq_len, dtype=torch.long)
        mask[: len(window)] = 1
        labels = torch.full((self.seq_len,), -100, dtype=torch.long)
        for at, indented in tags(window):
            labels[at] = CODE if indented else PROSE
        return dict(input_ids=ids, attention_mask=mask, labels=labels)


def task_datasets(seq_len: int, n_train: int, n_test: int) -> tuple[BlockDataset, BlockDataset]:
    """(train, test) block-tagging sets from the training and the held-out text."""
    train, held_out = split_corpus(load_corpus())
    text = [bytes(t.to(torch.uint8).tolist()) for t in (train, held_out)]
    return (
        BlockDataset(text[0], n_train, seq_len, seed=0),
        BlockDataset(text[1], n_test, seq_len, seed=1),
    )
