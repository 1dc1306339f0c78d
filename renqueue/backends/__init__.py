"""Backend adapters: one protocol, one implementation per wire format."""

from .base import Backend, Delta, Generation
from .openai import OpenAIBackend

__all__ = ["Backend", "Delta", "Generation", "OpenAIBackend", "make_backend"]


def make_backend(name: str, config: "BackendConfig", **kwargs: object) -> Backend:  # noqa: F821
    """Build the adapter a backend's config names."""
    from ..config import BackendConfig  # noqa: F401 - for the annotation

    if config.adapter == "openai":
        return OpenAIBackend(name, config, **kwargs)  # type: ignore[arg-type]
    raise ValueError(f"unknown adapter {config.adapter!r}")
