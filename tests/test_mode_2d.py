"""2D tensor parallelism (Optimus / SUMMA, 2 x 2 grid on 4 gloo ranks) equals the dense model."""

import pytest
import summa_parity as sp
import torch
from harness import run_distributed

import gridtrain.nn as gnn

CFG = str(sp.CONFIGS / "tp_2d.py")
# float32 parity (errors relative to max(1, |reference|)): the SUMMA sums the same products
# in another order and LayerNorm's statistics are all-reduced, so results differ by a few
# ulps of the largest term: 2e-6 is ~16 ulps.
TOL = 2e-6


def test_every_layer_matches_dense_twin():
    results = run_distributed(sp.layer_parity, 4, config=CFG, timeout=300)
    for rank, per_layer in enumerate(results):
        assert set(per_layer) == {c[0] for c in sp._cases()}
        for layer, errs in per_layer.items():
            for what, err in errs.items():
                assert err < TOL, f"rank {rank} {layer} {what}: max error {err:.2e}"


def test_shards_are_one_over_T_and_bad_arguments_fail_early():
    fractions, messages = run_distributed(_fractions_and_errors, 4, config=CFG, timeout=300)[0]
    for name, (fraction, sharded) in fractions.items():
        if name == "Classifier.bias":  # num_classes values, replicated on purpose
            assert not sharded and fraction == 1.0
        else:  # T = q^2 = 4 ranks, each holds exactly a quarter
            assert sharded and fraction == 0.25, (name, fraction)
    assert "in_features=5 must be divisible by 2" in messages["linear_in"]
    assert "out_features=6 must be divisible by 4" in messages["linear_bias"]
    assert "embedding_dim=6 must be divisible by 4" in messages["embedding_dim"]
    assert "batch size 5 must be divisible by 2" in messages["split_batch"]
    assert "expected this rank's hidden block of 4" in messages["width"]
    assert "Classifier: a tied weight must be split" in messages["tied"]


def _fractions_and_errors(ctx):
    return sp.shard_fractions(ctx), sp.bad_inputs(ctx)


def _dropout_masks(ctx):
    drop = gnn.Dropout(0.5)
    x = torch.ones(64)
    masks = [drop(x), drop(x)]
    drop.eval()
    return masks, torch.equal(drop(x), x)


def test_dropout_draws_a_distinct_mask_per_block():
    results = run_distributed(_dropout_masks, 4, config=CFG, timeout=300)
    firsts = [masks[0] for masks, _ in results]
    # each rank holds a different activation block: no two ranks may share a mask
    assert all(not torch.equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])
    assert all(not torch.equal(m[0], m[1]) for m, _ in results)  # the stream advances
    assert all(m[0].max() == 2.0 for m, _ in results)  # kept values scaled by 1 / (1 - p)
    assert all(identity for _, identity in results)  # eval: no dropout


@pytest.mark.parametrize("vocab_parallel", [False, True], ids=["gathered", "vocab-parallel"])
def test_tiny_lm_trains_like_dense(vocab_parallel):
    results = run_distributed(sp.train_parity, 4, vocab_parallel, config=CFG, timeout=300)
    _check_training(results)


def test_data_parallel_2_by_2d():
    cfg = str(sp.CONFIGS / "dp2_tp_2d.py")
    results = run_distributed(sp.train_parity, 8, True, 3, True, config=cfg, timeout=300)
    _check_training(results)


def _check_training(results):
    for rank, r in enumerate(results):
        # same seed, same draws: the sharded init is the dense init, bit for bit
        assert r["init_err"] == 0.0, rank
        for step, (loss, loss_ref) in enumerate(r["losses"]):
            # every rank of the group reports the dense loss of the data-parallel batch
            assert abs(loss - loss_ref) < 1e-5, (rank, step, loss, loss_ref)
        for ours, ref in r["accs"]:
            assert ours == ref, (rank, ours, ref)  # counts are exact
        # three AdamW steps (lr 1e-2): update ~lr * m / sqrt(v) amplifies ulp-level gradient
        # differences little while gradients are not ~0; 1e-5 is 1/1000 of one step.
        assert r["weight_err"] < 1e-5, (rank, r["weight_err"])
