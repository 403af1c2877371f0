"""Typed config: loading from .py/.yaml/dict, defaults, and errors that name key, value, allowed."""

import pytest

import gridtrain as gt
from gridtrain.amp import AMP_TYPE


def test_py_yaml_and_dict_agree(tmp_path):
    py = tmp_path / "c.py"
    py.write_text(
        "from gridtrain.amp import AMP_TYPE\nimport math\nTRAIN_ITERS = 10\n"
        "parallel = dict(pipeline=2, tensor=dict(size=4, mode='2.5d', depth=1))\n"
        "fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16)\n"
        "gradient_handler = [dict(type='SequenceParallelGradientHandler')]\n"
        "gradient_accumulation = 4\nclip_grad_norm = 1.0\nNUM_MICRO_BATCHES = 8\n"
    )
    yml = tmp_path / "c.yaml"
    yml.write_text(
        "TRAIN_ITERS: 10\nparallel: {pipeline: 2, tensor: {size: 4, mode: '2.5d', depth: 1}}\n"
        "fp16: {mode: naive, initial_scale: 65536}\n"
        "gradient_handler: [{type: SequenceParallelGradientHandler}]\n"
        "gradient_accumulation: 4\nclip_grad_norm: 1.0\nnum_microbatches: 8\n"
    )
    a, b = gt.Config.from_file(py), gt.Config.from_file(yml)
    for c in (a, b):
        assert c.TRAIN_ITERS == 10
        assert c.parallel.pipeline.size == 2 and c.parallel.tensor.mode == "2.5d"
        assert c.fp16.mode is AMP_TYPE.NAIVE and c.fp16.initial_scale == 65536
        assert c.gradient_handler[0].type == "SequenceParallelGradientHandler"
        assert c.num_microbatches == 8, "legacy NUM_MICRO_BATCHES is accepted"
        assert c.data_size(16) == 2


def test_defaults():
    c = gt.Config.from_dict({})
    assert (c.pipeline_size, c.tensor_size, c.tensor_mode) == (1, 1, None)
    assert c.fp16 is None and c.gradient_accumulation == 1 and c.clip_grad_norm == 0.0


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(paralel=dict()), "unknown key 'paralel' — did you mean 'parallel'?"),
        (dict(parallel=dict(tensr=2)), "unknown key 'tensr' — did you mean 'tensor'?"),
        (
            dict(parallel=dict(tensor=dict(size=6, mode="2d"))),
            "2d needs a square tensor size, got 6",
        ),
        (
            dict(parallel=dict(tensor=dict(size=8, mode="2.5d", depth=3))),
            "2.5d needs tensor size = depth x q^2, got size 8 with depth 3",
        ),
        (dict(parallel=dict(tensor=dict(size=4, mode="3d"))), "3d needs a cubic tensor size"),
        (dict(parallel=dict(tensor=dict(size=2))), "tensor size 2 needs a mode"),
        (dict(parallel=dict(tensor=dict(size=2, mode="4d"))), "key 'parallel.tensor.mode'"),
        (dict(fp16=dict(mode="fp8")), "'torch', 'naive', 'apex' or 'bf16' (got 'fp8')"),
        (dict(gradient_accumulation=0), "key 'gradient_accumulation'"),
        (dict(clip_grad_norm=-1), "key 'clip_grad_norm'"),
        (
            dict(gradient_handler=[dict(type="DataParallelGradHandler")]),
            "did you mean 'DataParallelGradientHandler'",
        ),
    ],
)
def test_bad_configs_name_key_value_and_allowed(bad, message):
    with pytest.raises(gt.ConfigError) as err:
        gt.Config.from_dict(bad)
    assert message in str(err.value)


def test_world_size_checks_with_numbers():
    c = gt.Config.from_dict(dict(parallel=dict(pipeline=2, tensor=dict(size=4, mode="1d"))))
    with pytest.raises(
        gt.ConfigError, match="world size 6 is not divisible by pipeline 2 x tensor 4"
    ):
        c.check_world_size(6)
    m = gt.Config.from_dict(dict(moe=dict(expert_parallel_size=4)))
    with pytest.raises(
        gt.ConfigError, match="expert_parallel_size 4 must divide the data-parallel size 6"
    ):
        m.check_world_size(6)


def test_missing_or_wrong_file(tmp_path):
    with pytest.raises(gt.ConfigError, match="does not exist"):
        gt.Config.from_file(tmp_path / "nope.py")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(gt.ConfigError, match=r"must end in \.py, \.yaml or \.yml"):
        gt.Config.from_file(tmp_path / "c.json")
