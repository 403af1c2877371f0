"""ViT-MoE in the WideNet style (Xue et al. 2022, "Go Wider Instead of Deeper").

One transformer block's weights are shared by all ``depth`` layers: the
attention projections and the MoE feed-forward (router and experts) exist once;
only the LayerNorms are per layer. Written with ``gt.nn`` layers, so the
configured tensor mode (e.g. 1d) splits the attention, patch embedding and
classifier, while the experts are spread over the EXPERT group.

    embed (gt.nn.PatchEmbedding) -> depth x [x + attn(ln1_i(x)); x + moe(ln2_i(x))]
    -> ln -> class token -> gt.nn.Classifier
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from torch import Tensor, nn

import gridtrain as gt
import gridtrain.nn  # noqa: F401 - makes gt.nn available
from gridtrain.parallel import moe
from gridtrain.parallel.context import get_context, has_context


@dataclasses.dataclass(frozen=True)
class WideNetConfig:
    img_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 10
    depth: int = 6
    hidden: int = 128
    heads: int = 4
    ffn: int = 256
    num_experts: int = 4
    top_k: int = 2
    capacity_factor_train: float = 1.25
    capacity_factor_eval: float = 2.0
    min_capacity: int = 4
    noisy_policy: str | None = None
    drop_tks: bool = True
    use_z_loss: bool = False
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.top_k not in (1, 2):
            raise ValueError(f"top_k must be 1 or 2, got {self.top_k}")


class Attention(nn.Module):
    """Multi-head self-attention over the heads this rank's qkv shard holds."""

    def __init__(self, cfg: WideNetConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = gt.nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = gt.nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)  # [B, S, 3 * local heads * head_dim], head-major
        b, s, width = qkv.shape
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


def build_moe(cfg: WideNetConfig) -> moe.MoeLayer:
    """The MoE feed-forward: router per ``top_k``, GELU FFN experts."""
    router_cls = moe.Top1Router if cfg.top_k == 1 else moe.Top2Router
    router = router_cls(
        capacity_factor_train=cfg.capacity_factor_train,
        capacity_factor_eval=cfg.capacity_factor_eval,
        min_capacity=cfg.min_capacity,
        noisy_policy=cfg.noisy_policy,
        drop_tks=cfg.drop_tks,
        use_z_loss=cfg.use_z_loss,
    )
    ctx = get_context() if has_context() else None
    experts = moe.Experts(cfg.num_experts, cfg.hidden, cfg.ffn, ctx=ctx)
    return moe.MoeLayer(
        cfg.hidden,
        cfg.num_experts,
        router,
        experts,
        aux_loss_coef=cfg.aux_loss_coef,
        z_loss_coef=cfg.z_loss_coef,
        ctx=ctx,
    )


class WideNet(nn.Module):
    """Image ``[B, C, H, W]`` -> logits ``[B, classes]``; one shared block applied ``depth`` times."""

    def __init__(self, cfg: WideNetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = gt.nn.PatchEmbedding(cfg.img_size, cfg.patch_size, cfg.in_chans, cfg.hidden)
        self.attn = Attention(cfg)  # shared by every layer
        self.moe = build_moe(cfg)  # shared by every layer
        self.ln1 = nn.ModuleList(gt.nn.LayerNorm(cfg.hidden) for _ in range(cfg.depth))
        self.ln2 = nn.ModuleList(gt.nn.LayerNorm(cfg.hidden) for _ in range(cfg.depth))
        self.ln = gt.nn.LayerNorm(cfg.hidden)
        self.head = gt.nn.Classifier(cfg.hidden, cfg.num_classes)

    def forward(self, images: Tensor) -> Tensor:
        moe.clear_aux_loss(self)  # this forward's aux losses only
        x = self.embed(images)
        for ln1, ln2 in zip(self.ln1, self.ln2, strict=True):
            x = x + self.attn(ln1(x))
            x = x + self.moe(ln2(x))
        return self.head(self.ln(x)[:, 0])


class DenseViT(WideNet):
    """The same network with a dense GELU MLP of the active width in place of the MoE layer
    (``top_k`` experts' worth of FFN), for throughput comparisons."""

    def __init__(self, cfg: WideNetConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.embed = gt.nn.PatchEmbedding(cfg.img_size, cfg.patch_size, cfg.in_chans, cfg.hidden)
        self.attn = Attention(cfg)
        self.moe = nn.Sequential(
            gt.nn.Linear(cfg.hidden, cfg.top_k * cfg.ffn),
            nn.GELU(),
            gt.nn.Linear(cfg.top_k * cfg.ffn, cfg.hidden),
        )
        self.ln1 = nn.ModuleList(gt.nn.LayerNorm(cfg.hidden) for _ in range(cfg.depth))
        self.ln2 = nn.ModuleList(gt.nn.LayerNorm(cfg.hidden) for _ in range(cfg.depth))
        self.ln = gt.nn.LayerNorm(cfg.hidden)
        self.head = gt.nn.Classifier(cfg.hidden, cfg.num_classes)


class MoeCriterion(nn.Module):
    """Task loss plus the model's MoE auxiliary losses of the same forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.ce = gt.nn.CrossEntropyLoss()
        self._model = [model]  # not a submodule: the model is trained on its own

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        aux = moe.collect_aux_loss(self._model[0])
        return self.ce(logits, labels) + aux.to(logits.device)
