"""A Hugging Face MoE's experts after ``gt.initialize`` (``moe.expert_parallel_size`` 1) on one
device in bf16: on Hopper they run gridtrain's grouped dispatch (``torch._grouped_mm`` on the
model's fused tensors, no host sync); outputs and gradients against the model's own eager
experts in float64 on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_env import ON_CUDA, is_hopper, rel_err

import gridtrain as gt

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 64, 96, 8, 2, 300


def _mixtral():
    import transformers as tf

    cfg = tf.MixtralConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16().double()  # values bf16 can hold
    # two different experts of 0-6 per token (expert 7 idle), the first 20 tokens on 1 and 3
    index = torch.rand(TOKENS, EXPERTS - 1, generator=g).argsort(-1)[:, :TOP_K]
    index[:20] = torch.tensor([1, 3])
    weights = torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64).softmax(-1)
    probe = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    return x, index, weights, probe


def _run(experts, x, index, weights, probe):
    x = x.clone().requires_grad_()
    out = experts(x, index, weights)
    (out.double() * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    return out.detach(), x.grad, grads


def test_hf_experts_bf16_track_float64(launch, device):
    model = _mixtral()
    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")  # the model's own per-expert loop
    x, index, weights, probe = _inputs()
    want = _run(ref.model.layers[0].mlp.experts, x, index, weights, probe)

    launch(dict(moe=dict(expert_parallel_size=1), compile=False))
    model = model.to(device, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = gt.initialize(model, opt, gt.nn.CrossEntropyLoss())
    experts = engine.model.model.layers[0].mlp.experts
    on = dict(device=device)
    args = (x.to(**on, dtype=torch.bfloat16), index.to(**on), weights.float().to(**on))
    got = _run(experts, *args, probe.to(**on))
    assert got[0].dtype == torch.bfloat16, "the experts ran in bf16"
    # bf16 weights, inputs and hidden activations (~4e-3 per rounding), fp32 sums
    assert rel_err(got[0], want[0]) < 2e-2, rel_err(got[0], want[0])
    assert rel_err(got[1], want[1]) < 2e-2, rel_err(got[1], want[1])
    for name, g_want in want[2].items():
        assert rel_err(got[2][name], g_want) < 2e-2, (name, rel_err(got[2][name], g_want))
    assert got[2]["gate_up_proj"][7].abs().max().item() == 0.0, "idle expert: zero gradient"


def test_hf_experts_run_grouped_mm_without_a_host_sync(launch, device):
    if not (ON_CUDA and is_hopper()):
        pytest.skip("the grouped path is torch._grouped_mm's (Hopper, bf16)")
    launch(dict(moe=dict(expert_parallel_size=1), compile=False))
    model = _mixtral().to(device, torch.bfloat16)
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    experts = engine.model.model.layers[0].mlp.experts
    x, index, weights, probe = (t.to(device) for t in _inputs())
    args = (x.bfloat16(), index, weights.float(), probe)
    _run(experts, *args)  # warm-up: allocator growth may sync
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            _run(experts, *args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_grouped_mm" in ops, sorted(ops)
