"""Strict config: no silent conversions, and every check that can run before a process starts does.

Each bad value is an error naming the key and the value; the checks that used to
surface only after every rank started (pipeline micro-batches, interleaving,
tensor_shape, handler kwargs, apex) fail at config time.
"""

import importlib.util
import inspect
import math
import subprocess

import pytest

import gridtrain as gt
from gridtrain.amp import AMP_TYPE
from gridtrain.cli.main import main
from gridtrain.config import HANDLER_KWARGS, STYLES
from gridtrain.gradient_handlers import handler_class

HAVE_APEX = importlib.util.find_spec("apex") is not None


def error_of(config: dict) -> str:
    with pytest.raises(gt.ConfigError) as err:
        gt.Config.from_dict(config)
    return str(err.value)


@pytest.mark.parametrize(
    "bad,key,got",
    [
        (dict(gradient_accumulation=True), "gradient_accumulation", "True"),
        (dict(gradient_accumulation=2.0), "gradient_accumulation", "2.0"),
        (dict(clip_grad_norm="1.0"), "clip_grad_norm", "'1.0'"),
        (dict(clip_grad_norm=math.inf), "clip_grad_norm", "inf"),
        (dict(clip_grad_norm=math.nan), "clip_grad_norm", "nan"),
        (dict(clip_grad_norm=True), "clip_grad_norm", "True"),
        (dict(cudnn_benchmark="yes"), "cudnn_benchmark", "'yes'"),
        (dict(cudnn_deterministic=1), "cudnn_deterministic", "1"),
        (dict(parallel=dict(tensor=dict(size=2.0, mode="1d"))), "parallel.tensor.size", "2.0"),
        (dict(parallel=dict(pipeline=2.0)), "parallel.pipeline", "2.0"),
        (dict(parallel=dict(tensor=True)), "parallel.tensor", "True"),
        (dict(parallel=dict(pipeline=dict(num_chunks="2"))), "parallel.pipeline.num_chunks", "'2'"),
        (dict(num_microbatches=4.0), "num_microbatches", "4.0"),
        (dict(seed="1"), "seed", "'1'"),
        (dict(fp16=dict(mode="naive", initial_scale="65536")), "fp16.initial_scale", "'65536'"),
        (dict(fp16=dict(mode="naive", initial_scale=math.inf)), "fp16.initial_scale", "inf"),
        (dict(fp16=dict(mode="naive", hysteresis=2.5)), "fp16.hysteresis", "2.5"),
        (dict(fp16=dict(mode="naive", verbose="no")), "fp16.verbose", "'no'"),
        (dict(moe=dict(expert_parallel_size=True)), "moe.expert_parallel_size", "True"),
        (dict(max_nonfinite_steps=-1), "max_nonfinite_steps", "-1"),
        (dict(max_nonfinite_steps=False), "max_nonfinite_steps", "False"),
        (dict(timeout_s=0), "timeout_s", "0"),
        (dict(timeout_s=-5.0), "timeout_s", "-5.0"),
        (dict(timeout_s=math.inf), "timeout_s", "inf"),
        (dict(timeout_s="10"), "timeout_s", "'10'"),
    ],
)
def test_wrong_types_are_errors_naming_key_and_value(bad, key, got):
    message = error_of(bad)
    assert f"key '{key}'" in message and f"(got {got}" in message, message


def test_quoted_number_gets_a_hint():
    assert "write numbers unquoted" in error_of(dict(clip_grad_norm="1e-3"))


def test_ints_stay_accepted_for_float_fields_and_yaml_spellings_still_load(tmp_path):
    c = gt.Config.from_dict(
        dict(clip_grad_norm=1, timeout_s=10, fp16=dict(mode="naive", initial_scale=2**16))
    )
    assert c.clip_grad_norm == 1.0 and c.timeout_s == 10.0 and c.fp16.initial_scale == 65536.0
    (tmp_path / "c.yaml").write_text(
        "fp16: {mode: bf16}\nparallel: {pipeline: {size: 2, tensor_shape: [4, 8]}}\n"
        "num_microbatches: 2\ntimeout_s: 30\n"
    )
    y = gt.Config.from_file(tmp_path / "c.yaml")
    assert y.fp16.mode is AMP_TYPE.BF16, "the enum's string values are still accepted"
    assert y.parallel.pipeline.tensor_shape == (4, 8), "YAML lists become tuples"


