"""``elmo_service/outputs.py`` on its own: the options checked together and named, the
default policies written once, and ``render`` copying nothing it does not change."""

from __future__ import annotations

import numpy as np
import pytest

from elmo_service.errors import ConfigError, InputError
from elmo_service.outputs import plan_output, render, resolve_output
from elmo_service.scalar_mix import MixSpec
from elmo_service.tokenizers import Token

N = 3
TOKENS = [Token("a", 0, 1, 0), Token("b", 2, 3, 1), Token("c", 4, 5, 2)]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"task": "t", "mix": MixSpec([0.0] * N)}, "mix"),
        ({"output": "layers", "task": "t"}, "task"),
        ({"output": "layers", "mix": MixSpec([0.0] * N)}, "mix"),
        ({"output": "mix", "layers": [0]}, "layers"),
        ({"layers": []}, "layers"),
        ({"layers": [0, 3]}, "layers[1]"),
        ({"layers": [1, 1]}, "layers[1]"),
        ({"granularity": "char"}, "granularity"),
        ({"pooling": "sum"}, "pooling"),
        ({"output": "all"}, "output"),
    ],
)
def test_bad_options_are_named(options, field):
    with pytest.raises(InputError) as e:
        plan_output(N, **options)
    assert e.value.field == field


def test_an_inline_mix_is_checked_against_the_model():
    with pytest.raises(ConfigError) as e:
        plan_output(N, mix=MixSpec([0.0] * N, gamma=float("inf")))
    assert e.value.field == "gamma"
    with pytest.raises(ConfigError) as e:
        plan_output(N, mix=MixSpec([0.0] * (N + 1)))
    assert e.value.field == "mix"


def test_defaults_output_and_mix_policy():
    assert plan_output(N).output == "layers" and plan_output(N).layers == (0, 1, 2)
    assert plan_output(N, task="t").output == "mix" and plan_output(N, task="t").pending == "t"
    stored = MixSpec([1.0, 2.0, 3.0], gamma=2.0)
    # no task named 'default': the plain average; one stored: it, named
    avg = resolve_output(N, {}.get, output="mix")
    assert avg.mix.weights == [0.0] * N and avg.task is None
    got = resolve_output(N, {"default": stored}.get, output="both")
    assert got.mix is stored and got.task == "default" and got.layers == (0, 1, 2)
    # a task named explicitly must exist, 'default' included
    with pytest.raises(InputError) as e:
        resolve_output(N, {}.get, task="default")
    assert e.value.field == "task"
    with pytest.raises(ConfigError) as e:  # stored before a bound existed: refused
        resolve_output(N, {"default": MixSpec([0.0, 1e9, 0.0])}.get, output="mix")
    assert e.value.field == "task" and "'default' cannot be used" in e.value.message


def test_render_copies_nothing_it_does_not_change():
    layers = np.random.default_rng(0).standard_normal((N, 3, 4)).astype(np.float32)
    x, m = render(layers, TOKENS, plan_output(N, granularity="word"))  # one piece per word
    assert x is layers and m is None
    x, _ = render(layers, TOKENS, plan_output(N, layers=[2, 0]))
    np.testing.assert_array_equal(x, layers[[2, 0]])


def test_render_mixes_token_layers_before_averaging_words():
    """With a layer norm the order matters: the norm sees the model's token positions."""
    rng = np.random.default_rng(1)
    layers = rng.standard_normal((N, 4, 2)).astype(np.float32) * [[[1.0]], [[5.0]], [[0.1]]]
    tokens = [Token("a", 0, 1, 0), Token("b", 1, 2, 0), Token("c", 2, 3, 0), Token("d", 4, 5, 1)]
    mix = MixSpec([0.3, 1.0, -0.5], gamma=1.7, layer_norm=True)
    spec = resolve_output(N, {}.get, mix=mix, granularity="word")
    _, words = render(layers, tokens, spec)
    _, per_token = render(layers, tokens, resolve_output(N, {}.get, mix=mix))
    np.testing.assert_allclose(words[0], per_token[:3].mean(0), atol=1e-6)
    np.testing.assert_allclose(words[1], per_token[3], atol=1e-6)
    with pytest.raises(ValueError, match="still to look up"):
        render(layers, tokens, plan_output(N, task="t"))
