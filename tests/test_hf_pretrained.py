"""Pretrained weights in and out of any layout: ``gridtrain.hf.save_pretrained`` writes a directory
``transformers`` loads, ``load_pretrained`` reads only each rank's slices (also under
``gt.lazy_init()``), 2d -> HF dir -> 3d is bit-identical, and a directory that does not fit
is refused on every rank, naming the first mismatching key and both shapes, with nothing
loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.runs import data_rows
from safetensors import safe_open
from test_hf_parity import adamw, hf_batches, lm_loss, tiny_config, tiny_model

import gridtrain as gt
import gridtrain.hf as gthf
from gridtrain.hf.weights import index_runs

PM = gt.ParallelMode
LAYOUT_2D = dict(parallel=dict(tensor=dict(size=4, mode="2d")))
LAYOUT_3D = dict(parallel=dict(tensor=dict(size=8, mode="3d")))
LAYOUT_1D_PP = dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode="1d")), num_microbatches=2)


def _engine(ctx, model):
    engine, *_ = gt.initialize(model, adamw(model), lm_loss)
    return engine


def _train_and_save(ctx, name: str, directory: str, max_shard_size="5GB"):
    """A few steps under the context's layout (so the weights are not the init), then save."""
    engine = _engine(ctx, tiny_model(name))
    pipeline = ctx.world_size(PM.PIPELINE) > 1
    for x, m, y in hf_batches(steps=2):
        x, m, y = data_rows((x, m, y), ctx)
        engine.zero_grad()
        if pipeline:
            batch = dict(input_ids=x, attention_mask=m, labels=y)
            engine.execute_schedule(iter([batch]), return_output_label=False)
        else:
            engine.backward(engine.criterion(engine(input_ids=x, attention_mask=m), y))
        engine.step()
    files = gthf.save_pretrained(engine.model, directory, max_shard_size=max_shard_size)
    held = {n: p.numel() for n, p in engine.model.named_parameters()}
    return gt.full_state_dict(engine.model), files, held


def _lazy_load(ctx, name: str, directory: str):
    """Build on meta, shard, then read this rank's slices: the loaded full state and a loss."""
    import transformers as tf

    with gt.lazy_init():
        model = tf.AutoModelForCausalLM.from_config(tiny_config(name), attn_implementation="sdpa")
    model = model.to(torch.float64)
    engine = _engine(ctx, model)
    gthf.load_pretrained(engine.model, directory)
    x, m, y = hf_batches(steps=1)[0]
    with torch.no_grad():
        loss = engine.criterion(engine(input_ids=x, attention_mask=m), y).item()
    return gt.full_state_dict(engine.model), loss


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_2d_to_hf_dir_to_3d_is_bit_identical(name, tmp_path):
    saved, files, _ = run_distributed(
        _train_and_save, 4, name, str(tmp_path), "30KB", config=LAYOUT_2D, timeout=600
    )[0]
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    results = run_distributed(_lazy_load, 8, name, str(tmp_path), config=LAYOUT_3D, timeout=600)
    for rank, (loaded, _) in enumerate(results):
        assert loaded.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), f"rank {rank} {k}: not bit-identical"
    # transformers' own loader sees the dense weights (GPT-2: lm_head tied back to wte)
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert hf.dtype == torch.float64
    hf_state = hf.state_dict()
    assert hf_state.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(hf_state[k], v), k
    # ...and computes the loss the 3d engine computed from the same directory
    x, m, y = hf_batches(steps=1)[0]
    with torch.no_grad():
        logits = hf(input_ids=x, attention_mask=m).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    # (Llama: HF's RMSNorm rounds to float32 inside, the 3d grid's norm does not; test_hf_parity)
    assert results[0][1] == pytest.approx(want.item(), rel=1e-12 if name == "gpt2" else 1e-7)


