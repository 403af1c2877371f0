"""Data parallelism through gt.initialize: N ranks equal one process on the concatenated batch."""

import pytest
import torch
import torch.nn.functional as F
from helpers.harness import run_distributed
from helpers.models import MLP, mlp, momentum_sgd
from helpers.runs import (
    Normal,
    assert_grads_close,
    batches,
    engine_run,
    global_losses,
    reference_run,
)

import gridtrain as gt
from gridtrain.gradient_handlers import SequenceParallelGradientHandler, handler_class
from gridtrain.parallel import comm
from gridtrain.parallel.sync import OverlappedDataParallel
from gridtrain.parallel.tags import set_dp_mode

PM = gt.ParallelMode
STEPS, GLOBAL_BATCH = 3, 8
DATA = batches(STEPS, Normal((GLOBAL_BATCH, MLP.D_IN)), Normal((GLOBAL_BATCH, MLP.D_OUT)))
# fp32 gradients summed in a different order (per-rank means, then all-reduce): ~1e-7 relative
TOL = dict(rtol=1e-5, atol=1e-6)


def _perturbed(ctx):
    model = mlp()
    if ctx.global_rank != 0:  # initialize must broadcast rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def _train_dp(ctx):
    def overlapped(engine):
        return isinstance(engine.grad_sync, OverlappedDataParallel)

    build = lambda: _perturbed(ctx)  # noqa: E731
    return engine_run(ctx, build, DATA, F.mse_loss, momentum_sgd, probe=overlapped)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("handler", [None, "DataParallelGradientHandler"])
def test_data_parallel_equals_one_process(world, handler):
    config = dict(gradient_handler=[dict(type=handler)] if handler else [])
    runs = run_distributed(_train_dp, world, config=config, timeout=300)
    ref = reference_run(mlp, DATA, F.mse_loss, momentum_sgd)
    for run in runs:
        assert run.probed == (handler is None), "no handler named -> the overlapped path"
        for key in ref.state:
            torch.testing.assert_close(run.state[key], ref.state[key], **TOL)
        assert_grads_close(run.grads[0], ref, **TOL)  # the averaged gradient it applied
    # mean of the per-rank losses is the global-batch loss (equal shards)
    torch.testing.assert_close(torch.tensor(global_losses(runs)), torch.tensor(ref.losses), **TOL)


def _overlap_launches_during_backward(ctx):
    torch.manual_seed(0)
    model = MLP()
    dp = OverlappedDataParallel(model, ctx, bucket_size_mb=1e-6)  # one bucket per parameter
    x = torch.randn(4, 8) + ctx.global_rank
    launched_in_backward = []
    with dp.overlap():
        F.mse_loss(model(x), torch.zeros(4, 4)).backward()
        launched_in_backward.append(dp._next)  # buckets already in flight before finish()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    dp.finish()
    return (
        len(dp.buckets),
        launched_in_backward[0],
        local,
        {n: p.grad.clone() for n, p in model.named_parameters()},
    )


def test_overlapped_buckets_launch_during_backward_and_average():
    results = run_distributed(_overlap_launches_during_backward, 2, timeout=300)
    for buckets, launched, _, _synced in results:
        assert buckets == 4 and launched == 4, "every bucket started inside backward"
    mean = {k: (results[0][2][k] + results[1][2][k]) / 2 for k in results[0][2]}
    for _, _, _, synced in results:
        for k in mean:
            torch.testing.assert_close(synced[k], mean[k], **TOL)


def _accumulate_twice_in_overlap(ctx):
    model = MLP()
    dp = OverlappedDataParallel(model, ctx)
    x = torch.randn(4, 8)
    with dp.overlap():
        model(x).sum().backward()
        model(x).sum().backward()


def test_second_backward_inside_overlap_is_an_error():
    with pytest.raises(RuntimeError, match="accumulated again after its data-parallel all-reduce"):
        run_distributed(_accumulate_twice_in_overlap, 2, timeout=300)


def _sequence_handler(ctx, use_handler):
    torch.manual_seed(0)
    model = MLP()
    for p in model.parameters():
        p.grad = torch.full_like(p, float(ctx.global_rank))
    if use_handler:
        SequenceParallelGradientHandler(model, ctx).handle_gradient()
    else:
        OverlappedDataParallel(model, ctx).finish()  # default path, group from get_dp_mode
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("use_handler", [True, False])
def test_sequence_mode_averages_over_sequence_dp(use_handler):
    # world 4 = data 2 x sequence 2: SEQUENCE_DP spans all four ranks
    config = dict(parallel=dict(tensor=dict(size=2, mode="sequence")))
    results = run_distributed(_sequence_handler, 4, use_handler, config=config, timeout=300)
    for grads in results:
        for g in grads:
            assert torch.all(g == 1.5), "mean of ranks 0..3"  # exact: small integers / 4


