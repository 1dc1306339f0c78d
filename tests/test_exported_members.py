import renqueue


def test_all_is_sorted_and_complete() -> None:
    assert renqueue.__all__ == sorted(renqueue.__all__)
    public = {name for name in dir(renqueue) if not name.startswith("_")}
    modules = {"backends", "client", "config", "connection", "embedded", "errors", "eventlog",
               "logs", "messages", "metrics", "provision", "router", "service", "subjects",
               "worker"}
    assert public - modules - {"annotations"} == set(renqueue.__all__)