def test_new_engine_keys_and_their_defaults():
    c = gt.Config.from_dict({})
    assert c.max_nonfinite_steps == 3 and c.timeout_s == 600.0
    assert c.parallel.tensor.plan is None
    assert gt.Config.from_dict(dict(max_nonfinite_steps=0)).max_nonfinite_steps == 0


def test_assignment_is_validated_too():
    c = gt.Config.from_dict({})
    with pytest.raises(ValueError, match="gradient_accumulation"):
        c.gradient_accumulation = True


# ---- ring_attention ------------------------------------------------------------------------
def test_ring_attention_set_outside_sequence_mode_is_an_error():
    message = error_of(dict(parallel=dict(tensor=dict(size=4, mode="2d", ring_attention="online"))))
    assert "ring_attention='online' is only used by mode 'sequence', got mode '2d'" in message
    message = error_of(dict(parallel=dict(tensor=dict(ring_attention="standard"))))
    assert "got mode None" in message, "explicit even when it equals the default"


def test_ring_attention_under_sequence_and_the_default_elsewhere_are_fine():
    seq = dict(size=2, mode="sequence", ring_attention="online")
    assert gt.Config.from_dict(dict(parallel=dict(tensor=seq))).parallel.tensor.ring_attention
    gt.Config.from_dict(dict(parallel=dict(tensor=dict(size=4, mode="2d"))))


# ---- plan ----------------------------------------------------------------------------------
def test_plan_styles_are_checked_against_the_style_table():
    plan = {"layers.*.attn.qkv": "colwise", "layers.*.attn.out": "rowwise", "head": "replicate"}
    c = gt.Config.from_dict(dict(parallel=dict(tensor=dict(size=2, mode="1d", plan=plan))))
    assert c.parallel.tensor.plan == plan
    bad = {"layers.*.attn.qkv": "colwise", "layers.*.mlp.fc": "colwize"}
    message = error_of(dict(parallel=dict(tensor=dict(size=2, mode="1d", plan=bad))))
    assert "key 'parallel.tensor.plan'" in message
    assert "pattern 'layers.*.mlp.fc' names unknown style 'colwize'" in message
    assert "did you mean 'colwise'" in message
    assert "allowed: " + ", ".join(STYLES) in message


@pytest.mark.parametrize("plan", [{"fc": 1}, {"": "colwise"}, ["fc", "colwise"]])
def test_plan_must_map_patterns_to_style_names(plan):
    assert "parallel.tensor.plan" in error_of(
        dict(parallel=dict(tensor=dict(size=2, mode="1d", plan=plan)))
    )


# ---- pipeline ------------------------------------------------------------------------------
def test_interleaved_needs_microbatches_divisible_by_the_pipeline_size():
    message = error_of(dict(parallel=dict(pipeline=dict(size=4, num_chunks=2)), num_microbatches=6))
    assert "num_microbatches 6 % pipeline 4 != 0" in message
    gt.Config.from_dict(
        dict(parallel=dict(pipeline=dict(size=4, num_chunks=2)), num_microbatches=8)
    )


def test_pipeline_without_microbatches_fails_check_run_but_still_loads():
    c = gt.Config.from_dict(dict(parallel=dict(pipeline=2)))  # `gridtrain topo` must print it
    c.check_world_size(4)
    with pytest.raises(gt.ConfigError, match=r"parallel.pipeline = 2 needs num_microbatches"):
        c.check_run(4)
    gt.Config.from_dict(dict(parallel=dict(pipeline=2), num_microbatches=4)).check_run(4)


@pytest.mark.parametrize("shape,got", [((2, -1), "-1"), ((0, 8), "0"), ((), "()")])
def test_tensor_shape_entries_must_be_positive(shape, got):
    message = error_of(dict(parallel=dict(pipeline=dict(size=2, tensor_shape=shape))))
    assert "parallel.pipeline.tensor_shape" in message and f"(got {got}" in message, message