def _sequence_handler_outside_sequence(ctx):
    SequenceParallelGradientHandler(MLP(), ctx)


def test_sequence_handler_needs_sequence_mode():
    with pytest.raises(RuntimeError, match="needs parallel.tensor.mode 'sequence'"):
        run_distributed(_sequence_handler_outside_sequence, 1, timeout=300)


def _no_sync_before_last_micro_step(ctx):
    torch.manual_seed(0)
    model = MLP()
    engine, *_ = gt.initialize(model, momentum_sgd(model), criterion=F.mse_loss)
    sent = []
    engine.zero_grad()
    for x, y in batches(4, Normal((4, MLP.D_IN)), Normal((4, MLP.D_OUT)), seed=ctx.global_rank):
        with comm.count_bytes() as counter:
            engine.backward(engine.criterion(engine(x), y))
        sent.append(counter["all_reduce"])
        engine.step()
    return sent


def test_accumulation_syncs_only_in_last_backward():
    results = run_distributed(
        _no_sync_before_last_micro_step, 2, config=dict(gradient_accumulation=4), timeout=300
    )
    for sent in results:
        assert sent[:3] == [0, 0, 0] and sent[3] > 0, sent


def _expert_grads(ctx):
    # world 4 = data 4, expert_parallel_size 2: EXPERT_DATA groups are {0, 2} and {1, 3}
    torch.manual_seed(0)
    model = MLP()
    set_dp_mode(model.fc2.weight, PM.EXPERT_DATA)  # stands in for an expert
    for p in model.parameters():
        p.grad = torch.full_like(p, float(ctx.global_rank))
    OverlappedDataParallel(model, ctx).finish()
    return model.fc2.weight.grad.unique().tolist(), model.fc1.weight.grad.unique().tolist()


def test_expert_parameters_average_over_expert_data():
    results = run_distributed(
        _expert_grads, 4, config=dict(moe=dict(expert_parallel_size=2)), timeout=300
    )
    for rank, (expert, dense) in enumerate(results):
        assert expert == [(rank % 2 + rank % 2 + 2) / 2], "mean over {r, r+2}"  # exact halves
        assert dense == [1.5], "mean of ranks 0..3 over DATA"


def _bad_inputs(ctx, tmp):
    model = MLP()
    messages = []
    for call in (
        lambda: gt.initialize(model, "sgd"),
        lambda: gt.initialize("model", momentum_sgd(model)),
    ):
        with pytest.raises(TypeError) as err:
            call()
        messages.append(str(err.value))
    engine, *_ = gt.initialize(model, momentum_sgd(model), criterion=F.mse_loss)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 8)))
    checks = [
        (TypeError, lambda: engine.execute_schedule(loader)),
        (TypeError, lambda: engine.execute_schedule(iter([(1, 2, 3)]))),
        (ValueError, lambda: engine.execute_schedule(iter([]), return_loss=False)),
        (FileNotFoundError, lambda: gt.load_checkpoint(f"{tmp}/none.pt", model)),
        (TypeError, lambda: gt.save_checkpoint(None, 0, model)),
        (ValueError, lambda: handler_class("NoSuchHandler")),
    ]
    for kind, call in checks:
        with pytest.raises(kind) as err:
            call()
        messages.append(str(err.value))
    return messages


def test_bad_inputs_fail_early_with_names(tmp_path):
    (messages,) = run_distributed(_bad_inputs, 1, str(tmp_path), timeout=300)
    expected = [
        "optimizer must be a torch.optim.Optimizer, got str",
        "model must be a torch.nn.Module, got str",
        "needs an iterator such as iter(train_dataloader), got DataLoader",
        "a batch must be a (data, label) pair, a tensor or a dict, got tuple of length 3",
        "return_loss must be True when forward_only is False",
        "no checkpoint at",
        "path must be a str or os.PathLike, got None",
        "unknown gradient handler 'NoSuchHandler'",
    ]
    for message, want in zip(messages, expected, strict=True):
        assert want in message, (want, message)
