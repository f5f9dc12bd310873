"""DeepSeek-V3's variants against transformers: YaRN rope (frequencies, cos/sin scale and softmax
temperature), a plain query projection (no q_lora_rank), rotary on halves (no rope_interleave)."""
import pytest
from models.test_parity import check_against, load_reference
from tiny import build_checkpoint

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=8, beta_slow=1)
VARIANTS = {
    "yarn": dict(rope_parameters=YARN),
    "plain-query": dict(q_lora_rank=None),
    "rope-halves": dict(rope_interleave=False, attention_bias=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_transformers(variant, tmp_path):
    hf = build_checkpoint(tmp_path / "hf", "deepseek_v3", **VARIANTS[variant])
    packed = convert(hf, tmp_path / "packed", quant="none")
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    check_against(engine, load_reference(hf))
    engine.close()
