"""MoE with expert parallelism equals one process holding every expert.

The reference is the same WideNet ViT-MoE with no parallel context (all experts
in one process), loaded from the same full state dict. A data-parallel run of D
ranks optimises the mean over ranks of (cross entropy + aux loss of that rank's
tokens), so the reference runs the global batch as D chunks and averages their
losses. Capacity is large enough that no token is dropped. Compared: outputs,
input gradients, the synced gradient of every parameter (every expert shard
rebuilt into the dense tensor), losses, and weights after 3 SGD steps through
``gt.initialize``; then fp16/bf16 and checkpoints across expert-parallel sizes.
"""

import sys
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout, pick
from helpers.runs import Ints, Normal, batches, data_rows, engine_run, engine_step, local_numel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import gridtrain as gt  # noqa: E402
from demos.moe.model import MoeCriterion, WideNet, WideNetConfig  # noqa: E402
from gridtrain.amp import AMP_TYPE  # noqa: E402
from gridtrain.parallel import moe  # noqa: E402
from gridtrain.parallel.sharding import full_tensor  # noqa: E402
from gridtrain.parallel.tags import get_shard_spec  # noqa: E402

# 8x8 images, 4x4 patches: 5 tokens an image; capacity factor 16 >> any expert's load
CFG = WideNetConfig(
    img_size=8,
    patch_size=4,
    depth=2,
    hidden=16,
    heads=2,
    ffn=16,
    num_experts=4,
    top_k=2,
    capacity_factor_train=16.0,
    capacity_factor_eval=16.0,
    use_z_loss=True,
    aux_loss_coef=0.1,  # large enough that a wrong aux gradient shows
    z_loss_coef=0.01,
)
STEPS, LR, GLOBAL_BATCH = 3, 0.1, 8


def _batches(n=STEPS):
    return batches(n, Normal((GLOBAL_BATCH, 3, 8, 8)), Ints(10, (GLOBAL_BATCH,)), seed=11)


def _dense_state(cfg=CFG):
    torch.manual_seed(5)
    return WideNet(cfg).state_dict()


