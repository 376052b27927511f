"""Implicit feedback: the estimator, its ranking metrics and a train/test split by user."""

from __future__ import annotations

from .metrics import ranking_metrics_at_k, train_test_split
from .model import ImplicitALS

__all__ = ["ImplicitALS", "ranking_metrics_at_k", "train_test_split"]
