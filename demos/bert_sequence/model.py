"""BERT for pre-training (masked LM + sentence order), written once on ``gridtrain.nn``.

Pre-LayerNorm blocks as in Megatron-LM's BERT. The model is an ordered list of
layers (``pipeline_layers``): embedding, ``depth`` transformer blocks, head, each
passing ``(hidden, padding_mask)`` on, so ``parallel.pipeline`` can cut it. Under
``tensor.mode = "sequence"`` every ``[B, S, ...]`` tensor holds this rank's
``S / N`` positions: position embeddings read ``gt.nn.position_ids`` (global
offsets), attention is ring self-attention (``gt.nn.attention``), the sentence
head reads the first token from the first sequence rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gridtrain.nn as gnn
from gridtrain.parallel import comm
from gridtrain.parallel.context import get_context, has_context
from gridtrain.parallel.mode import ParallelMode


def first_token(x: Tensor) -> Tensor:
    """``x[:, 0]`` of the whole sequence: under 'sequence' it lives on the first sequence rank,
    which broadcasts it (backward sums every rank's gradient back into it)."""
    ctx = get_context() if has_context() else None
    if ctx is None or ctx.tensor_mode != "sequence" or ctx.world_size(ParallelMode.SEQUENCE) == 1:
        return x[:, 0]
    src = ctx.ranks(ParallelMode.SEQUENCE)[0]
    return comm.broadcast(x[:, 0].contiguous(), src, ctx.group(ParallelMode.SEQUENCE))


class BertEmbedding(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, vocab_size, hidden, max_len, num_types=2, dropout=0.1):
        super().__init__()
        self.word = gnn.VocabParallelEmbedding(vocab_size, hidden)
        self.position = gnn.Embedding(max_len, hidden)
        self.token_type = gnn.Embedding(num_types, hidden)
        self.norm = gnn.LayerNorm(hidden)
        self.dropout = gnn.Dropout(dropout)

    def forward(self, input_ids: Tensor, padding_mask: Tensor, token_types: Tensor):
        pos = gnn.position_ids(input_ids.shape[1], input_ids.device)
        x = self.word(input_ids) + self.position(pos)[None] + self.token_type(token_types)
        return self.dropout(self.norm(x)), padding_mask


class BertLayer(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, hidden, heads, dropout=0.1, attention_dropout=0.1):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.ln1 = gnn.LayerNorm(hidden)
        self.qkv = gnn.Linear(hidden, 3 * hidden)
        self.proj = gnn.Linear(hidden, hidden)
        self.ln2 = gnn.LayerNorm(hidden)
        self.fc1 = gnn.Linear(hidden, 4 * hidden)
        self.fc2 = gnn.Linear(4 * hidden, hidden)
        self.dropout = gnn.Dropout(dropout)

    def forward(self, x: Tensor, padding_mask: Tensor):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        p = self.attention_dropout if self.training else 0.0
        a = gnn.attention(q, k, v, key_padding_mask=padding_mask, dropout_p=p)
        x = x + self.dropout(self.proj(a.transpose(1, 2).reshape(b, s, h)))
        x = x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
        return x, padding_mask


class BertHead(nn.Module):
    """Final LayerNorm, masked-LM head (decoder tied to the word embedding), sentence-order head."""

    def __init__(self, hidden, vocab_size, word_weight: nn.Parameter, add_binary_head: bool):
        super().__init__()
        self.norm = gnn.LayerNorm(hidden)
        self.lm_dense = gnn.Linear(hidden, hidden)
        self.lm_norm = gnn.LayerNorm(hidden)
        self.decoder = gnn.VocabParallelClassifier(hidden, vocab_size, weight=word_weight)
        self.add_binary_head = add_binary_head
        if add_binary_head:
            self.pooler = gnn.Linear(hidden, hidden)
            self.binary = gnn.Linear(hidden, 2)

    def forward(self, x: Tensor, padding_mask: Tensor):
        x = self.norm(x)
        mlm = self.decoder(self.lm_norm(F.gelu(self.lm_dense(x))))
        if not self.add_binary_head:
            return mlm
        return mlm, self.binary(torch.tanh(self.pooler(first_token(x))))


class Bert(nn.Module):
    """``forward(input_ids, padding_mask, token_types)`` -> MLM logits ``[B, S, V]``
    (and sentence-order logits ``[B, 2]`` with ``add_binary_head``)."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        depth: int,
        heads: int,
        max_len: int,
        add_binary_head: bool = True,
        dropout: float = 0.1,
        attention_dropout: float = 0.1,
    ):
        super().__init__()
        self.embedding = BertEmbedding(vocab_size, hidden, max_len, dropout=dropout)
        self.blocks = nn.ModuleList(
            BertLayer(hidden, heads, dropout, attention_dropout) for _ in range(depth)
        )
        self.head = BertHead(hidden, vocab_size, self.embedding.word.weight, add_binary_head)
        self.apply(_init_weights)

    def pipeline_layers(self):
        """Execution order for ``parallel.pipeline``: each layer takes the previous one's outputs."""
        return [self.embedding, *self.blocks, self.head]

    def forward(self, input_ids: Tensor, padding_mask: Tensor, token_types: Tensor):
        x = self.embedding(input_ids, padding_mask, token_types)
        for block in self.blocks:
            x = block(*x)
        return self.head(*x)


def _init_weights(m: nn.Module) -> None:
    """BERT's init: normal(0, 0.02) weights, zero biases."""
    if isinstance(m, nn.Linear | nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


class BertLoss(nn.Module):
    """Masked-LM cross entropy (labels -100 where nothing is masked) plus sentence-order loss."""

    def __init__(self):
        super().__init__()
        self.ce = gnn.CrossEntropyLoss()

    def forward(self, output, mlm_labels, sop_labels: Tensor | None = None) -> Tensor:
        if isinstance(mlm_labels, tuple | list):  # the labels as one (mlm, sop) pair
            mlm_labels, sop_labels = mlm_labels
        mlm = output[0] if isinstance(output, tuple) else output
        loss = self.ce(mlm.transpose(1, 2), mlm_labels)  # class dim 1; token labels stay [B, S]
        if isinstance(output, tuple) and sop_labels is not None:
            loss = loss + self.ce(output[1], sop_labels)
        return loss
