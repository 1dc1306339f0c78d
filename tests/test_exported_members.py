"""The public API is what ``renqueue.__all__`` says, sorted, and nothing else."""

import types

import renqueue
from renqueue import policy


def test_all_is_sorted_and_lists_every_public_name() -> None:
    assert renqueue.__all__ == sorted(renqueue.__all__)
    public = {
        name
        for name in dir(renqueue)
        if not name.startswith("_") and not isinstance(getattr(renqueue, name), types.ModuleType)
    }
    assert public - {"annotations"} == set(renqueue.__all__)


def test_the_policy_package_exports_its_decisions_in_a_sorted_all() -> None:
    """renqueue.policy's modules are private; its __all__ (constants, classes,
    functions, each group sorted, as ruff's RUF022 orders it) is the whole of it."""

    def group(name: str) -> int:
        return 0 if name.isupper() else 1 if name[0].isupper() else 2

    assert policy.__all__ == sorted(policy.__all__, key=lambda name: (group(name), name))
    public = {
        name
        for name in dir(policy)
        if not name.startswith("_") and not isinstance(getattr(policy, name), types.ModuleType)
    }
    assert public == set(policy.__all__)
