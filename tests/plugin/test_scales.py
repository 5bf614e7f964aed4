import pytest
import torch

from vllm_fp4_moe_plugin import scales

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("bad,kind", [(float("nan"), "NaN"), (float("inf"), "inf"),
                                      (0.0, "zero"), (-2.0, "negative")])
def test_bad_scale_names_layer_tensor_and_expert(bad, kind):
    t = torch.tensor([[1.0, 1.0], [0.5, 0.5], [2.0, bad]])
    with pytest.raises(scales.InvalidScaleError) as err:
        scales.check_positive_finite(t, layer="model.layers.3.mlp.experts",
                                     name="w13_input_scale")
    msg = str(err.value)
    assert "model.layers.3.mlp.experts" in msg and "'w13_input_scale'" in msg
    assert kind in msg and "expert index 2" in msg


def test_good_scales_pass():
    scales.check_positive_finite(torch.tensor([1e-8, 3.0, 448.0]), layer="l", name="n")
    scales.check_positive_finite(torch.tensor(2.0), layer="l", name="n")


def test_shared_scalar_rebuilds_alphas_exactly():
    gs = torch.tensor([100.0, 400.0, 250.0])
    ws2 = torch.tensor([0.01, 0.02, 0.03])
    g = scales.agree_min_scale(gs)  # no group: this rank only
    chosen = scales.shared_scalar_scales(g, ws2)
    assert chosen.shared and chosen.a1_gscale.dim() == 0
    assert float(chosen.a1_gscale) == 100.0
    # Reference check: alpha_e * g must reproduce each expert's weight scale.
    torch.testing.assert_close(chosen.g1_alphas * chosen.a1_gscale, ws2)


def test_per_expert_keeps_vectors():
    gs = torch.tensor([100.0, 400.0])
    alphas = torch.tensor([1e-4, 5e-5])
    chosen = scales.per_expert_scales(gs, alphas)
    assert not chosen.shared
    assert torch.equal(chosen.a1_gscale, gs) and torch.equal(chosen.g1_alphas, alphas)
