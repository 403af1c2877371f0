"""``gridtrain estimate`` on its own: the formulas against the papers they come from, the model
presets and Hugging Face configs, the command line (reports, clear failures), the search's speed.

The comparison with the engine itself (8 gloo ranks, every mode) is ``test_estimate_engine.py``.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from gridtrain.config import Config, ConfigError
from gridtrain.estimate import (
    Scenario,
    SearchOptions,
    estimate,
    get_device,
    get_model,
    search,
    tensor_shards,
)
from gridtrain.estimate import cli as estimate_cli
from gridtrain.estimate.geometry import Geometry
from gridtrain.estimate.measure import format_measured, measure
from gridtrain.estimate.memory import block_items, in_flight
from gridtrain.estimate.model_files import from_hf_config
from gridtrain.estimate.models import ModelSpec
from gridtrain.estimate.scenario import EstimateError
from gridtrain.estimate.shards import tensor_config
from gridtrain.parallel.layout import Layout
from gridtrain.parallel.mode import ParallelMode as PM


# ---- the formulas against their papers -------------------------------------------------------
@pytest.mark.parametrize("t", [1, 2, 8])
def test_activations_reproduce_korthikanti(t):
    """Korthikanti et al. 2022 (Eq. 1-2): a GPT-3 175B layer keeps ``sbh (10 + 24/t + 5as/ht)``
    bytes in fp16 with dropout and unfused attention under Megatron's tensor parallelism
    (``34 sbh + 5 a s^2 b`` at t = 1). The op-by-op inventory adds only the norms' statistics
    (8 bytes per token and norm), hence the 1e-4."""
    spec = ModelSpec("k", 1, 12288, 96, 51200, 2048, positions=2048, dropout=0.1)
    mode = "1d" if t > 1 else None
    sc = Scenario(world=t, tensor=t, mode=mode, amp="naive", attention="math")
    items = block_items(
        spec, Geometry.of(mode, t), sc, 2048, tensor_shards(spec, mode, t).block, True
    )
    s, b, h, a = 2048, 1, 12288, 96
    assert sum(x for _, x in items) == pytest.approx(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-4
    )


@pytest.mark.parametrize(
    "stage, per_param",
    [(0, 16), (1, 4 + 12 / 64), (2, 2 + 16 / 64), (3, 16 / 64)],
)
def test_model_states_reproduce_the_zero_paper(stage, per_param):
    """Rajbhandari et al. 2020 (Fig. 1, K = 12): mixed-precision Adam holds 2 + 2 + K bytes per
    parameter, stage 1 ``4 + K/Nd``, stage 2 ``2 + (2 + K)/Nd``, stage 3 ``16/Nd``. Their K
    counts fp32 masters and moments; the fp32 master gradients naive fp16 makes at the step
    are not held between steps, as the paper counts, except at stage 2: there gridtrain
    accumulates the reduce-scattered gradient rows in fp32 (the masters' gradients) where the
    paper keeps them in fp16, so ``2 + 16/Nd``. Row padding and step counters cost < 1 %."""
    spec = get_model("gpt3-6.7b")
    cfg = Config.from_dict(
        {"fp16": {"mode": "naive"}, "zero": stage} if stage else {"fp16": {"mode": "naive"}}
    )
    sc = Scenario.from_config(cfg, 64)
    st = estimate(spec, sc, get_device("a100-80g")).stages[0].states
    assert st.resident == pytest.approx(per_param * spec.num_params(), rel=0.01)


def test_pipeline_in_flight_follows_the_schedules():
    """1F1B keeps ``min(P - stage, m)`` micro-batches (warm-up + 1, ``one_f_one_b.py``);
    interleaved ``min(2 (P - s - 1) + (v - 1) P + 1, m v)`` chunks (``interleaved.py``)."""
    one = Scenario(world=8, pipeline=4, pipeline_micro=8)
    assert [in_flight(one, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(Scenario(world=8, pipeline=4, pipeline_micro=2), s) for s in range(4)] == [
        2,
        2,
        2,
        1,
    ]
    inter = Scenario(world=8, pipeline=4, pipeline_micro=8, chunks=2)
    assert [in_flight(inter, s) * 2 for s in range(4)] == [11, 9, 7, 5]
    assert in_flight(Scenario(world=8, pipeline=4, pipeline_micro=4, chunks=2), 3) == 4  # m == P


def test_gpipe_keeps_every_microbatch_in_flight():
    """``parallel.pipeline.schedule = "gpipe"`` runs every forward before any backward, so each
    stage keeps all m micro-batches (1F1B: ``P - stage``); the bubble, hence the time, is 1F1B's."""
    spec = ModelSpec("tiny", layers=4, hidden=64, heads=8, vocab=128, seq_len=16)

    def run(schedule):
        pipeline = {"size": 4, "schedule": schedule}
        cfg = Config.from_dict({"parallel": {"pipeline": pipeline}, "num_microbatches": 8})
        return estimate(spec, Scenario.from_config(cfg, 8), get_device("h100-80g"))

    gpipe, one = run("gpipe"), run("1f1b")
    assert [s.activations.microbatches_in_flight for s in gpipe.stages] == [8, 8, 8, 8]
    assert [s.activations.microbatches_in_flight for s in one.stages] == [4, 3, 2, 1]
    assert gpipe.step_s == one.step_s and gpipe.memory > one.memory
    assert "(gpipe)" in gpipe.scenario.describe()
    assert gpipe.scenario.config_dict()["parallel"]["pipeline"]["schedule"] == "gpipe"
    gpipe_chunks = Scenario(
        world=4, pipeline=2, chunks=2, pipeline_micro=8, pipeline_schedule="gpipe"
    )
    with pytest.raises(EstimateError, match="num_chunks = 1"):
        gpipe_chunks.check(spec)


# ---- models, devices, the layout context ----------------------------------------------------
def test_presets_have_their_published_sizes():
    assert get_model("gpt2-124m").num_params() == pytest.approx(124.5e6, rel=1e-3)  # vocab 50304
    assert get_model("llama-7b").num_params() == pytest.approx(6.74e9, rel=1e-3)
    assert get_model("llama-70b").num_params() == pytest.approx(68.98e9, rel=1e-3)
    assert get_model("gpt3-175b").num_params() == pytest.approx(174.6e9, rel=1e-3)  # Megatron's


def test_hugging_face_config_json(tmp_path):
    llama = {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "max_position_embeddings": 8192, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(llama))
    spec = get_model(str(tmp_path))  # a directory holding config.json works too
    assert (spec.layers, spec.hidden, spec.num_kv_heads, spec.ffn_dim) == (32, 4096, 8, 14336)
    assert spec.gated and spec.norm == "rms" and not spec.tied and not spec.bias
    assert spec.num_params() == pytest.approx(8.03e9, rel=1e-3)  # Llama 3 8B
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
            "n_positions": 1024, "activation_function": "gelu_new"}  # fmt: skip
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    spec = from_hf_config(tmp_path / "gpt2.json")
    assert spec.tied and spec.positions == 1024 and not spec.gated
    assert spec.num_params() == 124_439_808  # GPT-2 small, as Hugging Face counts it
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "x", "hidden_size": 8}))
    with pytest.raises(ValueError, match="no layers"):
        from_hf_config(tmp_path / "bad.json")