def test_pipeline_save_writes_the_tied_weight_once_and_loads_in_transformers(tmp_path):
    """dp x 1d x pp: files per stage, written by each stage's ranks; the tie crosses stages."""
    saved, files, held = run_distributed(
        _train_and_save, 8, "gpt2", str(tmp_path), "40KB", config=LAYOUT_1D_PP, timeout=600
    )[0]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"], "tied: saved under wte only, as HF does"
    assert set(index["weight_map"]) == set(saved) - {"lm_head.weight"}
    assert set(files) == set(index["weight_map"].values())
    for name in files:  # a valid safetensors file, each tensor whole
        with safe_open(str(tmp_path / name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                assert tuple(f.get_slice(key).get_shape()) == tuple(saved[key].shape)
    import transformers as tf

    hf = tf.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert hf.lm_head.weight is hf.transformer.wte.weight
    for k, v in hf.state_dict().items():
        assert torch.equal(v, saved[k]), k


def _load_hf_saved(ctx, directory: str):
    model = tiny_model("llama")
    torch.nn.init.zeros_(model.lm_head.weight)  # not the saved values: the load must set them
    engine = _engine(ctx, model)
    gthf.load_pretrained(engine.model, directory)
    return gt.full_state_dict(engine.model)


def test_transformers_save_pretrained_loads_into_dp_1d_pp(tmp_path):
    """A directory written by transformers itself (several files) into dp2 x 1d2 x pp2."""
    hf = tiny_model("llama")
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p))
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = run_distributed(_load_hf_saved, 8, str(tmp_path), config=LAYOUT_1D_PP, timeout=600)
    for state in loaded:
        for k, v in hf.state_dict().items():
            assert torch.equal(state[k], v), k


def _load_expect_error(ctx, directory: str, hidden: int):
    model = tiny_model("gpt2", n_embd=hidden)
    engine = _engine(ctx, model)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        gthf.load_pretrained(engine.model, directory)
    except gthf.PretrainedMismatchError as err:
        after = engine.model.state_dict()
        untouched = all(torch.equal(after[k], v) for k, v in before.items())
        return str(err), untouched
    return None, None


def test_mismatching_directory_names_the_first_key_and_both_shapes(tmp_path):
    tiny_model("gpt2", n_embd=32).save_pretrained(tmp_path)  # hidden 32, the model has 64
    results = run_distributed(
        _load_expect_error, 4, str(tmp_path), 64, config=LAYOUT_2D, timeout=600
    )
    for message, untouched in results:
        assert message is not None, "every rank raises"
        assert "'transformer.wte.weight'" in message, message  # the first key in order
        assert "(128, 32)" in message and "(128, 64)" in message, message
        assert untouched, "nothing half-loaded"
    (tmp_path / "model.safetensors").unlink()
    results = run_distributed(_load_expect_error, 2, str(tmp_path), 64, config=dict(), timeout=600)
    assert "neither model.safetensors.index.json nor model.safetensors" in results[0][0]


def test_missing_key_is_named(tmp_path):
    hf = tiny_model("gpt2")
    state = {
        k: v for k, v in hf.state_dict().items() if "h.1.mlp" not in k and k != "lm_head.weight"
    }
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(tmp_path)
    message, untouched = run_distributed(
        _load_expect_error, 2, str(tmp_path), 64, config=dict(), timeout=600
    )[0]
    assert "'transformer.h.1.mlp.c_fc.weight' is missing" in message and untouched, message


def test_packed_slices_are_runs_per_block():
    """A rank of a packed split (fused q/k/v) reads one run per block; nested splits one run."""
    assert index_runs(12, [(2, 1, 3)]) == [(2, 4), (6, 8), (10, 12)]
    assert index_runs(16, [(2, 1, 1), (2, 0, 1)]) == [(8, 12)]
    assert index_runs(5, []) == [(0, 5)]


def test_single_process_round_trip_without_a_context(tmp_path):
    """No gt.launch at all: a plain HF model in, the same model out."""
    src = tiny_model("llama")
    gthf.save_pretrained(src, tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    dst = tiny_model("llama")
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    gthf.load_pretrained(dst, tmp_path)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    cfg = json.loads(Path(tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float64"


def test_sequence_layout_saves_a_plain_config(tmp_path):
    """Ring attention is a runtime choice: the saved config loads without gridtrain."""
    config = dict(parallel=dict(tensor=dict(size=2, mode="sequence")))
    saved = run_distributed(_train_and_save, 2, "llama", str(tmp_path), config=config, timeout=600)[
        0
    ][0]
    text = (tmp_path / "config.json").read_text()
    assert "gridtrain" not in text, text
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf.config._attn_implementation in ("sdpa", "eager")
    for k, v in hf.state_dict().items():
        assert torch.equal(v, saved[k]), k