# ---- gradient handlers ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "entry,message",
    [
        (
            dict(type="DataParallelGradientHandler", bucket_size=10),
            "DataParallelGradientHandler got unknown keyword argument 'bucket_size' — "
            "did you mean 'bucket_size_mb'? (it takes: bucket_size_mb)",
        ),
        (
            dict(type="PipelineSharedModuleGradientHandler", bucket_size_mb=10),
            "unknown keyword argument 'bucket_size_mb' (it takes: none)",
        ),
        (
            dict(type="MoeGradientHandler", bucket_size_mb=-1),
            "bucket_size_mb must be a number > 0 and <= 1048576, got -1",
        ),
        (
            dict(type="SequenceParallelGradientHandler", bucket_size_mb=0),
            "bucket_size_mb must be a number > 0 and <= 1048576, got 0",
        ),
        (
            dict(type="DataParallelGradientHandler", bucket_size_mb="25"),
            "bucket_size_mb must be a number > 0 and <= 1048576, got '25'",
        ),
        (dict(type="DataParallelGradientHandler", bucket_size_mb=True), "got True"),
        (dict(type="DataParallelGradientHandler", bucket_size_mb=math.inf), "got inf"),
    ],
)
def test_handler_kwargs_are_checked_at_config_time(entry, message):
    text = error_of(dict(gradient_handler=[entry]))
    assert "key 'gradient_handler.0'" in text and message in text, text


def test_handler_kwargs_accepts_what_the_handler_takes():
    c = gt.Config.from_dict(
        dict(gradient_handler=[dict(type="DataParallelGradientHandler", bucket_size_mb=0.5)])
    )
    assert c.gradient_handler[0].kwargs == {"bucket_size_mb": 0.5}


@pytest.mark.parametrize("name", list(HANDLER_KWARGS))
def test_the_kwargs_table_matches_each_handler_signature(name):
    params = inspect.signature(handler_class(name).__init__).parameters.values()
    named = tuple(
        p.name
        for p in params
        if p.name not in ("self", "model", "ctx")
        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )
    assert named == HANDLER_KWARGS[name], (
        f"update HANDLER_KWARGS (gridtrain/config/gradient_handlers.py) for {name}"
    )


# ---- apex ----------------------------------------------------------------------------------
@pytest.mark.skipif(HAVE_APEX, reason="apex is installed here")
def test_apex_missing_is_a_config_error():
    message = error_of(dict(fp16=dict(mode=AMP_TYPE.APEX)))
    assert "key 'fp16'" in message and "needs NVIDIA apex" in message
    assert "AMP_TYPE.TORCH" in message, "names the alternatives"


def test_apex_present_is_accepted(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "apex" else real(n, *a)
    )
    assert gt.Config.from_dict(dict(fp16=dict(mode="apex"))).fp16.mode is AMP_TYPE.APEX


# ---- a .py config that exits or raises ---------------------------------------------------
@pytest.mark.parametrize(
    "body,raised",
    [
        ("import sys\nsys.exit(3)\n", "raised SystemExit(3) at line 2"),
        ("x = 1\nraise ValueError('no GPU here')\n", "raised ValueError('no GPU here') at line 2"),
        ("import sys\nsys.exit()\n", "raised SystemExit() at line 2"),
    ],
)
def test_py_config_that_exits_or_raises_is_a_config_error(tmp_path, body, raised):
    path = tmp_path / "config.py"
    path.write_text(body)
    with pytest.raises(gt.ConfigError) as err:
        gt.Config.from_file(path)
    assert f"config file '{path}' {raised}" in str(err.value)