def _reference(data_size: int, cfg=CFG):
    """One process, all experts: per step outputs, input grads, param grads, losses; final weights."""
    model = WideNet(cfg)
    model.load_state_dict(_dense_state(cfg))
    crit = MoeCriterion(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    steps = []
    for x, y in _batches():
        opt.zero_grad()
        x = x.clone().requires_grad_()
        outs, losses, drops = [], [], 0
        for xc, yc in zip(x.chunk(data_size), y.chunk(data_size), strict=True):
            out = model(xc)
            losses.append(crit(out, yc))
            drops += moe.expert_load(model)[1]
            outs.append(out)
        torch.stack(losses).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        steps.append(
            (torch.cat(outs).detach(), x.grad.clone(), grads, torch.stack(losses).detach(), drops)
        )
        opt.step()
    return steps, model.state_dict()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _train(ctx, state, data, cfg=CFG):
    """Per step: this rank's output, input gradient, the synced gradients (read back dense
    from the optimizer's momentum), its loss and dropped tokens; the final dense state; the
    elements of the first expert weight this rank holds (``run.shares`` cannot tell: the
    experts are cut when the model is built, before ``engine_run`` counts the dense sizes)."""
    torch.manual_seed(5)
    model = WideNet(cfg)
    gt.load_full_state_dict(model, state)
    data = [(x.clone().requires_grad_(), y) for x, y in data]  # x.grad: the input gradient

    def out_and_drops(engine, outputs):
        return outputs[0].detach().float(), moe.expert_load(model)[1]

    run = engine_run(
        ctx,
        lambda: model,
        data,
        MoeCriterion(model),
        _sgd,
        grad_steps=len(data),
        watch=out_and_drops,
        example_inputs=data[0][0].detach(),
    )
    steps = []
    for (x, _), (out, dropped), grads, loss in zip(data, run.watched, run.grads, run.losses):
        steps.append((out, data_rows(x.grad, ctx), grads, loss, dropped))
    return steps, run.state, local_numel(model.moe.experts.w1)


LAYOUTS = {
    **pick("ep2-dp2", "ep4-dp4", "ep2-dp4"),  # ep2-dp4: EXPERT_DATA of 2 ranks
    "ep2-dp4-handler": layout("ep2-dp4", gradient_handler=[dict(type="MoeGradientHandler")]),
    "ep2-dp2-tp1d2": layout("ep2-dp4-1d2"),
}
_REF_CACHE = {}


def _ref(data_size):
    if data_size not in _REF_CACHE:
        _REF_CACHE[data_size] = _reference(data_size)
    return _REF_CACHE[data_size]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_equals_one_process(name):
    world, config = LAYOUTS[name]
    tp = config.get("parallel", {}).get("tensor", {}).get("size", 1)
    ep = config["moe"]["expert_parallel_size"]
    data = world // tp
    ref_steps, ref_final = _ref(data)
    results = run_distributed(_train, world, _dense_state(), _batches(), config=config, timeout=300)
    errors = {"out": 0.0, "xgrad": 0.0, "grad": 0.0, "weight": 0.0}
    dense_w1 = _dense_state()["moe.experts.w1"].numel()
    for rank, (steps, final, w1_held) in enumerate(results):
        # each rank holds only its num_experts / ep experts (a replica would hold all of them)
        assert w1_held == dense_w1 // ep, (name, rank, w1_held, dense_w1)
        dr = rank // tp
        for (out, xg, grads, loss, dropped), (r_out, r_xg, r_grads, r_losses, r_drops) in zip(
            steps, ref_steps, strict=True
        ):
            assert dropped == 0 and r_drops == 0, "capacity factor 16 drops nothing"
            # fp32, same math, different summation order (einsum over other capacity sizes,
            # all-to-all partial sums): errors at 1e-7, 1e-5 leaves a margin
            torch.testing.assert_close(out, r_out.chunk(data)[dr], rtol=0, atol=1e-5)
            assert loss == pytest.approx(r_losses[dr].item(), abs=1e-5)
            # a rank's loss is its own chunk's; the reference's is the mean over chunks
            torch.testing.assert_close(xg / data, r_xg.chunk(data)[dr], rtol=0, atol=1e-6)
            for n, g in grads.items():
                torch.testing.assert_close(g, r_grads[n], rtol=0, atol=1e-5, msg=n)
                errors["grad"] = max(errors["grad"], (g - r_grads[n]).abs().max().item())
            errors["out"] = max(errors["out"], (out - r_out.chunk(data)[dr]).abs().max().item())
            errors["xgrad"] = max(
                errors["xgrad"], (xg / data - r_xg.chunk(data)[dr]).abs().max().item()
            )
        for k, v in final.items():
            # 3 SGD steps at lr 0.1 on gradients equal to 1e-5: weights to 1e-5
            torch.testing.assert_close(v, ref_final[k], rtol=0, atol=1e-5, msg=k)
            errors["weight"] = max(errors["weight"], (v - ref_final[k]).abs().max().item())
    print(f"\n{name}: max abs errors {errors}")


def _grad_scale_probe(ctx, state):
    """Gradient of one expert weight right after backward, before any data-parallel sync."""
    torch.manual_seed(5)
    model = WideNet(CFG)
    gt.load_full_state_dict(model, state)
    x, y = data_rows(_batches(1)[0], ctx)
    MoeCriterion(model)(model(x), y).backward()
    return full_tensor(model.moe.experts.w1.grad, get_shard_spec(model.moe.experts.w1), ctx)


def test_expert_gradient_before_sync_is_one_over_ep_of_its_group_sum():
    """Without the 1/ep scale an expert's local gradient sums its EXPERT group's tokens; with it,
    the EXPERT_DATA mean equals the data-parallel mean (checked above). Here ep = data = 2:
    the local expert gradient must already be the mean over the two ranks' losses."""
    (ref_steps, _) = _ref(2)
    results = run_distributed(
        _grad_scale_probe,
        2,
        _dense_state(),
        config=dict(moe=dict(expert_parallel_size=2)),
        timeout=300,
    )
    for g in results:
        torch.testing.assert_close(g, ref_steps[0][2]["moe.experts.w1"], rtol=0, atol=1e-6)


def _bad_experts(ctx):
    with pytest.raises(ValueError) as err:
        moe.Experts(3, 8, 8, ctx=ctx)
    return str(err.value)


def test_indivisible_experts_error_before_any_collective():
    messages = run_distributed(
        _bad_experts, 2, config=dict(moe=dict(expert_parallel_size=2)), timeout=300
    )
    assert "num_experts 3 is not divisible by moe.expert_parallel_size 2" in messages[0]


def _train_amp(ctx, state, batches):
    steps, *_ = _train(ctx, state, batches)  # the precision comes from the launch config
    return [s[3] for s in steps]


@pytest.mark.parametrize("mode", [AMP_TYPE.NAIVE, AMP_TYPE.BF16])
def test_mixed_precision_losses_follow_fp32(mode):
    ref_steps, _ = _ref(2)
    config = dict(moe=dict(expert_parallel_size=2), fp16=dict(mode=mode, initial_scale=2**8))
    results = run_distributed(_train_amp, 2, _dense_state(), _batches(), config=config, timeout=300)
    for rank, losses in enumerate(results):
        ref = [s[3][rank].item() for s in ref_steps]
        # fp16 keeps ~3 significant digits, bf16 ~2; over 3 steps the loss (~2.4) stays within
        # 2e-2 (fp16) / 6e-2 (bf16) of fp32
        tol = 2e-2 if mode == AMP_TYPE.NAIVE else 6e-2
        assert losses == pytest.approx(ref, abs=tol), (mode, losses, ref)


def _ckpt_save(ctx, state, batches, path):
    torch.manual_seed(5)
    model = WideNet(CFG)
    gt.load_full_state_dict(model, state)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = gt.initialize(model, opt, criterion=MoeCriterion(model))
    _step(engine, ctx, *batches[0])
    gt.save_checkpoint(path, 1, engine.model, engine.optimizer)
    _step(engine, ctx, *batches[1])
    return gt.full_state_dict(engine.model)


def _ckpt_load(ctx, batches, path):
    torch.manual_seed(99)  # different init: everything must come from the checkpoint
    model = WideNet(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = gt.initialize(model, opt, criterion=MoeCriterion(model))
    epoch = gt.load_checkpoint(path, engine.model, engine.optimizer)
    loaded = gt.full_state_dict(engine.model)
    _step(engine, ctx, *batches[1])
    return epoch, loaded, gt.full_state_dict(engine.model)


def _step(engine, ctx, x, y):
    engine_step(engine, *data_rows((x, y), ctx), ctx)


def test_checkpoint_at_ep4_loads_at_ep2_and_ep1(tmp_path):
    path = str(tmp_path / "moe.pt")
    batches = _batches(2)
    saved_next = run_distributed(
        _ckpt_save,
        4,
        _dense_state(),
        batches,
        path,
        config=dict(moe=dict(expert_parallel_size=4)),
        timeout=300,
    )[0]
    on_disk = torch.load(path, weights_only=False)["model"]
    assert on_disk["moe.experts.w1"].shape == (4, 16, 16), "experts saved dense"
    for ep in (2, 1):
        # same 4 data ranks, so each step sees the same chunks; only the expert layout differs
        epoch, loaded, after = run_distributed(
            _ckpt_load,
            4,
            batches,
            path,
            config=dict(moe=dict(expert_parallel_size=ep)),
            timeout=300,
        )[0]
        assert epoch == 1
        for k, v in loaded.items():
            assert torch.equal(v, on_disk[k]), (ep, k)  # a copy: exact
        for k, v in after.items():
            # one Adam step from equal weights and moments on gradients equal to ~1e-7
            torch.testing.assert_close(v, saved_next[k], rtol=0, atol=1e-5, msg=f"ep{ep} {k}")
