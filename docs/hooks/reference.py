"""MkDocs hook: the reference pages (reference/config.md, cli.md, stages.md), generated from the
code at every build by glmforge.docs_reference.

The pages are added in `on_files` as generated File objects rather than written into docs/ at
`on_pre_build`: nothing generated lands in the source tree (no files to gitignore, none to go stale
or be committed by mistake), and a page of that name in docs/ is replaced, so the reference is
always the code's. A config field without a description is a warning, which the strict build
(`make docs`: mkdocs build --strict) turns into a failure. This folder is left out of the site
(mkdocs.yml: exclude_docs).
"""
from __future__ import annotations

import logging
import time

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.reference")


def on_files(files: Files, config) -> Files:
    from glmforge import docs_reference
    from glmforge.config import pipeline_model

    start = time.perf_counter()
    bare: dict[str, list[str]] = {}  # "module.Class.field" -> the config paths it appears at
    for path, info, owner in docs_reference.walk(pipeline_model()):
        # the sections themselves are the page's headings, documented by their class
        if "." in path and not (info.description or "").strip():
            name = path.rsplit(".", 1)[-1]
            cls = next((c for c in owner.__mro__ if name in c.__dict__.get("__annotations__", {})), owner)
            bare.setdefault(f"{cls.__module__}.{cls.__qualname__}.{name}", []).append(path)
    for where, paths in bare.items():
        log.warning("config field %s has no description (Field(..., description=...)); at %s%s", where,
                    ", ".join(paths[:3]), f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    for uri, content in docs_reference.pages().items():
        old = files.get_file_from_path(uri)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, uri, content=content))
    log.info("reference pages generated from the code in %.1f s", time.perf_counter() - start)
    return files
