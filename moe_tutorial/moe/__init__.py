"""The model the course teaches: config, routing, experts, the model, HF interop."""

from . import sync_free  # noqa: F401  (registers the sync-free expert backends)
