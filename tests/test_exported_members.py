"""The public API is what ``renqueue.__all__`` says, sorted, and nothing else."""

import types

import renqueue


def test_all_is_sorted_and_lists_every_public_name() -> None:
    assert renqueue.__all__ == sorted(renqueue.__all__)
    public = {
        name
        for name in dir(renqueue)
        if not name.startswith("_") and not isinstance(getattr(renqueue, name), types.ModuleType)
    }
    assert public - {"annotations"} == set(renqueue.__all__)
