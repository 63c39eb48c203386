import pytest
import torch

from elmo_service.errors import ConfigError
from elmo_service.scalar_mix import MixSpec, ScalarMix, apply_mix

torch.manual_seed(0)
L1, B, T, P = 3, 2, 5, 4
LAYERS = torch.randn(L1, B, T, 2 * P)
LAYERS[0, ..., P:] = LAYERS[0, ..., :P]  # layer 0 is [e ; e]


def test_standard_mix_is_gamma_times_softmax_weighted_sum():
    s = [0.5, -1.0, 2.0]
    mix = ScalarMix(L1, weights=s, gamma=1.7)
    w = torch.softmax(torch.tensor(s), 0)
    want = 1.7 * sum(w[j] * LAYERS[j] for j in range(L1))
    torch.testing.assert_close(mix(LAYERS), want)


def test_per_direction_mix_matches_formula():
    s = [0.1, 0.2, -0.3, 1.0, 0.0]  # s0, f1, f2, b1, b2
    mix = ScalarMix(L1, per_direction=True, weights=s, gamma=0.5)
    w = torch.softmax(torch.tensor(s), 0)
    e = LAYERS[0, ..., :P]
    fwd = w[0] * e + w[1] * LAYERS[1, ..., :P] + w[2] * LAYERS[2, ..., :P]
    bwd = w[0] * e + w[3] * LAYERS[1, ..., P:] + w[4] * LAYERS[2, ..., P:]
    torch.testing.assert_close(mix(LAYERS), 0.5 * torch.cat([fwd, bwd], -1))


@pytest.mark.parametrize("per_direction,count,expected", [(False, 2, 3), (True, 3, 5)])
def test_wrong_weight_count_names_expected(per_direction, count, expected):
    with pytest.raises(ConfigError, match=f"needs {expected} weights"):
        MixSpec([0.0] * count, per_direction=per_direction).validate(L1)
    with pytest.raises(ConfigError):
        ScalarMix(L1, per_direction=per_direction, weights=[0.0] * count)


def test_layer_norm_is_per_sentence():
    mix = ScalarMix(L1, layer_norm=True)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    both = mix(LAYERS, mask)
    alone = mix(LAYERS[:, 1:2, :3], mask[1:2, :3])
    torch.testing.assert_close(both[1, :3], alone[0])


def test_mix_is_trainable():
    mix = ScalarMix(L1)
    mix(LAYERS).sum().backward()
    assert mix.scalars.grad is not None and mix.gamma.grad is not None


def test_spec_round_trip_and_unbatched_input():
    spec = ScalarMix(L1, weights=[1.0, 2.0, 3.0], gamma=2.0).to_spec(task="x")
    again = MixSpec.from_dict(spec.to_dict())
    assert again.weights == [1.0, 2.0, 3.0] and again.gamma == 2.0 and again.meta == {"task": "x"}
    mix = ScalarMix.from_spec(again, L1)
    torch.testing.assert_close(mix(LAYERS[:, 0]), mix(LAYERS)[0])


def test_non_finite_weights_rejected():
    with pytest.raises(ConfigError, match="finite"):
        MixSpec([0.0, float("nan"), 0.0]).validate(L1)


@pytest.mark.parametrize("per_direction", [False, True])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_the_numpy_mix_is_the_trainable_modules(per_direction, layer_norm):
    """apply_mix (numpy, what the library and the API apply) and ScalarMix (torch, what the
    probes train) are one formula: held to each other per sentence."""
    n = 5 if per_direction else 3
    spec = MixSpec([0.3 * k - 0.4 for k in range(n)], 1.3, per_direction, layer_norm)
    module = ScalarMix.from_spec(spec, L1)
    for b in range(B):
        want = module(LAYERS[:, b]).detach().numpy()
        got = apply_mix(LAYERS[:, b].numpy(), spec)
        assert got.dtype.name == "float32"
        assert abs(got - want).max() <= 1e-5
