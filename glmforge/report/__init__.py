"""One HTML page of a whole run: what `glmforge report` writes and the pipeline flow links to.

Everything comes from the store alone: the run record (runs/ID.json), the manifests of the run's
artifacts and the small files the stages publish in them (metrics.jsonl, gates.json, the quality
histogram). So the page is the same for a local or an S3 store, and it can be written for a
finished, failed or running run. It is self-contained: inline CSS, charts as base64 PNGs
(matplotlib), no script and nothing fetched (a Content-Security-Policy says so to the browser),
so it opens from disk and can be mailed. Every string is escaped; a metric a stage did not record
shows as "not recorded", never as 0.

Sections: the run and its stages (states, wall time, the command that resumes a failed stage),
the curation funnel, training (loss curves, context phases, DSA warm-up, long context), SFT and
INT4 (the quantization table), post-training (rewards, held-out accuracy, masked shares,
staleness, reward model, gates, reward re-checks), and lineage (artifacts, parents, digests).

Numbers sit in cells marked data-metric="STAGE.path.to.metric", which the tests compare with
`glmforge status --json`.

Modules: page (the header, the CSS, the page put together and written), one per section family
(curation, training, quantization: SFT and INT4, posttraining: rewards, RL, judges, swe-envs,
rl-prompts, gates: gates and effects, lineage), data (RunData: what is read from the store) and
pieces (cells, tables, formats, charts).
"""
from __future__ import annotations

from glmforge.report.data import RunData
from glmforge.report.page import default_out_dir, render, summary_markdown, write_report
from glmforge.report.pieces import NOT_RECORDED

__all__ = ["NOT_RECORDED", "RunData", "default_out_dir", "render", "summary_markdown", "write_report"]
