import pytest

from vllm_fp4_moe_plugin import envs

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("value,expected", [(None, False), ("0", False), ("1", True),
                                            (" 1 ", True)])
def test_switch_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("VLLM_FP4_MOE_PLUGIN", raising=False)
    else:
        monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", value)
    assert envs.VLLM_FP4_MOE_PLUGIN is expected


@pytest.mark.parametrize("value", ["true", "yes", "2", "", "on"])
def test_switch_rejects_everything_else(monkeypatch, value):
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", value)
    with pytest.raises(ValueError) as err:
        envs.VLLM_FP4_MOE_PLUGIN
    msg = str(err.value)
    assert "VLLM_FP4_MOE_PLUGIN" in msg and "'0'" in msg and "'1'" in msg


def test_unknown_attribute():
    with pytest.raises(AttributeError):
        envs.NOT_A_VARIABLE
