"""Stage-to-stage p2p on gloo: shapes and dtypes travel with the data; gradients come back."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout, pick

import gridtrain as gt
from gridtrain.parallel.pipeline.p2p import PipelineP2P, input_grads


def _exchange(ctx):
    p2p = PipelineP2P(ctx)
    stage = ctx.local_rank(gt.ParallelMode.PIPELINE)
    got = {}
    if stage == 0:
        x = torch.arange(10.0).reshape(2, 5).requires_grad_()
        y = x * 2
        p2p.communicate(send_next=y)
        (g,) = p2p.communicate(recv_next_like=y)[1]
        y.backward(g)
        got["grad_x"] = x.grad
        # the ring wraps: the last stage sends to the first (interleaved schedules need this)
        got["wrapped"] = p2p.communicate(recv_prev=True)[0]
    elif stage == 1:
        x = p2p.communicate(recv_prev=True)[0]
        got["recv"] = (x.shape, x.dtype, x.detach().clone(), x.requires_grad)
        h = (x.sum(1).to(torch.float16) * 3, torch.tensor([[1, 2], [3, 4]]))  # a tuple
        p2p.communicate(send_next=h)
        grads = p2p.communicate(recv_next_like=h)[1]
        got["grad_dtypes"] = [None if g is None else g.dtype for g in grads]
        h[0].backward(grads[0])
        p2p.communicate(send_prev=input_grads(x))
    else:
        h = p2p.communicate(recv_prev=True)[0]
        got["recv"] = [(t.shape, t.dtype, t.detach().clone()) for t in h]
        (h[0].float() * torch.tensor([1.0, 10.0])).sum().backward()
        p2p.communicate(send_prev=input_grads(h))
        p2p.communicate(send_next=torch.full((4, 1, 2), 7.0, dtype=torch.bfloat16))
    return got


def test_shape_and_dtype_exchange_and_gradients():
    s0, s1, s2 = run_distributed(_exchange, 3, config=dict(parallel=dict(pipeline=3)), timeout=300)
    shape, dtype, value, needs_grad = s1["recv"]
    assert (shape, dtype, needs_grad) == (torch.Size([2, 5]), torch.float32, True)
    assert torch.equal(value, torch.arange(10.0).reshape(2, 5) * 2)
    (s_a, d_a, v_a), (s_b, d_b, v_b) = s2["recv"]
    assert (s_a, d_a) == (torch.Size([2]), torch.float16) and (s_b, d_b) == (
        torch.Size([2, 2]),
        torch.int64,
    )
    assert torch.equal(v_a, torch.tensor([60.0, 210.0], dtype=torch.float16))
    assert torch.equal(v_b, torch.tensor([[1, 2], [3, 4]]))
    assert s1["grad_dtypes"] == [torch.float16, None], "integer tensors carry no gradient"
    # d/dx of sum(3 * 2 * rowsum(x) * [1, 10]) = 6 on row 0, 60 on row 1 (exact in fp16)
    expected = torch.tensor([[6.0] * 5, [60.0] * 5])
    assert torch.equal(s0["grad_x"], expected)
    assert s0["wrapped"].dtype == torch.bfloat16 and s0["wrapped"].shape == (4, 1, 2)


def _fixed_shape(ctx):
    p2p = PipelineP2P(ctx, tensor_shape=(2, 3), dtype=torch.float32)
    if ctx.global_rank == 0:
        y = torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True)
        p2p.communicate(send_next=y * 5)
        (g,) = p2p.communicate(recv_next_like=y)[1]
        return g.dtype, g
    x = p2p.communicate(recv_prev=True)[0]
    p2p.communicate(send_prev=(torch.full((2, 3), 0.5),))
    return x.dtype, x.detach()


def test_fixed_tensor_shape_skips_the_header_and_casts():
    (g_dtype, g), (x_dtype, x) = run_distributed(
        _fixed_shape,
        2,
        config=dict(parallel=dict(pipeline=dict(size=2, tensor_shape=(2, 3)))),
        timeout=300,
    )
    assert x_dtype == torch.float32 and torch.equal(x, torch.full((2, 3), 5.0))
    assert g_dtype == torch.bfloat16, "the gradient comes back in the activation's dtype"
    assert torch.equal(g, torch.full((2, 3), 0.5, dtype=torch.bfloat16))


# ---- stage outputs that are views: transposed and expanded -----------------------------------
H, S, V = 8, 4, 16


class _Layer(torch.nn.Module):
    """A Linear whose output leaves as a non-contiguous view: transposed ``[B, H, S]`` or
    expanded (stride 0) from one feature, so every stage boundary sends a view."""

    def __init__(self, index: int):
        super().__init__()
        self.lin = torch.nn.Linear(H, H)
        self.index = index

    def forward(self, x):
        if self.index % 2 == 1:  # the previous layer sent [B, H, S]
            x = x.transpose(1, 2)
        y = self.lin(x)
        return y.transpose(1, 2) if self.index % 2 == 0 else y


class _Expand(torch.nn.Module):
    def forward(self, x):
        return x[..., :1].expand(-1, -1, H)  # stride 0 on the last dim: not contiguous


def _views_model():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, H)
    layers = [emb]
    for i in range(4):
        layers.append(_Layer(i))
        if i % 2 == 1:
            layers.append(_Expand())
    layers.append(torch.nn.Linear(H, V))
    return torch.nn.Sequential(*layers)


def _views_loss(logits, y):
    return gt.nn.CrossEntropyLoss()(logits.reshape(-1, V), y.reshape(-1))


def _dense_losses(batches) -> list[float]:
    """The views model trained in one process with SGD: the loss of each step."""
    model, losses = _views_model(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        loss = _views_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _views_train(ctx, batches):
    model = _views_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = ctx.world_size(gt.ParallelMode.DATA)
    example = batches[0][0].chunk(dp)[0]
    engine, *_ = gt.initialize(model, opt, _views_loss, example_inputs=example)
    losses = []
    for x, y in batches:
        x, y = (t.chunk(dp)[ctx.local_rank(gt.ParallelMode.DATA)] for t in (x, y))
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(iter([(x, y)]), return_output_label=False)
        engine.step()
        losses.append(loss.item())
    return losses


VIEW_LAYOUTS = {
    **pick("pp2", "dp2-pp2"),
    "tp2-pp2": layout("1d2-pp2"),
    "interleaved": layout("pp2-interleaved"),
    "seq2-pp2": layout("sequence2-pp2"),
}


@pytest.mark.parametrize("name", list(VIEW_LAYOUTS))
def test_stage_outputs_may_be_transposed_or_expanded_views(name):
    world, config = VIEW_LAYOUTS[name]
    config = dict(config, num_microbatches=2)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, V, (8, S), generator=g), torch.randint(0, V, (8, S), generator=g))
        for _ in range(2)
    ]
    dense = _dense_losses(batches)
    results = run_distributed(_views_train, world, batches, config=config, timeout=300)
    replica = world // (2 if name.startswith("dp2") else 1)
    losses = torch.tensor([r for r in results[::replica]]).mean(0)
    # float32; micro-batching and the splits only reorder sums
    torch.testing.assert_close(losses, torch.tensor(dense), rtol=1e-5, atol=1e-5)


def _recv_buffers_of_a_transposed_output(ctx):
    """Every irecv buffer handed to batch_isend_irecv is contiguous (NCCL refuses others)."""
    import torch.distributed as dist

    seen = []
    real = dist.P2POp

    def recording(op, tensor, *args, **kwargs):
        if op is dist.irecv:
            seen.append(tensor.is_contiguous())
        return real(op, tensor, *args, **kwargs)

    dist.P2POp = recording
    try:
        p2p = PipelineP2P(ctx)
        if ctx.global_rank == 0:
            x = torch.randn(4, 6, requires_grad=True)
            y = (x * 2).t()  # a transposed stage output
            p2p.communicate(send_next=y)
            (g,) = p2p.communicate(recv_next_like=y)[1]
            y.backward(g)
        else:
            x = p2p.communicate(recv_prev=True)[0]
            (x * 3).sum().backward()
            p2p.communicate(send_prev=input_grads(x))
    finally:
        dist.P2POp = real
    return seen


def test_receive_buffers_are_contiguous_for_view_outputs():
    for rank, seen in enumerate(
        run_distributed(
            _recv_buffers_of_a_transposed_output, 2, config=dict(parallel=dict(pipeline=2))
        )
    ):
        assert seen and all(seen), (rank, seen)


# ---- keyed streams: one shape header per step ------------------------------------------------
def _keyed(ctx):
    p2p = PipelineP2P(ctx)
    got = []
    for step, rows in enumerate((3, 5)):  # a new step may bring new shapes (a smaller batch)
        p2p.new_step()
        rounds = p2p.rounds
        if ctx.global_rank == 0:
            for i in range(3):
                p2p.communicate(
                    send_next=(torch.full((rows, 2), float(i)), torch.ones(rows)), send_key=1
                )
            if step == 1:
                with pytest.raises(ValueError, match="changed within one step"):
                    p2p.communicate(
                        send_next=(torch.zeros(rows + 1, 2), torch.ones(rows)), send_key=1
                    )
        else:
            for _ in range(3):
                x, mask = p2p.communicate(recv_prev=True, recv_key=1)[0]
                got.append((tuple(x.shape), x[0, 0].item(), tuple(mask.shape)))
        got.append(p2p.rounds - rounds)
    return got


def test_keyed_stream_sends_its_shapes_once_per_step():
    sender, receiver = run_distributed(_keyed, 2, config=dict(parallel=dict(pipeline=2)))
    # the header rides in the sender's data batch; the receiver waits one round for it
    assert sender == [3, 3]
    assert receiver == [
        ((3, 2), 0.0, (3,)),
        ((3, 2), 1.0, (3,)),
        ((3, 2), 2.0, (3,)),
        4,
        ((5, 2), 0.0, (5,)),
        ((5, 2), 1.0, (5,)),
        ((5, 2), 2.0, (5,)),
        4,
    ]


def _train_rounds(ctx, batches):
    """Losses of ``_views_train`` and the p2p rounds of each step."""
    rounds, real = [], PipelineP2P.new_step

    def counting(self):
        rounds.append(self.rounds)
        real(self)

    PipelineP2P.new_step = counting
    try:
        losses = _views_train(ctx, batches)
    finally:
        PipelineP2P.new_step = real
    return losses, [b - a for a, b in zip(rounds, rounds[1:], strict=False)]


@pytest.mark.parametrize("name", ["pp2", "interleaved"])
def test_batch_size_may_change_between_steps(name):
    """The last batch of an epoch may be smaller: each step sends its shapes once."""
    world, config = VIEW_LAYOUTS[name]
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randint(0, V, (n, S), generator=g), torch.randint(0, V, (n, S), generator=g))
        for n in (8, 4, 8, 6)
    ]
    dense = _dense_losses(batches)
    results = run_distributed(
        _train_rounds, world, batches, config=dict(config, num_microbatches=2), timeout=300
    )
    for losses, rounds in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(dense), rtol=1e-5, atol=1e-5)
        assert len(set(rounds)) == 1, rounds  # no step pays for the shapes more than once
    if name == "pp2":  # m = 2: stage 0 three exchanges; stage 1 four and one header round
        assert [r[1][0] for r in results] == [3, 4]


# ---- one stage: the chunks of an interleaved schedule hand activations to themselves ---------
def _one_stage(ctx, x, y):
    from gridtrain.engine.schedules import InterleavedPipelineSchedule
    from gridtrain.parallel.pipeline.partition import build_stage

    stage, _ = build_stage(_views_model(), 0, 1, 2)
    engine, *_ = gt.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1), _views_loss)
    engine.schedule = InterleavedPipelineSchedule(ctx, 4, 2)
    _, _, loss = engine.execute_schedule(iter([(x, y)]), return_output_label=False)
    return loss.item(), {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_one_stage_interleaved_equals_dense():
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, V, (8, S), generator=g) for _ in range(2))
    model = _views_model()
    loss = _views_loss(model(x), y)
    loss.backward()
    ((got, grads),) = run_distributed(_one_stage, 1, x, y, config=dict(num_microbatches=4))
    assert got == pytest.approx(loss.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
