"""2.5D tensor parallelism (Tesseract) equals the dense model, with depth 1 (4 ranks) and 2 (8).

Depth 2 is the case the legacy engine got wrong: each depth slice trains on its own half
of the batch, so weight gradients must be summed over the depth group to equal dense.
"""

import pytest
import summa_parity as sp
import torch
from harness import run_distributed

from gridtrain.parallel.tensor import dense

LAYOUTS = [(4, str(sp.CONFIGS / "tp_2p5d_depth1.py")), (8, str(sp.CONFIGS / "tp_2p5d_depth2.py"))]
IDS = ["depth1", "depth2"]
# float32 parity (errors relative to max(1, |reference|)): SUMMA and the depth all-reduce sum
# the same products in another order, so results differ by a few ulps: 2e-6 is ~16 ulps.
TOL = 2e-6


@pytest.mark.parametrize("world,cfg", LAYOUTS, ids=IDS)
def test_every_layer_matches_dense_twin(world, cfg):
    results = run_distributed(sp.layer_parity, world, config=cfg, timeout=300)
    for rank, per_layer in enumerate(results):
        assert set(per_layer) == {c[0] for c in sp._cases()}
        for layer, errs in per_layer.items():
            for what, err in errs.items():
                assert err < TOL, f"rank {rank} {layer} {what}: max error {err:.2e}"


@pytest.mark.parametrize("world,cfg", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("vocab_parallel", [False, True], ids=["gathered", "vocab-parallel"])
def test_tiny_lm_trains_like_dense(world, cfg, vocab_parallel):
    for rank, r in enumerate(run_distributed(sp.train_parity, world, vocab_parallel, config=cfg)):
        assert r["init_err"] == 0.0, rank  # same seed, same draws: the dense init, bit for bit
        for step, (loss, loss_ref) in enumerate(r["losses"]):
            # every rank of the tensor group (all depths) reports the dense batch loss
            assert abs(loss - loss_ref) < 1e-5, (rank, step, loss, loss_ref)
        for ours, ref in r["accs"]:
            assert ours == ref, (rank, ours, ref)  # counts are exact
        # three AdamW steps at lr 1e-2: ulp-level gradient differences move weights far less
        # than 1e-5 (1/1000 of a step); a missing depth reduction halves gradients -> O(lr).
        assert r["weight_err"] < 1e-5, (rank, r["weight_err"])


def test_depth2_shards_are_one_over_q_squared():
    fractions = run_distributed(sp.shard_fractions, 8, config=LAYOUTS[1][1])[0]
    for name, (fraction, sharded) in fractions.items():
        if name == "Classifier.bias":  # num_classes values, replicated on purpose
            assert not sharded and fraction == 1.0
        else:  # T = depth x q^2 = 8; weights are replicated over depth: 1/q^2 = 2/T each
            assert sharded and fraction == 0.25, (name, fraction)


def test_checkpoint_2d_to_dense_to_2p5d(tmp_path):
    path = str(tmp_path / "full.pt")
    losses_2d = run_distributed(sp.train_and_save, 4, path, config=str(sp.CONFIGS / "tp_2d.py"))
    state = torch.load(path)
    model = sp.TinyLM(dense, vocab_parallel=True)
    model.load_state_dict(state)  # strict: the 2d checkpoint has exactly the dense keys/shapes
    loss_dense = sp.probe_loss(model)
    results = run_distributed(sp.load_and_probe, 8, path, config=LAYOUTS[1][1])
    # float32 forward of the same weights in three layouts: a few ulps of a loss ~3
    for loss in losses_2d:
        assert abs(loss - loss_dense) < 1e-5, (loss, loss_dense)
    for loss, round_trip in results:
        assert abs(loss - loss_dense) < 1e-5, (loss, loss_dense)
        assert round_trip == 0.0  # loading then gathering gives back the exact tensors


def test_lazy_init_then_reset_gives_the_dense_init():
    errs = run_distributed(sp.lazy_init_matches_dense, 8, config=LAYOUTS[1][1])
    assert max(errs) == 0.0  # reset_parameters redraws each dense twin: bit-equal shards


def test_engine_splits_and_trains_like_dense_at_depth2():
    for losses, weight_err in run_distributed(sp.engine_parity, 8, config=LAYOUTS[1][1]):
        for loss, loss_ref in losses:
            assert abs(loss - loss_ref) < 1e-5, (loss, loss_ref)  # fp32, a few ulps of ~7
        assert weight_err < 1e-5, weight_err  # as in test_tiny_lm_trains_like_dense
