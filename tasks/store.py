"""Opening the configured store, with S3 credentials from a Prefect Secret block if named."""
from __future__ import annotations

import json

from glmforge.config import StoreConfig
from runtime.store import Store, open_store

_ALLOWED = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "region_name", "endpoint_url"}


def configured_store(cfg: StoreConfig, uri: str | None = None) -> Store:
    """The store named by `uri` (CLI --store) or the config, with the config's S3 transfer settings;
    credentials never leave this call."""
    creds = None
    if cfg.credentials_block:
        from prefect.blocks.system import Secret

        value = Secret.load(cfg.credentials_block).get()
        creds = json.loads(value) if isinstance(value, str) else dict(value)
        unknown = set(creds) - _ALLOWED
        if unknown:
            raise ValueError(
                f"Secret block {cfg.credentials_block!r}: unknown keys {sorted(unknown)}; allowed: {sorted(_ALLOWED)}"
            )
    return open_store(uri or cfg.uri, creds, transfer=cfg.transfer.model_dump())
