"""Expert parallelism of Hugging Face MoE models composes with the other layouts: data
parallelism beyond the expert group, 1d tensor parallelism of attention and the dense layers,
sequence parallelism, pipeline parallelism, ZeRO 1/2/3 and activation checkpointing, each
equal to the same model trained in one process (``test_hf_moe_parity.check_parity``: losses,
every step's gradients, the weights after 3 AdamW steps, each rank holding only its experts).
"""

from __future__ import annotations

import pytest
from helpers.harness import run_distributed
from helpers.hf_moe import adamw, dense_moe_loss, moe_batches, tiny_moe
from helpers.runs import global_losses, reference_run
from test_hf_moe_parity import COEF, check_parity, train_engine


def _cfg(ep=2, tensor=None, pipeline=1, **extra):
    cfg = dict(moe=dict(expert_parallel_size=ep), **extra)
    if tensor is not None or pipeline > 1:
        cfg["parallel"] = dict(pipeline=pipeline, **({"tensor": tensor} if tensor else {}))
    return cfg


# name: (family, world, config, model config overrides)
LAYOUTS = {
    # data 4, experts over pairs: EXPERT_DATA of 2 ranks averages each expert's gradient
    "dp4-ep2": ("mixtral", 4, _cfg(), {}),
    # 1d: attention, shared expert and head split over TENSOR, experts over EXPERT
    "1d2-ep2": ("qwen2_moe", 4, _cfg(tensor=dict(size=2, mode="1d")), {}),
    # sequence: ring attention; each sequence rank dispatches its own tokens
    "seq2-ep2": ("qwen3_moe", 4, _cfg(tensor=dict(size=2, mode="sequence")), {}),
    # pipeline: each stage's experts over its own EXPERT group (no router logits across stages)
    "pp2-ep2": (
        "deepseek_v3",
        4,
        _cfg(pipeline=2, num_microbatches=2),
        dict(output_router_logits=False),
    ),
    "ep2-zero1": ("mixtral", 2, _cfg(zero=dict(stage=1)), {}),
    "ep2-zero2": ("mixtral", 2, _cfg(zero=dict(stage=2)), {}),
    "ep2-zero3-checkpointed": (
        "qwen2_moe",
        2,
        _cfg(zero=dict(stage=3), activation_checkpoint=True),
        {},
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_composes(layout):
    family, world, config, model_kw = LAYOUTS[layout]
    check_parity(family, world, config, ep=2, **model_kw)


def _bf16_autocast_moe():
    """The tiny Mixtral whose forward runs under CPU bf16 autocast: one process in bf16."""
    import torch

    model = tiny_moe("mixtral")
    amp = torch.autocast("cpu", dtype=torch.bfloat16)

    def enter(module, args) -> None:
        amp.__enter__()

    def leave(module, args, out) -> None:
        amp.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
    return model


def _rel(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_bf16_as_close_to_float32_as_one_process_in_bf16():
    """``fp16 = dict(mode="bf16")`` at ep 2: every step's gradients are as far from the float32
    one-process run as the same model's one process under bf16 autocast is (bf16 alone moves
    the router's gradient by ~25 % of its norm: its terms nearly cancel), and the losses
    follow; each rank holds half of every expert tensor."""
    batches = moe_batches()
    loss = dense_moe_loss(COEF)
    ref = reference_run(lambda: tiny_moe("mixtral"), batches, loss, adamw, grad_steps=3)
    bf16 = reference_run(_bf16_autocast_moe, batches, loss, adamw, grad_steps=3)
    config = dict(moe=dict(expert_parallel_size=2), fp16=dict(mode="bf16"))
    results = run_distributed(train_engine, 2, "mixtral", batches, config=config)
    for rank, (run, held) in enumerate(results):
        assert held and all(share == 0.5 for share in held.values()), (rank, held)
        for step, grads in enumerate(run.grads):
            for key, grad in grads.items():
                want, alone = ref.grads[step][key], bf16.grads[step][key]
                # bf16 roundings differ in order and place (the combine, the gathered
                # router loss): within 1.5x bf16's own distance, plus 1e-2 of the norm
                bound = 1.5 * _rel(alone, want) + 1e-2
                assert _rel(grad, want) <= bound, (rank, step, key, _rel(grad, want), bound)
    losses = global_losses([run for run, _ in results])
    # the loss (~4.2) in bf16, a few roundings deep (one process in bf16: ~1e-2 off)
    assert losses == pytest.approx(ref.losses, abs=3e-2), (losses, ref.losses)
