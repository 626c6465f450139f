"""attn.testing catches, by name, the faults a third party's record can have.

Each broken record is a small variation of per_head (dataclasses.replace); the
kit must say which property failed, for which record and config, with numbers.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import attn
from attn import ConfigError, testing
from attn.variants import mechanisms

PER_HEAD = attn.VARIANTS["per_head"]


def test_a_declared_count_off_by_one_is_caught():
  bad = dataclasses.replace(PER_HEAD, name="off_by_one", param_count=lambda cfg: PER_HEAD.param_count(cfg) + 1)
  with pytest.raises(AssertionError, match=r"param_count: variant 'off_by_one' at HeadConfig\(d_model=24, "
                                           r".*declared (\d+), stored (\d+)") as e:
    testing.check_variant(bad)
  declared, stored = (int(n) for n in str(e.value).rsplit("declared ", 1)[1].split(", stored "))
  assert declared == stored + 1


def _peeking_apply(params, x_BTD, context_BSD=None, *, cfg, opts=attn.api.Options()):
  return PER_HEAD.apply(params, x_BTD, context_BSD, cfg=cfg, opts=opts.replace(is_causal=False))


@pytest.mark.slow
def test_a_token_that_sees_a_later_one_is_caught():
  bad = dataclasses.replace(PER_HEAD, name="peeks", apply=_peeking_apply)
  with pytest.raises(AssertionError, match=r"causal: variant 'peeks' at .*under is_causal, outputs 0..2 "
                                           r"after changing tokens 3..4: max \|difference\| [0-9.e-]+ >"):
    testing.check_variant(bad)


def _maskless_apply(params, x_BTD, context_BSD=None, *, cfg, opts=attn.api.Options()):
  return PER_HEAD.apply(params, x_BTD, context_BSD, cfg=cfg, opts=opts.replace(mask=None))


def test_a_variant_that_ignores_the_mask_is_caught():
  bad = dataclasses.replace(PER_HEAD, name="maskless", apply=_maskless_apply)
  # At one plain awkward config (G < H, d_v != d_k): the mask is ignored with or without mechanisms, and the
  # kit's default config, every mechanism on, costs three times the CPU to reach the same check.
  with pytest.raises(AssertionError, match=r"mask: variant 'maskless' at HeadConfig\(d_model=24, .*fully masked "
                                           r"row 1 has weights up to"):
    testing.check_variant(bad, configs=(testing.AWKWARD["gqa_dv_ne_dk"],))


def test_a_mechanism_count_off_by_one_is_caught():
  sinks = mechanisms.MECHANISMS["sinks"]
  bad = dataclasses.replace(sinks, name="sinks_off", fields=(), sharding={"sinks": "H"},
                            param_count=lambda cfg: cfg.num_heads + 1, check=None, examples=())
  with pytest.raises(AssertionError, match="param_count: variant 'per_head' at .*mechanism 'sinks_off' "
                                           "declares 7, adds 6"):
    testing.check_mechanism(bad)
  assert "sinks_off" not in mechanisms.MECHANISMS  # registered only while it was checked


def test_apply_of_the_wrong_shape_and_init_not_a_dict_are_named():
  half = dataclasses.replace(PER_HEAD, name="half", kv_cache_width=None,
                             apply=lambda p, x, c=None, *, cfg, opts=None: (x[:, :2], None))
  with pytest.raises(AssertionError, match=r"check_variant\('half'\): shapes: variant 'half' at HeadConfig\(.*\): "
                                           r"raised ConfigError: half.apply\(...\)\[0\].shape=\(2, 2, 24\) is not "
                                           r"allowed: \(2, 5, 24\)") as e:
    testing.check_variant(half)
  assert isinstance(e.value.__cause__, ConfigError)
  listy = dataclasses.replace(PER_HEAD, name="listy", init=lambda key, cfg, dtype=jnp.float32: [1.0])
  with pytest.raises(ConfigError, match=r"listy.init\(...\)='list' is not allowed: a dict of arrays"):
    attn.init(listy, jax.random.PRNGKey(0), testing.AWKWARD["gqa_dv_ne_dk"])
  with pytest.raises(AssertionError, match=r"check_variant\('listy'\): .*listy.init\(...\)='list' is not allowed"):
    testing.check_variant(listy)


def test_the_kit_refuses_what_is_not_a_record():
  with pytest.raises(ConfigError, match="variant='nope' is not allowed: one of"):
    testing.check_variant("nope")
  with pytest.raises(ConfigError, match="mechanism=3 is not allowed: an attn Mechanism record"):
    testing.check_mechanism(3)


def _truncating(params, logits_BHTS, *, cfg):  # drops the last key: the logits' shape changes
  return logits_BHTS[..., :-1]


def _missing_option(params, logits_BHTS, *, cfg):
  return logits_BHTS * mechanisms.options(cfg, "missing_option")["factor"]  # no such option: KeyError


def test_a_hook_that_changes_the_logits_shape_is_named_with_its_mechanism_and_config():
  bad = attn.Mechanism(name="truncating", on_logits=_truncating)
  with pytest.raises(AssertionError, match=r"check_mechanism\('truncating'\): shapes: variant 'per_head' at "
                                           r"HeadConfig\(d_model=24, .*extra=\{'truncating': \{\}\}\): in "
                                           r"mechanism 'truncating'.on_logits, raised HookError: .*returned logits of "
                                           r"shape \(2, 6, 5, 4\) for logits of shape \(2, 6, 5, 5\)") as e:
    testing.check_mechanism(bad)
  assert isinstance(e.value.__cause__, mechanisms.HookError) and e.value.__cause__.hook == "on_logits"
  assert "truncating" not in mechanisms.MECHANISMS


def test_an_exception_inside_a_hook_names_the_hook_and_is_chained():
  bad = attn.Mechanism(name="missing_option", defaults={"scale": 1.0}, on_logits=_missing_option)
  with pytest.raises(AssertionError, match=r"check_mechanism\('missing_option'\): shapes: variant 'per_head' at "
                                           r"HeadConfig\(.*\): in mechanism 'missing_option'.on_logits, raised "
                                           r"KeyError: 'factor'") as e:
    testing.check_mechanism(bad)
  assert isinstance(e.value.__cause__, KeyError)


def _broken_check(cfg):
  return cfg.extra["broken_check"]["width"]  # no such option: a KeyError, not a ConfigError


def test_a_check_that_raises_is_named_with_its_hook():
  bad = attn.Mechanism(name="broken_check", check=_broken_check, on_logits=lambda p, l, *, cfg: l)
  with pytest.raises(AssertionError, match=r"check_mechanism\('broken_check'\): configs: in mechanism "
                                           r"'broken_check'.check, raised KeyError: 'width'") as e:
    testing.check_mechanism(bad)
  assert isinstance(e.value.__cause__, KeyError)


def test_a_pass_says_what_it_checked_when_asked(capsys):
  scale = attn.Mechanism(name="halved", on_logits=lambda params, logits_BHTS, *, cfg: logits_BHTS * 0.5)
  testing.check_mechanism(scale)
  assert capsys.readouterr().out == ""  # silent unless asked
  testing.check_mechanism(scale, verbose=True)
  lines = capsys.readouterr().out.splitlines()
  # per_head at the kit's first awkward config with the mechanism on, then the FLOPs config
  assert lines[0] == ("check_mechanism('halved'): passed 10 properties at 2 configs: sharding, param_count, "
                      "shapes, mask, causal, grads, bf16, head_mask, decoding, flops")
  assert len(lines) == 3 and all(line.startswith("  HeadConfig(") for line in lines[1:])


def test_a_mechanism_whose_flops_are_off_is_caught():
  gate = mechanisms.MECHANISMS["gate"]
  # A copy on the same field, declaring twice the FLOPs it computes: with gate set both act (XLA's
  # count before optimisation has the gate twice), and the copy's declaration is off by its own.
  bad = dataclasses.replace(gate, name="gate_doubled", flops=lambda cfg, T, S: 2 * gate.flops(cfg, T, S))
  with pytest.raises(AssertionError, match=r"flops: variant 'per_head' at HeadConfig\(d_model=48, .*gate='elementwise'"
                                           r".*declared (\d+) with mechanism 'gate_doubled' \((\d+) of it\) "
                                           r"\(fwd, T=4, S=12\), XLA counts (\d+)") as e:
    testing.check_mechanism_counts(bad)
  found = re.search(r"declared (\d+) .*\((\d+) of it\).*XLA counts (\d+)", str(e.value))
  declared, copy, xla = (int(n) for n in found.groups())
  assert copy > 0.20 * xla and abs(xla - (declared - copy // 2)) <= 0.10 * xla  # declared once, it agrees


def test_a_mechanism_whose_effective_count_is_off_by_one_is_caught():
  sinks = mechanisms.MECHANISMS["sinks"]
  # A copy on the same field: with sinks=True both act, the built-in's H plus the copy's one more.
  bad = dataclasses.replace(sinks, name="sinks_eff_off", effective_param_count=lambda cfg: 1)
  with pytest.raises(AssertionError, match=r"effective_param_count: variant 'per_head' at HeadConfig\(d_model=4, "
                                           r".*sinks=True.*declared (\d+) \(variant \d+ \+ mechanisms 5\), "
                                           r"the Jacobian's rank is (\d+)") as e:
    testing.check_mechanism_counts(bad)
  declared, rank = (int(n) for n in re.search(r"declared (\d+) .*rank is (\d+)", str(e.value)).groups())
  assert declared == rank + 1
  assert "sinks_eff_off" not in mechanisms.MECHANISMS
