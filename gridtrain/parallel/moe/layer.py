"""MoeLayer: gate, route, dispatch to the experts over the EXPERT group, combine back (GShard).

Two dispatches give the same result. ``dispatch="grouped"`` (the default) sorts the kept
tokens by expert and sends only them, with uneven all-to-alls, into grouped matmuls
(see ``dispatch.py``). ``dispatch="capacity"``, the original one, pads every expert to
the capacity ``C`` and moves ``[E, C, d]`` slots; per forward, with ``E`` experts and
``ep`` ranks per expert group:

    logits = gate(x)                        [T, E]
    dispatch, combine = router(logits)      [T, E, C]
    expert_in = dispatch^T x                [E, C, d] (a gather) -> all-to-all over EXPERT ->
                                            [ep sources, E/ep local experts, C, d]
    expert_out = experts(expert_in)         (each local expert sees ep * C slots)
    all-to-all back -> [E, C, d];  y = combine . expert_out   [T, d] (a scatter-add)

The layer keeps each forward's weighted auxiliary loss (load balancing plus
z-loss) until ``collect_aux_loss(model)`` takes them, and the expert load and
dropped-token count of the latest forwards for logging.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from gridtrain.parallel import comm
from gridtrain.parallel.context import ParallelContext, get_context, has_context
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.moe.dispatch import grouped_dispatch
from gridtrain.parallel.moe.experts import Experts
from gridtrain.parallel.moe.router import Assignment, Router, RouterOutput
from gridtrain.parallel.random import recomputing

DISPATCHES = ("grouped", "capacity")


class MoeLayer(nn.Module):
    """A mixture-of-experts feed-forward layer (already parallel: the tensor planner keeps it).

    Args:
        hidden_size: model width ``d``.
        num_experts: experts in the layer (divisible by ``moe.expert_parallel_size``).
        router: a ``Top1Router``/``Top2Router``.
        experts: the ``Experts`` (built with the same ``num_experts``).
        aux_loss_coef / z_loss_coef: weights of the two losses in ``collect_aux_loss``.
        ctx: the parallel context (default: the current one; none means one process).
        dispatch: ``"grouped"`` (tokens sorted by expert, grouped matmuls) or
            ``"capacity"`` (``[E, capacity]`` slots, batched matmul); same results.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        router: Router,
        experts: Experts,
        aux_loss_coef: float = 1e-2,
        z_loss_coef: float = 1e-3,
        ctx: ParallelContext | None = None,
        dispatch: str = "grouped",
    ):
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"MoeLayer dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        self.dispatch = dispatch
        self.gt_parallel = True
        if ctx is None and has_context():
            ctx = get_context()
        if experts.num_experts != num_experts:
            raise ValueError(
                f"MoeLayer num_experts {num_experts} != experts.num_experts {experts.num_experts}"
            )
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep = experts.ep
        self.router = router
        self.experts = experts
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        device = ctx.device if ctx is not None else None
        # replicated gate, drawn like nn.Linear(hidden, experts, bias=False)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, device=device)
        self._ctx = [ctx]  # a list keeps the context out of the module tree (and state dicts)
        self._losses: list[Tensor] = []
        self.last_load: Tensor | None = None  # [E] tokens per expert, summed over recent forwards
        self.last_dropped: Tensor | int = 0  # a device tensor when counting it would sync

    @property
    def ctx(self) -> ParallelContext | None:
        return self._ctx[0]

    def _group(self):
        return self.ctx.group(ParallelMode.EXPERT)

    def _agree_capacity(self, cap: int) -> int:
        if self.ep == 1:
            return cap
        t = torch.tensor([float(cap)], device=self.ctx.device)
        return int(comm.all_reduce_max(t, self._group()).item())

    def _noise_rng(self):
        # noise differs per data rank, equal across the tensor ranks that share the tokens
        if self.ctx is None or not self.training or self.router.noisy_policy is None:
            return contextlib.nullcontext()
        return self.ctx.fork_rng(ParallelMode.DATA)

    def route(self, tokens: Tensor) -> RouterOutput:
        """The router's decision for ``tokens`` [T, d], as capacity slots."""
        with self._noise_rng():
            logits = self.gate(self.router.noisy_input(tokens))
            return self.router(logits, self._agree_capacity)

    def assign(self, tokens: Tensor) -> Assignment:
        """The router's decision for ``tokens`` [T, d], one entry per (token, choice)."""
        with self._noise_rng():
            logits = self.gate(self.router.noisy_input(tokens))
            return self.router.assign(logits, self._agree_capacity)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoeLayer expects [..., {self.hidden_size}], got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.hidden_size)
        if self.dispatch == "capacity":
            return self._forward_capacity(tokens).reshape(x.shape)
        a = self.assign(tokens)
        group = self._group() if self.ep > 1 else None
        out, dropped = grouped_dispatch(tokens, a, self.experts, group, self.ep)
        self._record(a.aux_loss, a.z_loss, a.load, dropped)
        return out.reshape(x.shape)

    def _forward_capacity(self, tokens: Tensor) -> Tensor:
        routed = self.route(tokens)
        self._record(routed.aux_loss, routed.z_loss, routed.load, routed.dropped)
        cap = routed.dispatch_mask.shape[-1]
        ep, local = self.ep, self.num_experts // self.ep
        # sparse dispatch: gather each kept (token, expert, slot) instead of multiplying by the
        # [T, E, C] mask, whose einsum costs T * E * C * d (quadratic in tokens)
        token, expert, slot = routed.dispatch_mask.nonzero(as_tuple=True)
        flat = expert * cap + slot
        expert_in = tokens.new_zeros(self.num_experts * cap, self.hidden_size)
        expert_in = expert_in.index_add(0, flat, tokens.index_select(0, token))

        expert_in = expert_in.reshape(ep, local, cap, self.hidden_size)
        if ep > 1:  # chunk j (experts of rank j) to rank j; stack what arrives by source
            expert_in = comm.all_to_all(expert_in, 0, 0, self._group())
        expert_in = expert_in.transpose(0, 1).reshape(local, ep * cap, self.hidden_size)
        expert_out = self.experts(expert_in)
        expert_out = expert_out.reshape(local, ep, cap, self.hidden_size).transpose(0, 1)
        if ep > 1:  # each source's slots back to it, stacked by expert rank
            expert_out = comm.all_to_all(expert_out.contiguous(), 0, 0, self._group())
        expert_out = expert_out.reshape(self.num_experts * cap, self.hidden_size)
        gate = routed.combine_weights[token, expert, slot].to(tokens.dtype).unsqueeze(1)
        picked = expert_out.index_select(0, flat)
        return tokens.new_zeros(tokens.shape).index_add(0, token, gate * picked)

    def _record(
        self, aux_loss: Tensor, z_loss: Tensor, load: Tensor, dropped: Tensor | int
    ) -> None:
        if recomputing():  # activation checkpoint replaying the forward: recorded already
            return
        loss = self.aux_loss_coef * aux_loss
        if self.router.use_z_loss:
            loss = loss + self.z_loss_coef * z_loss
        self._losses.append(loss)
        load = load.clone()
        self.last_load = load if self.last_load is None else self.last_load + load
        self.last_dropped = self.last_dropped + dropped  # never in place: callers keep it

    def reset(self) -> None:
        """Forget recorded losses, load and drops (a model calls this as its forward starts)."""
        self._losses, self.last_load, self.last_dropped = [], None, 0

    def take_losses(self) -> list[Tensor]:
        """The weighted aux losses recorded since the last call (and forget them)."""
        losses, self._losses = self._losses, []
        return losses

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, experts={self.num_experts}, ep={self.ep}, "
            f"dispatch={self.dispatch}"
        )


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    """Every MoeLayer inside ``model`` (engine wrappers included)."""
    return [m for m in model.modules() if isinstance(m, MoeLayer)]


