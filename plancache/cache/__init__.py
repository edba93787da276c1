"""The cache core: ``PlanCache`` (``cache``) and the life of a lookup below it.

``lookup`` finds, repairs or builds the plan of one key on one device, through the load
claims of ``loads`` (one thread per key and device loads, the others wait), the stored
tiers and the key's single flight (``flight``: thread lock, file lock, fleet lock).
``priming`` loads an application's recorded plans on a background thread, ``recording``
writes the graphs a program looks up into a manifest, and ``builder`` is the
``@cache.builder`` decorator.
"""

from .cache import PlanCache

__all__ = ["PlanCache"]
