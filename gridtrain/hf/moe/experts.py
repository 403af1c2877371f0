"""A Hugging Face model's fused experts, spread over the EXPERT group.

Recent ``transformers`` MoE families keep each layer's experts as one module whose
tensors are ``[num_experts, ...]`` (``gate_up_proj``, ``down_proj``, optional biases)
and whose forward takes ``(hidden_states [T, d], top_k_index [T, k], top_k_weights [T,
k])`` from the block's router (GPT-OSS names them ``router_indices`` and
``routing_weights``: ``FORWARD_ARGS``). Their expert-parallel plan (``model.ep_plan``) names
those modules (``ep_dispatch_experts``) and tensors (``grouped_gemm``). For each:

* every per-expert tensor is cut to this rank's ``num_experts / ep`` experts (a
  contiguous block, as ``Experts`` cuts its own), tagged as a dim-0 shard over EXPERT
  whose gradient averages over EXPERT_DATA, so full state dicts, checkpoints and
  ``save_pretrained`` keep the model's dense keys and shapes;
* the module's class becomes a subclass whose forward dispatches: the router's choices
  become an ``Assignment`` (``topk_assignment``) and go through the one grouped dispatch
  (``parallel.moe.dispatch``: counts, then rows, by all-to-all over EXPERT, dropless);
  the rows a rank receives run on its local experts (``grouped.py``: grouped GEMMs on
  the module's tensors on Hopper in bf16, else the module's own forward, as top-1
  choices of weight 1); the gates are applied when the rows are back. At ep 1 the same
  forward runs with every expert local (no all-to-all, no host sync), or, without
  grouped GEMMs, the model's own forward as it is;
* the router, shared experts and everything else in the block stay the model's code.

Gradient scale: an expert's gradient on a rank sums the tokens of its whole EXPERT group,
so averaging it over EXPERT_DATA would give ``ep`` times the data-parallel mean; the rows
pass a ``1/ep`` gradient scale on the way out of the experts and ``ep`` on the way in,
which leaves every input gradient as it is (``Experts`` scales its weights instead; here
the weights are used inside the model's own code).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gridtrain.hf.moe.grouped import LocalExperts
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.moe.dispatch import grouped_dispatch
from gridtrain.parallel.moe.router import topk_assignment
from gridtrain.parallel.tags import set_dp_mode, set_shard_spec
from gridtrain.parallel.tensor.plan import PlanError, pattern_matches

EP_TENSOR = "grouped_gemm"
# The experts module's style. transformers 5.17's plans name it "moe_tp_experts" and the
# router "ep_router": there the router keeps one rank's experts' choices and the experts'
# outputs are summed over the ranks. Here the router stays whole on every rank and the
# experts module sends each token to the rank holding its expert, which is the plain model's
# routing, so those styles ask for nothing more.
EP_MODULES = ("ep_dispatch_experts", "moe_tp_experts")
EP_ROUTER = "ep_router"
EP_STYLES = (*EP_MODULES, EP_TENSOR, EP_ROUTER)
# the experts' forward arguments (hidden states [T, d], each token's k experts [T, k] and
# their weights [T, k]) under the names the families give them
FORWARD_ARGS = (
    ("hidden_states", "top_k_index", "top_k_weights"),  # Mixtral, Qwen, DeepSeek, ...
    ("hidden_states", "router_indices", "routing_weights"),  # GPT-OSS
)


@dataclass
class Placement:
    """Where one experts module's experts live: ``ep`` ranks of ``group``, this one holding
    experts ``[first, first + local)`` of ``num_experts``."""

    num_experts: int
    ep: int
    first: int
    group: object = None  # the EXPERT process group (None at ep 1)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    @property
    def local(self) -> int:
        return self.num_experts // self.ep

    def __deepcopy__(self, memo):  # a process group cannot be copied; the planner copies modules
        return self


def expert_modules(model: nn.Module) -> dict[str, list[str]]:
    """Experts module path -> its per-expert parameters (names inside it), from the model's
    expert-parallel plan; {} for a model without one. Styles gridtrain does not implement
    are refused by name."""
    plan = dict(getattr(model, "ep_plan", None) or getattr(model, "_ep_plan", None) or {})
    for pattern, style in plan.items():
        if style not in EP_STYLES:
            raise PlanError(
                f"{type(model).__name__}'s expert-parallel plan gives '{pattern}' the style "
                f"{style!r}, which gridtrain does not implement ({', '.join(EP_STYLES)})"
            )
    spread = [p for p, s in plan.items() if s in EP_MODULES]
    tensors = [p for p, s in plan.items() if s == EP_TENSOR]
    found: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        if any(pattern_matches(p, name) for p in spread):
            found[name] = [
                local
                for local, _ in model.get_submodule(name).named_parameters()
                if any(pattern_matches(p, f"{name}.{local}") for p in tensors)
            ]
    return found


def check_experts(name: str, module: nn.Module, per_expert: list[str], ep: int) -> int:
    """The module's expert count; a PlanError naming ``name`` and what it lacks to be spread
    over ``ep`` ranks."""
    num, lack = _what_lacks(module, per_expert, ep)
    if lack is not None:
        raise PlanError(f"'{name}' ({type(module).__name__}): {lack}")
    return num


def forward_args(cls: type) -> tuple[str, str, str] | None:
    """The names of the experts class's forward's (hidden states, expert index, weights)
    arguments, when they are one of ``FORWARD_ARGS``; None otherwise."""
    if issubclass(cls, ExpertParallel):  # dispatching already: its experts class's names
        return cls.gt_forward_args
    args = tuple(inspect.signature(cls.forward).parameters)[1:4]
    return args if args in FORWARD_ARGS else None


def _what_lacks(module: nn.Module, per_expert: list[str], ep: int) -> tuple[int, str | None]:
    """(the expert count, what keeps ``module``'s experts from the dispatch, or None)."""
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int) or num < 1:
        return 0, "an experts module without an int num_experts"
    if forward_args(type(module)) is None:
        args = list(inspect.signature(type(module).forward).parameters)[1:4]
        known = " or ".join(str(list(a)) for a in FORWARD_ARGS)
        return num, (
            f"its forward takes {args}, not {known}: gridtrain hands fused experts their "
            "tokens in that form only"
        )
    others = [n for n, _ in module.named_parameters() if n not in per_expert]
    if others:
        return num, (
            f"holds parameters that are not per expert ({others}); gridtrain spreads whole "
            "experts and cannot place a tensor shared by all of them"
        )
    for local, p in module.named_parameters():
        if p.dim() == 0 or p.shape[0] != num:
            return num, (
                f"'{local}' of shape {tuple(p.shape)} is in the expert plan but its first "
                f"dimension is not num_experts={num}"
            )
    if num % ep:
        return num, (
            f"{num} experts do not split over moe.expert_parallel_size {ep} ({num} % {ep} != 0)"
        )
    return num, None