LLAMA_JSON = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
    "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
}  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer from 1 to"),
        ({"num_hidden_layers": -2}, "num_hidden_layers must be an integer from 1 to"),
        ({"hidden_size": "64"}, "hidden_size must be an integer from 1 to 2147483647, got '64'"),
        ({"hidden_size": 64.0}, "hidden_size must be an integer"),
        ({"num_key_value_heads": True}, "num_key_value_heads must be an integer"),
        ({"hidden_size": 10**12}, "hidden_size must be an integer from 1 to 2147483647"),
        (
            {"vocab_size": 2**31 - 1, "hidden_size": 2**31 - 4, "num_attention_heads": 4},
            "vocab_size x hidden_size makes a weight of",
        ),  # fmt: skip
        ({"num_attention_heads": 7}, "hidden_size 64 is not divisible by num_attention_heads 7"),
        ({"num_key_value_heads": 3}, "num_attention_heads 4 are not divisible by num_key_value_"),
        ({"intermediate_size": 0}, "intermediate_size must be an integer from 1"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer from 1"),
        ({"num_local_experts": 4, "num_experts_per_tok": 8}, "num_experts_per_tok 8 exceeds"),
    ],
)
def test_bad_config_json_names_the_key(tmp_path, capsys, change, message):
    """A config.json that describes no model: exit 2 and one line naming the key, no
    traceback (the file's values are checked before anything is built from them)."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_JSON, **change}))
    code, out, err = _run(["--model", str(tmp_path), "--world-size", "1"], capsys)
    assert code == 2 and message in err, err
    assert err.startswith("gridtrain estimate: error: ") and "Traceback" not in err + out


def test_unreadable_config_json_and_bad_seq_len(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[1, 2]")
    code, _, err = _run(["--model", str(tmp_path), "--world-size", "1"], capsys)
    assert code == 2 and "holds one JSON object, got list" in err
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = _run(["--model", str(tmp_path), "--world-size", "1"], capsys)
    assert code == 2 and "cannot read" in err
    code, _, err = _run(["--model", "gpt2-124m", "--world-size", "1", "--seq-len", "0"], capsys)
    assert code == 2 and "--seq-len must be an integer from 1" in err


def test_layout_of_thousands_of_ranks():
    """One rank of a 4096-rank world, from topology's lists, no process: what layers ask."""
    cfg = Config.from_dict({"parallel": {"pipeline": 8, "tensor": {"size": 64, "mode": "3d"}}})
    ctx = Layout(cfg, 4096, global_rank=4095)
    assert ctx.world_size(PM.DATA) == 8 and ctx.world_size(PM.PARALLEL_3D_INPUT) == 4
    assert ctx.local_rank(PM.PIPELINE) == 7 and ctx.ranks(PM.TENSOR)[-1] == 4095
    with pytest.raises(RuntimeError, match="no process groups"):
        ctx.group(PM.DATA)
    shards = tensor_shards(get_model("llama-70b"), "3d", 64)
    qkv = shards.block.local["h0.attn.qkv.weight"]
    assert qkv == (get_model("llama-70b").qkv_out // 16, 8192 // 4)  # [out/d^2, in/d]
    assert Layout(tensor_config("2d", 16), 16).world_size(PM.PARALLEL_2D_ROW) == 4


# ---- the command line -------------------------------------------------------------------
def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    estimate_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate", *argv])
    code = args.handler(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "config.py"
    path.write_text(text)
    return str(path)


def test_cli_prints_memory_communication_and_time(tmp_path, capsys):
    cfg = _config(
        tmp_path,
        "parallel = dict(pipeline=8, tensor=dict(size=8, mode='1d'))\nnum_microbatches = 32\n"
        "fp16 = dict(mode='bf16')\nzero = dict(stage=1)\n",
    )
    code, out, _ = _run(["--config", cfg, "--model", "llama-70b", "--world-size", "1024",
                         "--gpu", "h100-80g", "--global-batch", "512", "--recompute", "full"],
                        capsys)  # fmt: skip
    assert code == 0, out
    for text in ("memory per rank", "optimizer_state", "ZeRO-1 over 16", "in flight (1F1B)",
                 "communication per step", "PARALLEL_1D", "all_reduce", "NVLink", "network",
                 "pipeline bubble", "MFU", "fits"):  # fmt: skip
        assert text in out, text
    code, out, _ = _run(["--config", cfg, "--model", "llama-70b", "--world-size", "1024",
                         "--global-batch", "512", "--recompute", "full", "--json"], capsys)  # fmt: skip
    data = json.loads(out)
    assert data["fits"] and data["layout"]["zero"] == {"stage": 1} and data["mfu"] > 0


def _estimate_of(tmp_path, text: str, model="gpt2-124m", world=1, **kw):
    cfg = Config.from_file(_config(tmp_path, text))
    sc = Scenario.from_config(cfg, world, **kw)
    return estimate(get_model(model), sc, get_device("h100-80g"))


def test_config_keys_are_honoured(tmp_path, capsys):
    """Every key that changes memory is read from the config, as the engine reads it."""
    plain = _estimate_of(tmp_path, "fp16 = dict(mode='bf16')\n").worst.activations.in_flight
    full = _estimate_of(tmp_path, "fp16 = dict(mode='bf16')\nactivation_checkpoint = True\n")
    half = _estimate_of(tmp_path, "activation_checkpoint = dict(every=2)\nfp16 = dict(mode='bf16')")
    assert full.scenario.recompute == "full" and full.scenario.checkpointed(12) == 12
    assert half.scenario.checkpointed(12) == 6
    assert full.worst.activations.in_flight < half.worst.activations.in_flight < plain
    chunked = _estimate_of(tmp_path, "fp16 = dict(mode='bf16')\nchunked_loss = True\n")
    # no fp32 log-softmax (1024 x 50304 x 4 B); the head weight's fp32 gradient sum instead
    saved = 1024 * 50304 * 4 - 50304 * 768 * 4
    assert plain - chunked.worst.activations.in_flight > saved
    # one rank's experts: ep 2 halves each expert weight's rows on a rank
    moe = ModelSpec("tiny-moe", 2, 64, 4, 128, 16, experts=4, top_k=2)
    one, two = (
        estimate(moe, Scenario(world=4, expert_parallel=ep, zero=1), get_device("cpu"))
        for ep in (1, 2)
    )
    experts = 2 * 4 * (2 * 64 * 256 + 256 + 64)  # two blocks' w1, b1, w2, b2 (4 experts)
    assert one.stages[0].states.part("weights") - two.stages[0].states.part("weights") == (
        experts / 2 * 4
    )
    code, out, _ = _run(["--config", _config(tmp_path, "zero = dict(stage=3, offload=True, "
                         "delayed_update=True)\nactivation_checkpoint = True\n"),
                         "--model", "gpt2-124m", "--world-size", "2"], capsys)  # fmt: skip
    assert code == 0 and "not modelled: zero.delayed_update" in out
    assert "12 of 12 blocks recomputed" in out
    # a data-parallel gradient handler all-reduces after the backward: nothing overlaps it
    overlapped, handled = (
        _estimate_of(tmp_path, text, world=8).worst
        for text in ("", "gradient_handler = [dict(type='DataParallelGradientHandler')]\n")
    )
    assert handled.exposed_dp_s == handled.overlapped_s > overlapped.exposed_dp_s


def test_recompute_help_tells_the_truth():
    parser = argparse.ArgumentParser()
    sub = estimate_cli.add_parser(parser.add_subparsers(dest="command"))
    text = sub.format_help()
    assert "runs without" not in text and "activation_checkpoint" in text


def test_cli_names_the_group_and_the_divisor(tmp_path, capsys):
    cfg = _config(tmp_path, "parallel = dict(tensor=dict(size=8, mode='1d'))\n")
    code, _, err = _run(["--config", cfg, "--model", "gpt2-1.5b", "--world-size", "64"], capsys)
    assert code == 2 and "25 attention heads do not split over PARALLEL_1D (8 ranks): 25 % 8" in err
    code, _, err = _run(["--config", cfg, "--model", "gpt2-124m", "--world-size", "12"], capsys)
    assert code == 2 and "world size 12 is not divisible by pipeline 1 x tensor 8" in err
    cfg = _config(tmp_path, "parallel = dict(tensor=dict(size=8, mode='3d'))\n")
    code, _, err = _run(["--config", cfg, "--model", "gpt2-124m", "--world-size", "8",
                         "--micro-batch", "2"], capsys)  # fmt: skip
    assert code == 2 and "d*d = 4 batch blocks of the cube: micro-batch 2 % 4 != 0" in err
    code, _, err = _run(["--model", "gpt5", "--world-size", "8"], capsys)
    assert code == 2 and "unknown model 'gpt5'" in err


def test_interleaved_microbatches_checked_as_the_config_checks_them():
    """The estimate runs the engine's own micro-batch check, so its message is the config's."""
    with pytest.raises(ConfigError) as loaded:
        Config.from_dict({"parallel": {"pipeline": {"size": 2, "num_chunks": 2}},
                          "num_microbatches": 3})  # fmt: skip
    with pytest.raises(EstimateError) as estimated:
        Scenario(world=4, pipeline=2, chunks=2, pipeline_micro=3).check(get_model("gpt2-124m"))
    assert "num_microbatches 3 % pipeline 2 != 0" in str(estimated.value)
    assert str(estimated.value) in str(loaded.value)


def test_cli_says_by_how_much_it_does_not_fit(capsys):
    code, out, _ = _run(["--model", "llama-70b", "--world-size", "8", "--gpu", "h100-80g"], capsys)
    assert code == 1
    assert "DOES NOT FIT" in out and "does not fit: every rank needs" in out and "over by" in out


def test_device_overrides(capsys):
    code, out, _ = _run(["--model", "gpt2-124m", "--world-size", "1", "--gpu", "h200-141g",
                         "--peak-tflops", "500", "--memory-gb", "20", "--global-batch", "8"],
                        capsys)  # fmt: skip
    assert code == 0 and "500 TFLOP/s" not in out  # fp32 run: the fp32 peak is shown
    assert "of 20.00 GiB: fits" in out and "(none: one rank)" in out


# ---- the search ---------------------------------------------------------------------------
def test_search_is_bounded_and_weighs_every_mode():
    """Every layout of 512 GPUs for GPT-3 13B (bf16, full recompute), ranked. The search's
    cost is bounded by what it counts, not timed (speed is a benchmark's:
    ``benchmarks/estimate_vs_published.py --search-speed``): best first stops after a few
    full estimates, far fewer than the layouts that fit."""
    spec, device = get_model("gpt3-13b"), get_device("h100-80g")
    base = Scenario(world=512, amp="bf16", recompute="full")
    result = search(spec, device, 512, 1024, base, SearchOptions())
    assert result.considered > 100 and len(result.ranked) >= 10
    assert {None, "1d", "2d", "2.5d", "3d", "sequence"} <= result.modes  # all weighed
    speeds = [e.tokens_per_s for e in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(e.fits and e.scenario.global_batch == 1024 for e in result.ranked)
    # best first stopped early: what it estimated is a small share of what fits
    assert result.pruned > 3 * result.estimated, (result.pruned, result.estimated)


def test_search_command(capsys):
    code, out, _ = _run(["--model", "gpt2-350m", "--world-size", "64", "--gpu", "a100-80g",
                         "--global-batch", "256", "--search", "--top", "3"], capsys)  # fmt: skip
    assert code == 0
    assert "the best as a config:" in out and "GLOBAL_BATCH_SIZE = 256" in out
    best = out.split("the best as a config:")[1]
    assert "parallel = dict(" in best
    code, out, _ = _run(["--model", "llama-70b", "--world-size", "8", "--global-batch", "8",
                         "--search"], capsys)  # fmt: skip
    assert code == 1 and "no layout fits" in out


def test_search_matches_a_direct_estimate():
    """The search's numbers for a layout are the plain estimate's."""
    spec, device = get_model("gpt2-350m"), get_device("a100-80g")
    result = search(spec, device, 64, 256, Scenario(world=64), SearchOptions(top=1))
    best = result.ranked[0]
    again = estimate(spec, best.scenario, device)
    assert again.step_s == best.step_s and again.memory == best.memory
    assert math.isclose(again.mfu, best.mfu)


def test_best_first_search_keeps_the_true_top():
    """Pruning by the step-time bound loses nothing: the top 5 equal an exhaustive search's."""
    spec, device = get_model("gpt2-350m"), get_device("a100-80g")
    pruned = search(spec, device, 64, 256, Scenario(world=64), SearchOptions(top=5))
    everything = search(spec, device, 64, 256, Scenario(world=64), SearchOptions(top=10**6))
    assert pruned.pruned > 0 and everything.pruned == 0
    top = [e.scenario for e in pruned.ranked[:5]]
    assert top == [e.scenario for e in everything.ranked[:5]]


def test_cli_unsplittable_vocabulary_and_pad_vocab(tmp_path, capsys):
    """A Hugging Face vocabulary (GPT-2's 50257) that no tensor group splits: the planner's own
    error names the layer and the divisor; --pad-vocab rounds it up as Megatron does."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
        "n_positions": 1024,
    }))  # fmt: skip
    cfg = _config(tmp_path, "parallel = dict(tensor=dict(size=4, mode='1d'))\n")
    argv = ["--config", cfg, "--model", str(tmp_path), "--world-size", "8"]
    code, _, err = _run(argv, capsys)
    assert (
        code == 2 and "num_embeddings=50257 must be divisible by 4" in err and "--pad-vocab" in err
    )
    code, out, _ = _run([*argv, "--pad-vocab", "128"], capsys)
    assert code == 0 and "vocab 50304" in out


# ---- --measure and the search's headroom ------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_measure_needs_a_gpu(capsys):
    code, out, err = _run(["--model", "gpt2-124m", "--world-size", "8", "--measure"], capsys)
    assert code == 2 and "--measure runs one rank on a GPU" in err and "has none" in err
    assert out == ""  # refused before anything is estimated or started


def test_measure_runs_one_rank_under_a_fake_process_group():
    """``measure`` on the host (``device="cpu"``; the command line's needs a GPU): rank 0 of
    8 under data 4 x pipeline 2, ZeRO 1, holds what the estimate says, with no other process
    (no collective reaches a peer). Within 2 %: both count the same storages."""
    spec = ModelSpec("tiny", layers=2, hidden=64, heads=8, vocab=128, seq_len=16, positions=16)
    cfg = Config.from_dict({"parallel": {"pipeline": 2}, "num_microbatches": 4,
                            "zero": {"stage": 1}})  # fmt: skip
    est = estimate(spec, Scenario.from_config(cfg, 8, micro_batch=2), get_device("cpu"))
    m = measure(est, cfg, steps=1, warmup=1, device="cpu")
    assert m.rank == 0 and m.skipped == 0 and not torch.distributed.is_initialized()
    st = est.worst.states.device
    for c in ("parameters", "masters", "gradients", "optimizer_state"):
        assert m.categories[c] == pytest.approx(st[c], rel=0.02, abs=256), c
    assert "fake process group" in format_measured(est, m)


def test_search_leaves_headroom(capsys):
    """Every pick leaves 10 % of the device free by default; ``--headroom`` changes it."""
    spec, device = get_model("gpt2-1.5b"), get_device("a100-80g", memory=40 * 2**30)
    base = Scenario(world=8, amp="bf16")
    tight = search(spec, device, 8, 64, base, SearchOptions(top=50, headroom=0.0))
    roomy = search(spec, device, 8, 64, base, SearchOptions(top=50))
    assert all(e.memory <= 0.9 * device.memory for e in roomy.ranked)
    assert any(e.memory > 0.9 * device.memory for e in tight.ranked)
    code, _, err = _run(["--model", "gpt2-124m", "--world-size", "8", "--global-batch", "8",
                         "--search", "--headroom", "1.5"], capsys)  # fmt: skip
    assert code == 2 and "--headroom must be in [0, 1)" in err
