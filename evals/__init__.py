"""Evaluations that need a model: synthetic long-context retrieval (long_context)."""