def test_gridtrain_run_reports_it_with_exit_2_not_the_config_exit_code(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    (tmp_path / "train.py").write_text("")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "pipe.py").write_text("parallel = dict(pipeline=2)\n")
    for config, message in (
        ("exits.py", "exits.py' raised SystemExit(3) at line 2"),
        ("pipe.py", "parallel.pipeline = 2 needs num_microbatches"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(["run", "--nproc_per_node", "2", "--config", config, "train.py"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


# ---- bounds: every number fits what consumes it (issue 28 items 5 and 6) -------------------
@pytest.mark.parametrize(
    "bad,key",
    [
        (dict(timeout_s=1e300), "timeout_s"),  # timedelta overflowed in every worker
        (dict(timeout_s=1e10), "timeout_s"),  # c10d counts int64 nanoseconds
        (dict(seed=2**70), "seed"),  # torch.manual_seed raised in every worker
        (dict(seed=-1), "seed"),
        (dict(gradient_accumulation=2**40), "gradient_accumulation"),
        (dict(num_microbatches=2**40), "num_microbatches"),
        (dict(parallel=dict(tensor=dict(size=2**40, mode="1d"))), "parallel.tensor.size"),
        (dict(parallel=dict(pipeline=2**40)), "parallel.pipeline.size"),
        (dict(fp16=dict(mode="naive", initial_scale=1e300)), "fp16.initial_scale"),
        (dict(zero=dict(stage=2, bucket_size_mb=1e300)), "zero.bucket_size_mb"),
        (dict(chunked_loss=dict(chunk_tokens=2**40)), "chunked_loss.chunk_tokens"),
    ],
)
def test_numbers_out_of_their_consumers_range_are_errors_naming_the_key(bad, key):
    message = error_of(bad)
    assert f"key '{key}'" in message, message


def test_seed_and_timeout_at_their_limits_are_accepted():
    c = gt.Config.from_dict(dict(seed=2**63 - 1, timeout_s=1e9))
    assert c.seed == 2**63 - 1 and c.timeout_s == 1e9


def test_launch_arguments_are_bounded_too():
    with pytest.raises(gt.ConfigError, match="seed"):
        gt.launch({}, rank=0, world_size=1, host="127.0.0.1", port=1, seed=2**70)
    with pytest.raises(gt.ConfigError, match="timeout_s"):
        gt.launch({}, rank=0, world_size=1, host="127.0.0.1", port=1, timeout_s=1e300)


def test_gridtrain_run_refuses_out_of_range_values_before_any_process(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    (tmp_path / "train.py").write_text("")
    for body, key in (("timeout_s = 1e300\n", "timeout_s"), ("seed = 2**70\n", "seed")):
        (tmp_path / "config.py").write_text(body)
        with pytest.raises(SystemExit) as stop:
            main(["run", "--nproc_per_node", "2", "--config", "config.py", "train.py"])
        assert stop.value.code == 2
        assert f"key '{key}'" in capsys.readouterr().err


def test_quoted_values_in_errors_are_cut(tmp_path):
    huge = ["x" * 1000] * 1000
    message = error_of(dict(parallel=huge))
    assert "key 'parallel'" in message and len(message) < 1000, len(message)
    message = error_of({"p" * 10_000: 1})
    assert "unknown key" in message and len(message) < 2000, len(message)


# ---- YAML ------------------------------------------------------------------------------------
ALIAS_BOMB = (  # 9**9 strings once expanded, from ~330 bytes
    "A: &A [x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("ABCDEFGH", "BCDEFGHI"))
    + "parallel: *I\n"
)


def test_a_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 500
    with pytest.raises(gt.ConfigError) as err:
        gt.Config.from_file(path)
    message = str(err.value)
    assert "alias" in message and "line " in message and len(message) < 500, message[:1000]


def test_yaml_aliases_within_the_limit_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("BASE: &base {size: 2, mode: 1d}\nparallel:\n  tensor: *base\n")
    assert gt.Config.from_file(path).parallel.tensor.size == 2


@pytest.mark.parametrize(
    "text,key,line",
    [
        (
            "parallel: {tensor: {size: 2, mode: 1d}}\ntimeout_s: 5\nparallel: {pipeline: 2}\n",
            "parallel",
            3,
        ),
        ("fp16:\n  mode: bf16\n  mode: naive\n", "mode", 3),
    ],
)
def test_duplicate_yaml_keys_are_refused_naming_key_and_line(tmp_path, text, key, line):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(gt.ConfigError) as err:
        gt.Config.from_file(path)
    message = str(err.value)
    assert f"duplicate key '{key}'" in message and f"line {line}" in message, message
    assert str(path) in message, message
