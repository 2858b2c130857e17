"""Prefect tasks: thin wrappers that run library stages with retries, progress and artifacts."""
import logging
import os

# Ephemeral Prefect needs more than the default startup time on a 2-core machine, and its
# analytics only add noise. Set before prefect is imported anywhere.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Library code logs to the "glmforge" logger (it does not import Prefect); show it in Prefect runs.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "glmforge")
# Prefect gives that logger its API handler but no level, so it inherits the root's WARNING and
# its INFO lines (a stage waiting for another run's lease, a checkpoint restored) reached
# neither the run's log nor stderr.
logging.getLogger("glmforge").setLevel(logging.INFO)
