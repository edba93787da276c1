"""The cache core: ``PlanCache`` (``cache``) and the life of a lookup below it, one step per
module (``cache``'s docstring lists them)."""

from .cache import PlanCache

__all__ = ["PlanCache"]
