from __future__ import annotations

from ..registry import Registry

METHODS: Registry[type] = Registry("method")
