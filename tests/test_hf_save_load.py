"""``gridtrain.hf.save_pretrained`` / ``load_pretrained`` in the layouts that hold weights their
own way: ZeRO 1-3, Gemini, naive fp16 (fp32 masters), bf16, and tensor, sequence and pipeline
cuts around them.

Each model runs a chain of layouts, one distributed call each: load the directory the layout
before it saved (the first loads one ``transformers`` wrote), take one AdamW step at lr 0,
save. At lr 0 the step changes nothing, so the weights must stay the loaded ones: a load that
left the optimizer's masters stale is undone by that step. Every directory is read back by
``transformers``' own ``from_pretrained`` and must equal ``gt.full_state_dict`` of the layout
that wrote it, key for key and bit for bit, in the plain model's dtype.
"""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.runs import local_numel
from safetensors import safe_open
from test_hf_parity import hf_batches, lm_loss, tiny_model

import gridtrain as gt
import gridtrain.hf as gthf

PM = gt.ParallelMode
FP16 = dict(mode="naive", initial_scale=2.0**4)  # small: the lr-0 step must not be skipped
ZERO1, ZERO2, ZERO3 = (dict(zero=dict(stage=s)) for s in (1, 2, 3))
GEMINI = dict(zero=dict(stage=3, offload=True))


def _tensor(size: int, mode: str) -> dict:
    return dict(parallel=dict(tensor=dict(size=size, mode=mode)))


# (name, config, world size, the most of the dense parameters one rank may hold: the
# parameters themselves, or under ZeRO 1-2 the optimizer's rows)
CHAINS = {
    "llama": [
        ("zero3", ZERO3, 2, 0.55),
        ("zero1 naive fp16", {**ZERO1, "fp16": FP16}, 2, 0.55),
        ("1d2 bf16", {**_tensor(2, "1d"), "fp16": dict(mode="bf16")}, 2, 0.55),
        ("sequence2 zero2", {**_tensor(2, "sequence"), **ZERO2}, 2, 0.55),
    ],
    "gpt2": [
        ("gemini", GEMINI, 2, 0.55),
        ("1d2 naive fp16", {**_tensor(2, "1d"), "fp16": FP16}, 2, 0.6),
        ("pp2 x dp2 zero1", dict(parallel=dict(pipeline=2), num_microbatches=2, **ZERO1), 4, 0.6),
        ("1d2 x dp2 zero3 naive fp16", {**_tensor(2, "1d"), **ZERO3, "fp16": FP16}, 4, 0.3),
    ],
}


def _held(engine, dense_numel: int) -> float:
    """This rank's share of the dense parameters: of the parameters it holds, or of the rows
    its optimizer steps where those are fewer (ZeRO 1-2)."""
    params = sum(local_numel(p) for p in engine.model.parameters())
    stepped = sum(local_numel(p) for g in engine.optimizer.param_groups for p in g["params"])
    return min(params, stepped) / dense_numel


def _load_step_save(ctx, name: str, src: str, dst: str, dense_numel: int):
    model = tiny_model(name, dtype=torch.float32)  # seed 0: not the weights in ``src``
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    engine, *_ = gt.initialize(model, opt, lm_loss)
    gthf.load_pretrained(engine.model, src)
    loaded = gt.full_state_dict(engine.model)
    x, m, y = (t.chunk(ctx.world_size(PM.DATA))[ctx.local_rank(PM.DATA)] for t in hf_batches(1)[0])
    engine.zero_grad()
    if ctx.world_size(PM.PIPELINE) > 1:
        batch = dict(input_ids=x, attention_mask=m, labels=y)
        engine.execute_schedule(iter([batch]), return_output_label=False)
    else:
        engine.backward(engine.criterion(engine(input_ids=x, attention_mask=m), y))
    engine.step()
    assert not engine.last_step_skipped
    after = gt.full_state_dict(engine.model)
    gthf.save_pretrained(engine.model, dst, max_shard_size="40KB")
    return loaded, after, _held(engine, dense_numel)


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: keys {sorted(set(got) ^ set(want))[:5]}"
    for key, value in want.items():
        assert type(got[key]) is torch.Tensor, f"{what} {key}: {type(got[key]).__name__}"
        assert got[key].dtype == value.dtype, f"{what} {key}: {got[key].dtype} != {value.dtype}"
        # exact: loads, gathers and file writes copy; an lr-0 AdamW step moves nothing
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{what} {key}")


def _transformers_state(directory) -> dict:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    return hf.state_dict()


@pytest.mark.parametrize("name", list(CHAINS))
def test_save_in_one_layout_load_in_the_next(name, tmp_path):
    source = tiny_model(name, dtype=torch.float32)
    with torch.no_grad():
        for p in source.parameters():  # values fp16 cannot hold: masters must be what is saved
            p.add_(torch.randn_like(p) / 3)
    source.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    want = source.state_dict()
    dense_numel = sum(p.numel() for p in source.parameters())
    src = tmp_path / "hf"
    for layout, config, world, most in CHAINS[name]:
        dst = tmp_path / layout.replace(" ", "_")
        results = run_distributed(
            _load_step_save, world, name, str(src), str(dst), dense_numel, config=config
        )
        for rank, (loaded, after, held) in enumerate(results):
            _assert_equal(loaded, want, f"{layout} rank {rank} loaded from {src.name}")
            _assert_equal(after, want, f"{layout} rank {rank} after an lr-0 step")
            assert held <= most, f"{layout} rank {rank} holds {held:.2f} of the parameters"
        files = sorted(dst.glob("*.safetensors"))
        assert len(files) > 1, "sharded by size"
        for path in files:
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    assert f.get_slice(key).get_dtype() == "F32", f"{layout} {path.name} {key}"
        _assert_equal(_transformers_state(dst), want, f"{layout}: transformers' from_pretrained")
        src = dst
    assert not list(tmp_path.rglob(".*tmp*")), "no temporary file left behind"
