"""Prefect flows: compose stages, nothing else."""
import tasks  # noqa: F401  (sets Prefect environment defaults before prefect is imported)
