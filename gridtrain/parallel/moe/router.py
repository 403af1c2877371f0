"""Top-k routers (Switch Transformer top-1, GShard top-2): which tokens go to which expert slot.

A router maps gate logits ``[tokens, experts]`` to one entry per (token, choice):
its expert, its slot in that expert's queue and its gate (``Router.assign``, what
the grouped dispatch uses), or to a dispatch mask and combine weights
``[tokens, experts, capacity]`` (``Router.forward``, the capacity dispatch). Each
expert takes at most ``capacity`` tokens per forward,

    capacity = max(ceil(k * capacity_factor * tokens / experts), min_capacity),

with separate factors for training and evaluation. Tokens past an expert's
capacity are dropped (their MoE output is zero, so the residual carries them)
unless ``drop_tks=False``, which raises the capacity to the busiest expert's
load instead. The routers also produce the load-balancing loss (Switch eq. 4,
GShard's ``l_aux``) and, optionally, the router z-loss (ST-MoE eq. 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NOISY_POLICIES = (None, "Jitter", "Gaussian")


@dataclass
class RouterOutput:
    """What a router hands the MoE layer for one forward."""

    combine_weights: Tensor  # [tokens, experts, capacity], gate value at each kept slot
    dispatch_mask: Tensor  # [tokens, experts, capacity], bool
    aux_loss: Tensor  # load-balancing loss (unweighted)
    z_loss: Tensor  # router z-loss (unweighted; 0 unless use_z_loss)
    load: Tensor  # [experts] tokens routed to each expert (all k choices), before dropping
    dropped: int  # token choices dropped for lack of capacity


@dataclass
class Assignment:
    """A router's decision as one entry per (token, choice): top-1 choices of every token
    first, then the top-2 ones, each in token order (GShard's slot order).

    ``slot`` is the choice's place in its expert's queue; with a ``capacity`` the choices
    at ``slot >= capacity`` are dropped, with None (``drop_tks=False``) none is.
    """

    token: Tensor  # [k * tokens] long
    expert: Tensor  # [k * tokens] long
    slot: Tensor  # [k * tokens] long
    gate: Tensor  # [k * tokens] gate value (differentiable): float32, or a model's own dtype
    capacity: int | None
    aux_loss: Tensor
    z_loss: Tensor
    load: Tensor  # [experts] choices routed to each expert, before dropping

    def kept_counts(self) -> Tensor:
        """[experts] choices each expert keeps (its load, at most the capacity)."""
        return self.load if self.capacity is None else self.load.clamp(max=self.capacity)


def topk_assignment(index: Tensor, weights: Tensor, num_experts: int) -> Assignment:
    """A model's own top-k routing as an ``Assignment``: ``index`` / ``weights`` ``[tokens, k]``
    (what a Hugging Face MoE block hands its experts). Nothing is dropped (no capacity) and
    no loss is recorded (the model computes its own); choices are ordered as ``assign``
    orders them, and the slots come from one stable sort instead of a ``[choices, experts]``
    one-hot (a DeepSeek-sized router has hundreds of experts); no step waits for the host."""
    if index.dim() != 2 or weights.shape != index.shape:
        raise ValueError(
            f"top-k routing must be index and weights of one shape [tokens, k], got "
            f"{tuple(index.shape)} and {tuple(weights.shape)}"
        )
    num_tokens, k = index.shape
    expert, gate = index.t().reshape(-1), weights.t().reshape(-1)
    order = torch.argsort(expert, stable=True)  # by expert, then choice: each queue in order
    queued = expert.index_select(0, order)
    # each expert's first and last place in the queue order (not bincount: on CUDA it asks
    # the host for the largest index, a sync per layer)
    bounds = torch.searchsorted(queued, torch.arange(num_experts + 1, device=expert.device))
    load, start = bounds.diff(), bounds[:-1]
    place = torch.arange(expert.numel(), device=expert.device) - start.index_select(0, queued)
    slot = torch.empty_like(expert).scatter_(0, order, place)
    token = torch.arange(num_tokens, device=index.device).repeat(k)
    zero = weights.new_zeros((), dtype=torch.float32)
    return Assignment(token, expert, slot, gate, None, zero, zero, load)


def capacity(
    num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int
) -> int:
    """Slots per expert: ``max(ceil(k * capacity_factor * num_tokens / num_experts), min_capacity)``."""
    return max(math.ceil(k * capacity_factor * num_tokens / num_experts), min_capacity)


def load_balancing_loss(probs: Tensor, load: Tensor, num_tokens: int, k: int) -> Tensor:
    """``E / k * sum_e mean_t(probs[:, e]) * load[e] / tokens`` (1 when perfectly balanced).

    ``load[e]`` counts every choice of expert e (all k per token), before dropping.
    """
    num_experts = probs.shape[-1]
    return num_experts / k * torch.sum(probs.mean(0) * (load.float() / num_tokens))


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's z-loss: ``mean_t logsumexp(logits_t)^2`` (keeps gate logits small)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class Router(nn.Module):
    """Base of Top1Router/Top2Router: capacity, noise, losses. Holds no parameters.

    Args:
        k: experts per token.
        capacity_factor_train / capacity_factor_eval: the factor in the capacity formula.
        min_capacity: floor of the capacity.
        noisy_policy: None, "Jitter" (router input times U(1 - eps, 1 + eps), Switch) or
            "Gaussian" (logits plus N(0, 1/experts^2), GShard); training only.
        drop_tks: drop tokens beyond capacity (True) or grow capacity to fit all (False).
        use_z_loss: also compute the router z-loss.
        jitter_eps: the Jitter noise's half width.
    """

    k = 1

    def __init__(
        self,
        capacity_factor_train: float = 1.25,
        capacity_factor_eval: float = 2.0,
        min_capacity: int = 4,
        noisy_policy: str | None = None,
        drop_tks: bool = True,
        use_z_loss: bool = False,
        jitter_eps: float = 1e-2,
    ):
        super().__init__()
        for name, value in (
            ("capacity_factor_train", capacity_factor_train),
            ("capacity_factor_eval", capacity_factor_eval),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not isinstance(min_capacity, int) or min_capacity < 1:
            raise ValueError(f"min_capacity must be an int >= 1, got {min_capacity!r}")
        if noisy_policy not in NOISY_POLICIES:
            raise ValueError(f"noisy_policy must be one of {NOISY_POLICIES}, got {noisy_policy!r}")
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval
        self.min_capacity = min_capacity
        self.noisy_policy = noisy_policy
        self.drop_tks = drop_tks
        self.use_z_loss = use_z_loss
        self.jitter_eps = jitter_eps

    def capacity(self, num_tokens: int, num_experts: int) -> int:
        """Slots per expert under the current mode's factor (before any cross-rank agreement)."""
        factor = self.capacity_factor_train if self.training else self.capacity_factor_eval
        return capacity(num_tokens, num_experts, self.k, factor, self.min_capacity)

    def noisy_input(self, x: Tensor) -> Tensor:
        """Jitter noise on the router's input (training only)."""
        if self.training and self.noisy_policy == "Jitter":
            eps = self.jitter_eps
            return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        return x

    def noisy_logits(self, logits: Tensor) -> Tensor:
        """Gaussian noise on the gate logits (training only)."""
        if self.training and self.noisy_policy == "Gaussian":
            return logits + torch.randn_like(logits) / logits.shape[-1]
        return logits

    def choose(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(probs [tokens, experts], chosen experts [tokens, k], their gate values [tokens, k]),
        choices in order of preference; subclasses define it."""
        raise NotImplementedError

    def assign(self, logits: Tensor, agree_capacity=None) -> Assignment:
        """Route ``logits`` [tokens, experts] to one entry per (token, choice), no masks.

        ``agree_capacity(c) -> int`` makes every rank of an expert group use one
        capacity; it is called only when tokens can be dropped.
        """
        if logits.dim() != 2:
            raise ValueError(f"router logits must be [tokens, experts], got {tuple(logits.shape)}")
        num_tokens, num_experts = logits.shape
        logits = self.noisy_logits(logits)
        probs, index, gate = self.choose(logits.float())
        # choice-major: every token's first choice, then every token's second (GShard's order)
        expert, gate = index.t().reshape(-1), gate.t().reshape(-1)
        # slot = running count of the choice's expert over the choices before it, one scan
        # along the inner dimension of an [experts, choices] one-hot (CUDA's scan down the
        # outer dimension of [choices, experts] is ~100x slower: 2.6 ms at 16k tokens, H200)
        onehot = F.one_hot(expert, num_experts).t().contiguous()
        slot = onehot.cumsum(1).gather(0, expert.unsqueeze(0)).squeeze(0) - 1
        load = onehot.sum(1)
        aux = load_balancing_loss(probs, load, num_tokens, self.k)
        z = router_z_loss(logits) if self.use_z_loss else logits.new_zeros((), dtype=torch.float32)
        cap = None
        if self.drop_tks:
            cap = self.capacity(num_tokens, num_experts)
            cap = agree_capacity(cap) if agree_capacity is not None else cap
        token = torch.arange(num_tokens, device=logits.device).repeat(self.k)
        return Assignment(token, expert, slot, gate, cap, aux, z, load)

    def forward(self, logits: Tensor, agree_capacity=None) -> RouterOutput:
        """Route ``logits`` [tokens, experts] into capacity slots (the ``"capacity"`` dispatch).

        ``agree_capacity(c) -> int`` makes every rank of an expert group use one
        capacity (the all-to-all needs equal shapes); identity when None.
        """
        a = self.assign(logits, agree_capacity)
        num_tokens, num_experts = logits.shape
        cap = a.capacity
        if cap is None:  # room for the busiest expert's every token
            cap = max(int(a.load.max().item()), 1)
            cap = agree_capacity(cap) if agree_capacity is not None else cap
        kept = a.slot < cap
        token, expert, slot = a.token[kept], a.expert[kept], a.slot[kept]
        combine = logits.new_zeros(num_tokens, num_experts, cap, dtype=torch.float32)
        dispatch = torch.zeros(num_tokens, num_experts, cap, dtype=torch.bool, device=logits.device)
        # scatter the kept choices' gates into their slots (no dense one-hot products)
        dispatch[token, expert, slot] = True
        combine = combine.index_put((token, expert, slot), a.gate[kept])
        dropped = a.token.numel() - token.numel()
        return RouterOutput(combine, dispatch, a.aux_loss, a.z_loss, a.load, dropped)


class Top1Router(Router):
    """Switch Transformer routing: each token to its most probable expert, scaled by that gate."""

    k = 1

    def choose(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        probs = F.softmax(logits, dim=-1)
        gate, index = probs.max(dim=-1, keepdim=True)
        return probs, index, gate


class Top2Router(Router):
    """GShard routing: the two most probable experts, gates renormalised to sum to 1."""

    k = 2

    def choose(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        num_experts = logits.shape[-1]
        if num_experts < 2:
            raise ValueError(f"Top2Router needs at least 2 experts, got {num_experts}")
        probs = F.softmax(logits, dim=-1)
        # two argmaxes, not topk: ties (common among bf16 gate logits) go to the lowest
        # index, the same on every device; the second choice is ranked by logit, so it
        # stays defined where its probability underflows to 0
        first = probs.argmax(dim=-1, keepdim=True)
        second = logits.scatter(-1, first, float("-inf")).argmax(dim=-1, keepdim=True)
        index = torch.cat([first, second], dim=-1)
        top = probs.gather(-1, index)
        return probs, index, top / top.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).eps)
