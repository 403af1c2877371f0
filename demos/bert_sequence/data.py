"""BERT pre-training samples: sentence pairs with masked tokens and a sentence-order label.

Tokens are bytes (0-255) plus four special ids, so no tokenizer is needed. The
text is either synthetic (a fixed random Markov chain over bytes: learnable,
needs no files) or real (a ``--data`` file, or Python's ``pydoc_data`` topics).
Each sample is ``((input_ids, padding_mask, token_types), (mlm_labels, sop_label))``:
``[S]`` tensors and a 0-d label; ``padding_mask`` is True on padding.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

PAD, CLS, SEP, MASK = 256, 257, 258, 259
VOCAB_SIZE = 260
IGNORE = -100  # label of positions the masked-LM loss skips


def synthetic_text(num_bytes: int, seed: int = 0) -> torch.Tensor:
    """Bytes from a random first-order Markov chain with 4 likely successors per byte."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, 256, (256, 4), generator=g)
    out = torch.empty(num_bytes, dtype=torch.long)
    cur = 0
    choices = torch.randint(0, 4, (num_bytes,), generator=g)
    for i in range(num_bytes):
        cur = int(successors[cur, choices[i]])
        out[i] = cur
    return out


def real_text(path: str | None) -> torch.Tensor:
    """Bytes of ``path``, or of the Python docs' pydoc topics when ``path`` is None."""
    if path is None:
        from pydoc_data.topics import topics

        raw = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    else:
        with open(path, "rb") as f:
            raw = f.read()
    return torch.tensor(list(raw), dtype=torch.long)


class SentenceOrderDataset(Dataset):
    """Samples of ``seq_len`` tokens: ``[CLS] A [SEP] B [SEP] [PAD]...`` with A, B adjacent
    spans of the text, swapped with probability 1/2 (label 1 = swapped). 15% of the
    non-special tokens are masked (80% [MASK], 10% random byte, 10% unchanged)."""

    def __init__(self, text: torch.Tensor, seq_len: int, num_samples: int, seed: int = 0):
        if seq_len < 8:
            raise ValueError(f"seq_len must be >= 8, got {seq_len}")
        if len(text) < 2 * seq_len:
            raise ValueError(f"the text has {len(text)} tokens; need at least {2 * seq_len}")
        self.text, self.seq_len, self.num_samples, self.seed = text, seq_len, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        s = self.seq_len
        body = s - 3
        used = int(torch.randint(body // 2, body + 1, (1,), generator=g))  # some samples pad
        len_a = int(torch.randint(1, used, (1,), generator=g))
        start = int(torch.randint(0, len(self.text) - used, (1,), generator=g))
        a, b = self.text[start : start + len_a], self.text[start + len_a : start + used]
        swapped = int(torch.rand((), generator=g) < 0.5)
        if swapped:
            a, b = b, a
        sep, cls = torch.tensor([SEP]), torch.tensor([CLS])
        tokens = torch.cat([cls, a, sep, b, sep])
        types = torch.cat([torch.zeros(len(a) + 2), torch.ones(len(b) + 1)]).long()
        n = len(tokens)
        ids = torch.full((s,), PAD, dtype=torch.long)
        ids[:n] = tokens
        token_types = torch.zeros(s, dtype=torch.long)
        token_types[:n] = types
        padding = torch.arange(s) >= n
        labels = torch.full((s,), IGNORE, dtype=torch.long)
        maskable = (ids < 256) & ~padding
        chosen = maskable & (torch.rand(s, generator=g) < 0.15)
        labels[chosen] = ids[chosen]
        roll = torch.rand(s, generator=g)
        inputs = ids.clone()
        inputs[chosen & (roll < 0.8)] = MASK
        rand_tok = chosen & (roll >= 0.8) & (roll < 0.9)
        inputs[rand_tok] = torch.randint(0, 256, (s,), generator=g)[rand_tok]
        return (inputs, padding, token_types), (labels, torch.tensor(swapped))


def collate(samples):
    """Stack samples into ``((ids, padding, types), (mlm_labels, sop_labels))`` tuples."""
    (xs, ys) = zip(*samples, strict=True)
    stack = [torch.stack(parts) for parts in zip(*xs, strict=True)]
    labels = [torch.stack(parts) for parts in zip(*ys, strict=True)]
    return tuple(stack), tuple(labels)
