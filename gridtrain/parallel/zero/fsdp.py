"""ZeRO stage 3 on FSDP2, ``torch.distributed.fsdp.fully_shard`` (with offload: ``offload.py``).

Every parameter (a tensor-parallel layer's local shard, or a whole weight) becomes a
DTensor sharded along dim 0 over a one-dimensional ``DeviceMesh`` built from its
data-parallel group (``DeviceMesh.from_group(ctx.group(get_dp_mode(p)))``), so 1d, 2d,
2.5d, 3d and sequence layouts are sharded further over their data ranks and experts
over EXPERT_DATA. FSDP2 all-gathers a unit's parameters before its forward and again
before its backward, frees them after each (``reshard_after_forward=True``) and
reduce-scatters the gradients. Units: each module held in an ``nn.ModuleList`` or
``nn.Sequential`` (a transformer's blocks, a ResNet's blocks), modules whose weights
average over another group (experts), and the root for the rest.

Mixed precision maps onto FSDP2's ``MixedPrecisionPolicy``: naive fp16 keeps the
sharded fp32 parameters as the masters and computes in fp16 (gradients reduced in
fp32); bf16 gathers bf16; torch amp keeps fp32 parameters under autocast.

Gradients are reduce-scattered in every backward, every accumulation micro-step and pipeline
micro-batch, and accumulated into the sharded (fp32) gradients, so a rank holds 1/dp of them
(sharded accumulation, as torchtitan runs FSDP2). ``zero.keep_unsharded_grads`` instead
keeps the full unsharded gradients across the window and reduces only in its last backward
(``set_requires_gradient_sync``): less communication, the whole gradient held. The user's
optimizer is rebound to the DTensor parameters, so ``optimizer.state`` holds DTensors of
this rank's rows only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from gridtrain.config import AMP_TYPE
from gridtrain.parallel.context import ParallelContext
from gridtrain.parallel.mode import ParallelMode
from gridtrain.parallel.optimizer_rebind import rebind_optimizer
from gridtrain.parallel.rows import chunk_rows, owned_range, set_zero_rows
from gridtrain.parallel.sync.base import GradSync
from gridtrain.parallel.tags import copy_tags, default_dp_mode, get_dp_mode
from gridtrain.parallel.zero.memory import Source, grads, optimizer_params, state_tensors
from gridtrain.parallel.zero.memory_rules import (
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    reduces_each_backward,
)

logger = logging.getLogger("gridtrain")


def mixed_precision(amp: AMP_TYPE | None, root: bool = False) -> MixedPrecisionPolicy:
    """FSDP2's policy for a config's fp16 mode (the sharded parameters stay fp32)."""
    if amp is AMP_TYPE.NAIVE:  # the fp16 model of naive amp; its fp32 masters are the shards
        return MixedPrecisionPolicy(  # and, as NaiveAmpModel, the model's output is fp32
            param_dtype=torch.float16,
            reduce_dtype=torch.float32,
            output_dtype=torch.float32 if root else None,
        )
    if amp is AMP_TYPE.BF16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def units(model: nn.Module) -> list[nn.Module]:
    """Modules that get their own ``fully_shard``: those held in a ModuleList or Sequential
    (the root too: GPT's ``h0..h{L-1}``) and a pipeline stage's layers (its
    ``chunk_layer_names``), not looking inside one chosen already, outermost first. A
    module sharing a parameter with anything outside it (a tied embedding and head) is left
    to the unit above, since FSDP2 shards each parameter in one unit."""
    layers = {n for chunk in getattr(model, "chunk_layer_names", ()) for n in chunk}
    where: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        where.setdefault(id(p), []).append(name)
    chosen: list[nn.Module] = []

    def tied(child: nn.Module, prefix: str) -> bool:
        return any(not n.startswith(prefix + ".") for p in child.parameters() for n in where[id(p)])

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if (
                (isinstance(module, nn.ModuleList | nn.Sequential) or path in layers)
                and any(True for _ in child.parameters())
                and not tied(child, path)
            ):
                chosen.append(child)
                continue
            visit(child, path + ".")

    visit(model, "")
    return chosen


class FsdpZero(GradSync):
    """Stage 3 of one engine: ``fully_shard`` applied, the optimizer rebound to the DTensors.

    As a ``GradSync``: FSDP2 reduce-scatters inside every backward (``keep_unsharded_grads``:
    the window's last only), so ``finish()`` and ``after_step()`` have nothing left to do.
    """

    stage = 3
    allows_device_skip = False  # the host decides a non-finite skip over DTensor parameters

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        ctx: ParallelContext,
        amp: AMP_TYPE | None = None,
        keep_unsharded_grads: bool = False,
    ):
        self.ctx, self.model = ctx, model
        self.keep_unsharded_grads = keep_unsharded_grads
        self._meshes: dict[ParallelMode, DeviceMesh] = {}
        mp = mixed_precision(amp)
        if amp is AMP_TYPE.NAIVE:  # naive fp16 runs the whole model in fp16, buffers too
            for buf in model.buffers():
                if buf.is_floating_point():
                    buf.data = buf.data.half()
        old = dict(model.named_parameters())
        managed: set[int] = set()
        for module in _expert_units(model, ctx):  # another group than the default: first
            self._shard(module, mp, managed)
        for module in reversed(units(model)):  # innermost first, as FSDP2 wants
            self._shard(module, mp, managed)
        self._shard(model, mixed_precision(amp, root=True), managed, root=True)
        self.fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        new_of = {}
        for name, p in model.named_parameters():
            before = old[name]
            copy_tags(before, p)
            mode = get_dp_mode(before, ctx)
            n, rank = ctx.world_size(mode), ctx.local_rank(mode)
            rows = before.shape[0] if before.dim() else 1
            set_zero_rows(p, mode, owned_range(rows, n, rank)[0], rows)
            new_of[id(before)] = p
            state = optimizer.state.pop(before, None)
            if state is not None:  # loaded before initialize: keep this rank's rows
                optimizer.state[p] = {k: _as_dtensor_like(v, p, before) for k, v in state.items()}
        rebind_optimizer(optimizer, new_of)
        if not reduces_each_backward(3, keep_unsharded_grads=keep_unsharded_grads):
            self._set_sync(False)  # backwards before the window's last accumulate unsharded
        for m in self.fsdp_modules:  # experts: ranks may route no token to some of them
            if hasattr(m, "set_reduce_scatter_unused_params"):  # not in older torch
                m.set_reduce_scatter_unused_params(True, recurse=False)
        logger.info(
            "zero stage 3 (FSDP2): %d units, mixed precision %s", len(self.fsdp_modules), amp
        )

    def mesh(self, mode: ParallelMode) -> DeviceMesh:
        if mode not in self._meshes:
            self._meshes[mode] = DeviceMesh.from_group(
                self.ctx.group(mode), self.ctx.device.type, mesh=list(self.ctx.ranks(mode))
            )
        return self._meshes[mode]

    def _shard(
        self,
        module: nn.Module,
        mp: MixedPrecisionPolicy,
        managed: set[int],
        root: bool = False,
    ) -> None:
        params = [p for p in module.parameters() if id(p) not in managed]
        if not params and not root:
            return
        modes = {get_dp_mode(p, self.ctx) for p in params} or {default_dp_mode(self.ctx)}
        if len(modes) > 1:
            raise ValueError(
                f"zero stage 3: {type(module).__name__} holds parameters averaged over "
                f"{sorted(m.name for m in modes)}; FSDP2 shards one module over one group, so "
                "keep weights of another group (experts) in modules of their own"
            )
        fully_shard(module, mesh=self.mesh(modes.pop()), mp_policy=mp, reshard_after_forward=True)
        # other entry points than forward (Experts.forward_grouped) gather and free alike
        for name in dir(type(module)):
            if name.startswith("forward_") and callable(getattr(module, name)):
                register_fsdp_forward_method(module, name)
        managed.update(id(p) for p in params)

    def _set_sync(self, on: bool) -> None:
        for m in self.fsdp_modules:
            m.set_requires_gradient_sync(on, recurse=False)
            m.set_is_last_backward(on)

    @contextlib.contextmanager
    def around_backward(self, last: bool) -> Iterator[None]:
        """Every backward reduce-scatters (``keep_unsharded_grads``: the window's last only)."""
        if not last or not self.keep_unsharded_grads:
            yield
            return
        self._set_sync(True)
        try:
            yield
        finally:
            self._set_sync(False)

    def masters(self) -> list[tuple[Tensor, Tensor]]:
        return []  # the model's parameters are the masters

    @property
    def units(self) -> list[nn.Module]:
        """The modules whose parameters are gathered around their forward and backward."""
        return self.fsdp_modules

    def _fsdp_params(self) -> Iterator:
        # FSDP2 has no public view of its gathered tensors: read its parameter groups
        for m in self.fsdp_modules:
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield from group.fsdp_params

    def memory_sources(self, model: nn.Module, optimizer) -> list[Source]:
        """The sharded parameters and the units gathered now (their all-gather outputs,
        storage freed when resharded); the sharded gradients and the unsharded ones
        (``keep_unsharded_grads``, or a backward's before its reduce-scatter)."""
        fsdp = list(self._fsdp_params())
        gathered = [t for fp in fsdp for t in getattr(fp, "all_gather_outputs", [])]
        unsharded = [getattr(fp, "_unsharded_param", None) for fp in fsdp]
        full_grads = [p.grad for p in unsharded if p is not None and p.grad is not None]
        full_grads += [
            fp.unsharded_accumulated_grad
            for fp in fsdp
            if getattr(fp, "unsharded_accumulated_grad", None) is not None
        ]
        # the optimizer's are the sharded parameters; inside a unit's forward the module
        # holds the unsharded ones instead
        params = optimizer_params(optimizer) + list(model.parameters())
        return [
            (PARAMETERS, params + gathered, None),
            (GRADIENTS, grads(params) + full_grads, None),
            (OPTIMIZER_STATE, state_tensors(optimizer), None),
        ]


def _expert_units(model: nn.Module, ctx: ParallelContext) -> list[nn.Module]:
    """The outermost modules all of whose parameters average over a non-default group."""
    default = default_dp_mode(ctx)
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        modes = {get_dp_mode(p, ctx) for p in module.parameters()}
        if modes and default not in modes and len(modes) == 1:
            out.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return out


def _as_dtensor_like(value, param: DTensor, dense: Tensor):
    """A tensor of the parameter's full local shape, as a DTensor of this rank's rows."""
    if not isinstance(value, Tensor) or value.dim() == 0 or value.shape != dense.shape:
        return value
    mesh = param.device_mesh
    rows = value.shape[0]
    lo, hi = owned_range(rows, mesh.size(), mesh.get_local_rank())
    assert chunk_rows(rows, mesh.size()) >= hi - lo
    local = value[lo:hi].clone().to(param.to_local().device)
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=value.shape, stride=value.stride()
    )