def collect_aux_loss(model: nn.Module) -> Tensor:
    """Sum of the weighted aux/z losses of every MoE layer since the last call; clears them.

    Add it to the task loss before backward (a layer called several times, as in
    WideNet, contributes once per call). 0 when the model has no MoE layer.
    """
    losses = [loss for layer in moe_layers(model) for loss in layer.take_losses()]
    if not losses:
        return torch.zeros(())
    return torch.stack([loss.float() for loss in losses]).sum()


def pending_aux_loss(model: nn.Module) -> Tensor:
    """The detached sum ``collect_aux_loss`` would return now, without clearing (for logging)."""
    losses = [loss.detach().float() for layer in moe_layers(model) for loss in layer._losses]
    return torch.stack(losses).sum() if losses else torch.zeros(())


def clear_aux_loss(model: nn.Module) -> None:
    """Reset every MoE layer's losses, load and drops; call it as a model's forward starts."""
    for layer in moe_layers(model):
        layer.reset()


def expert_load(model: nn.Module) -> tuple[Tensor | None, int]:
    """(tokens routed to each expert, dropped choices) of every MoE layer since the last reset."""
    layers = [m for m in moe_layers(model) if m.last_load is not None]
    if not layers:
        return None, 0
    load = torch.stack([m.last_load.float() for m in layers]).sum(0)
    return load, int(sum(m.last_dropped for m in layers))
