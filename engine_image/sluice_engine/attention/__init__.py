"""Attention backends over the paged KV cache. Each implements `AttentionBackend`."""

from __future__ import annotations

from .backend import AttentionBackend, select_backend

__all__ = ["AttentionBackend", "select_backend"]
