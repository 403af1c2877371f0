"""Stage-to-stage p2p on gloo: shapes and dtypes travel with the data; gradients come back."""

from __future__ import annotations

import torch
from helpers.harness import run_distributed

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
