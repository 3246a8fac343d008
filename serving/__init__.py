"""dayzero.serving: the engine side (paged caches, scheduler, jitted prefill/decode steps, sampling).

This release ships the request error type the engine uses; the engine itself lands with the serving issue.
"""

from dayzero.model.errors import RequestError

__all__ = ["RequestError"]
