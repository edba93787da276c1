"""UBJSON as cuDNN Frontend writes plan blobs, for tests that make blobs of their own."""

from __future__ import annotations

from plancache.formats.ubjson import encode as ubjson

__all__ = ["ubjson"]
