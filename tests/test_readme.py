"""The README's config reference names every engine key of the schema."""

from pathlib import Path

from gridtrain.config import Config, Fp16Config, MoeConfig, PipelineConfig, TensorConfig

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_every_engine_key_is_documented():
    keys = [k for k in Config.model_fields if k != "source"]
    keys += [f"parallel.pipeline.{k}" for k in PipelineConfig.model_fields]
    keys += [f"parallel.tensor.{k}" for k in TensorConfig.model_fields]
    keys += [f"fp16.{k}" for k in Fp16Config.model_fields]
    keys += [f"moe.{k}" for k in MoeConfig.model_fields]
    missing = [k for k in keys if f"`{k}`" not in README]
    assert not missing, f"README config reference lacks {missing}"
