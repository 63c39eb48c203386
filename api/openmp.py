"""OpenMP settings for serving, applied before torch loads libgomp (no torch imported here):
a brief spin of idle threads (``elmo_service/openmp.py`` says why and what it measured)."""

from __future__ import annotations

from elmo_service.openmp import SPINCOUNT as SERVE_SPINCOUNT
from elmo_service.openmp import spin_briefly as openmp_env_for_serving

__all__ = ["SERVE_SPINCOUNT", "openmp_env_for_serving"]
