# SPDX-License-Identifier: Apache-2.0
import pytest

from vllm_fp4_moe_plugin.base import envs


@pytest.mark.parametrize("value,expected", [(None, False), ("0", False), ("1", True)])
def test_switch_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("VLLM_FP4_MOE_PLUGIN", raising=False)
    else:
        monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", value)
    assert envs.VLLM_FP4_MOE_PLUGIN is expected


@pytest.mark.parametrize("value", ["true", "yes", "2", "", "on", " 1", "1 ", "0\n"])
def test_switch_rejects_everything_else(monkeypatch, value):
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", value)
    with pytest.raises(ValueError) as err:
        envs.VLLM_FP4_MOE_PLUGIN  # noqa: B018 (reading the variable is what raises)
    msg = str(err.value)
    assert "VLLM_FP4_MOE_PLUGIN" in msg and "'0'" in msg and "'1'" in msg


@pytest.mark.parametrize("value", ["off", "warn", "strict"])
def test_check_mode_values(monkeypatch, value):
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", value)
    assert envs.VLLM_FP4_MOE_PLUGIN_CHECK == value


@pytest.mark.parametrize("name,value,near", [("VLLM_FP4_MOE_PLUGIN", " 1", "1"),
                                             ("VLLM_FP4_MOE_PLUGIN_CHECK", "STRICT", "strict")])
def test_near_miss_is_an_error_that_says_what_was_meant(monkeypatch, name, value, near):
    """The README promises exact values; a value that only looks right is refused, with a hint."""
    monkeypatch.setenv(name, value)
    with pytest.raises(envs.EnvVarError, match=f"did you mean '{near}'"):
        getattr(envs, name)


def test_check_mode_default_and_error(monkeypatch):
    monkeypatch.delenv("VLLM_FP4_MOE_PLUGIN_CHECK", raising=False)
    assert envs.VLLM_FP4_MOE_PLUGIN_CHECK == "warn"
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", "loud")
    with pytest.raises(ValueError, match="VLLM_FP4_MOE_PLUGIN_CHECK='loud'.*'strict'"):
        envs.VLLM_FP4_MOE_PLUGIN_CHECK  # noqa: B018 (reading the variable is what raises)


def test_unknown_attribute():
    with pytest.raises(AttributeError):
        envs.NOT_A_VARIABLE  # noqa: B018 (reading the attribute is what raises)
