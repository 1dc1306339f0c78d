"""Every command, registered on the root group by importing its module."""

from . import _ab, _audit, _dlq, _gateway, _init, _replay, _services, _status, _submit, _tools

__all__ = [
    "_ab",
    "_audit",
    "_dlq",
    "_gateway",
    "_init",
    "_replay",
    "_services",
    "_status",
    "_submit",
    "_tools",
]
