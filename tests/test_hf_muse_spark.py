"""Muse Spark (muse_spark, muse_spark_text): no family reads it yet, and from_hf says so by name.

Its attention heads are attn's mechanisms (qk_norm "fixed" with qk_scale_factor, layer_rope_theta's
NoPE layers, logit_softcap: tests/test_mechanisms_scales.py); its text model's residual gates,
input-scaled and weightless norms, per-head output norm and normed experts are not attn's blocks.
"""

import pytest

from attn import ConfigError
from attn.nn import hf

TEXT = dict(vocab_size=53, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, qk_scale_factor=5.47,
            layer_rope_theta=[500000.0, 0])


@pytest.mark.parametrize("model_type", ["muse_spark", "muse_spark_text"])
def test_refused_by_name_with_what_attn_lacks_before_any_weight(model_type):
  with pytest.raises(ConfigError, match=rf"model_type='{model_type}'.*Muse Spark.*residual gates"):
    hf.model_config({"model_type": model_type, **TEXT})
  with pytest.raises(ConfigError, match=rf"model_type='{model_type}'"):
    hf.from_hf(({"model_type": model_type, **TEXT}, {}))  # no tensors: the refusal comes first
