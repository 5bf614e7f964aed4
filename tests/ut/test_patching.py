# SPDX-License-Identifier: Apache-2.0
"""The patch primitive, on throwaway modules (ArcticInference tests/test_patching.py style)."""

import sys
import types

import pytest

from vllm_fp4_moe_plugin.patches.patching import (
    ModulePatch,
    PatchConflictError,
    same_named_subclass,
)


@pytest.fixture
def target_module():
    mod = types.ModuleType("fp4_moe_throwaway_target")
    mod.Thing = type("Thing", (), {"x": 1})
    mod.build = lambda orig: type(orig.__name__, (orig,), {"x": 2})  # the builder, by name
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _patch():
    return ModulePatch(module="fp4_moe_throwaway_target", attr="Thing",
                       build="fp4_moe_throwaway_target:build", needed=lambda findings: True,
                       why="w", how="h", upstream="u", remove_when="r")


def test_apply_is_idempotent_and_revertible(target_module):
    original = target_module.Thing
    patch = _patch()
    assert patch.apply() is True
    replaced = target_module.Thing
    assert replaced is not original and issubclass(replaced, original)
    assert replaced.__name__ == "Thing" and replaced.x == 2
    assert patch.apply() is False and target_module.Thing is replaced
    assert patch.original() is original
    assert patch.revert() is True and target_module.Thing is original
    assert patch.revert() is False


def test_refuses_to_stack_on_a_foreign_replacement(target_module):
    patch = _patch()
    patch.apply()
    target_module.Thing = type("Thing", (), {})  # someone else patched after us
    with pytest.raises(PatchConflictError, match="fp4_moe_throwaway_target.Thing"):
        patch.apply()
    patch.revert()


def test_same_named_subclass_keeps_name_and_doc_and_puts_the_mixin_first(target_module):
    target_module.Thing.__doc__ = "upstream's doc"
    mixin = type("Mixin", (), {"x": 3})
    cls = same_named_subclass(target_module.Thing, mixin, "somewhere", y=4)
    assert (cls.__name__, cls.__doc__, cls.__module__) == ("Thing", "upstream's doc", "somewhere")
    assert cls.__mro__[1:3] == (mixin, target_module.Thing) and (cls.x, cls.y) == (3, 4)