def spread(
    name: str, module: nn.Module, num: int, ctx: ParallelContext, init=None
) -> tuple[Placement, dict[int, nn.Parameter]]:
    """Keep this rank's experts of ``module`` and switch it to the dispatching forward;
    returns its placement and old parameter id -> new parameter. ``init``: the model's
    ``_init_weights``, re-run on the local experts when a lazily built model materialises."""
    ep = ctx.world_size(ParallelMode.EXPERT)
    rank = ctx.local_rank(ParallelMode.EXPERT)
    group = ctx.group(ParallelMode.EXPERT) if ep > 1 else None
    place = Placement(num, ep, rank * (num // ep), group)
    new_of: dict[int, nn.Parameter] = {}
    for local, p in list(module.named_parameters()):
        kept = p.detach()[place.first : place.first + place.local]
        q = nn.Parameter(kept.clone(), requires_grad=p.requires_grad)
        set_shard_spec(q, (0, ParallelMode.EXPERT))
        set_dp_mode(q, ParallelMode.EXPERT_DATA)
        owner, _, attr = local.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, attr, q)
        new_of[id(p)] = q
        place.shapes[local] = (tuple(p.shape), tuple(q.shape))
    module.num_experts = place.local  # the model's own forward then runs the local experts
    module.gt_experts = place
    module.__class__ = _dispatching(type(module))
    if init is not None and not hasattr(module, "reset_parameters"):
        module.reset_parameters = types.MethodType(_reset_with(init), module)
    return place, new_of


def keep_whole(module: nn.Module, per_expert: list[str]) -> None:
    """At ep 1: every expert stays on this rank, planned as one block. Experts the dispatch
    takes run through it (grouped GEMMs where the device has them, else the model's own
    forward); any others run the model's own forward as they are (nothing is spread, so
    nothing they lack matters)."""
    num, lack = _what_lacks(module, per_expert, 1)
    if lack is not None:
        module.gt_parallel = True  # the tensor planner keeps it whole, never traced inside
        return
    module.gt_experts = Placement(num, 1, 0)
    module.__class__ = _dispatching(type(module))


def _reset_with(init):
    def reset_parameters(self: nn.Module) -> None:
        with torch.no_grad():
            init(self)

    return reset_parameters


class ExpertParallel:
    """Mixed into an experts module's class by ``spread`` / ``keep_whole``: the dispatching
    forward. At ep 1 without grouped GEMMs (the CPU) it is the model's own forward."""

    gt_parallel = True  # the tensor planner keeps the module whole and never traces inside
    gt_experts: Placement
    gt_forward_args: tuple[str, str, str]  # its own forward's names (``FORWARD_ARGS``)

    def forward(self, *args, **kwargs):
        hidden_states, top_k_index, top_k_weights = _routed(self, args, kwargs)
        if hidden_states.dim() != 2:
            raise ValueError(
                f"{type(self).__name__}: expected hidden_states [tokens, hidden], got "
                f"{tuple(hidden_states.shape)}"
            )
        place = self.gt_experts
        eager = super().forward
        experts = LocalExperts(self, eager, place.local, place.ep)
        if place.ep == 1 and not experts.uses_grouped_mm(hidden_states):
            return eager(hidden_states, top_k_index, top_k_weights)
        a = topk_assignment(top_k_index, top_k_weights, place.num_experts)
        out, _ = grouped_dispatch(hidden_states, a, experts, place.group, place.ep)
        return out


def _routed(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Tensor]:
    """(hidden states, expert index, weights) from a call of the experts module, by position
    or by the names its own forward gives them; any other argument is refused."""
    names = module.gt_forward_args
    extra = [k for k in kwargs if k not in names]
    if extra or len(args) > len(names):
        raise TypeError(
            f"{type(module).__name__}: gridtrain's expert dispatch takes {list(names)} only, "
            f"got {len(args)} positional arguments and {sorted(kwargs)}"
        )
    got = dict(zip(names, args)) | kwargs
    missing = [n for n in names if got.get(n) is None]
    if missing:
        raise TypeError(f"{type(module).__name__}: the expert dispatch needs {missing}")
    return got[names[0]], got[names[1]], got[names[2]]


_CLASSES: dict[type, type] = {}


def _dispatching(cls: type) -> type:
    """``cls`` with ``ExpertParallel``'s forward (one subclass per class, so ``isinstance``
    and the module's own methods still hold)."""
    if issubclass(cls, ExpertParallel):
        return cls
    if cls not in _CLASSES:
        names = {"gt_forward_args": forward_args(cls)}
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), names)
    return _CLASSES[cls]
