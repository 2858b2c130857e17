"""Per-step training metrics: a JSONL log that survives restarts, TensorBoard events, a PNG.

Rank 0 appends one JSON object per optimizer step to `metrics.jsonl` in the checkpoint
directory (it must survive a crash with the checkpoints). Before a resumed run starts, records
after the resumed step are dropped (those steps run again), so the log holds every step exactly
once. At the end of the stage the log is turned into TensorBoard event files and a loss curve
under the stage's output directory.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Fields of a step record (besides "step"): loss = lm + mtp + balance, as optimized.
SCALARS = ("loss", "lm", "mtp", "balance", "lr", "grad_norm", "tokens_per_s", "expert_load_max_mean")


def append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def read(path: Path) -> list[dict[str, Any]]:
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().split("\n"):  # not splitlines(): U+2028 may sit in a string
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a kill mid-write is dropped; its step reruns
                break
    return out


def truncate(path: Path, last_step: int) -> None:
    """Keep the records of steps 1..last_step (the ones the resumed checkpoint contains)."""
    kept = [r for r in read(path) if r["step"] <= last_step]
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


def first_last(records: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """Mean of `key` over the first and the last tenth of the records that have it (at least one)."""
    vals = [r[key] for r in records if r.get(key) is not None]
    if not vals:
        return None
    k = max(1, len(vals) // 10)
    return {"first": sum(vals[:k]) / k, "last": sum(vals[-k:]) / k}


def write_tensorboard(records: list[dict[str, Any]], log_dir: Path, extra: dict[str, float] | None = None,
                      keys: tuple[str, ...] | list[str] = SCALARS) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(log_dir))
    for r in records:
        for k in keys:
            v = r.get(k)
            if isinstance(v, (int, float)) and math.isfinite(v):
                w.add_scalar(f"train/{k}", v, r["step"])
    for k, v in (extra or {}).items():
        if isinstance(v, (int, float)) and math.isfinite(v):
            w.add_scalar(f"eval/{k}", v, records[-1]["step"] if records else 0)
    w.close()


def plot_loss(records: list[dict[str, Any]], png: Path, title: str, val: dict[str, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], label="train loss (lm+mtp+balance)")
    ax.plot(steps, [r["lm"] for r in records], label="train lm loss", alpha=0.7)
    if val:
        ax.scatter([0, steps[-1] if steps else 0], [val["val_loss_before"], val["val_loss_after"]],
                   color="red", zorder=3, label="held-out lm loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage metrics from the step log: first/last losses, last lr, grad norm, MoE load, speed."""
    if not records:
        return {}
    last = records[-1]
    tail = records[-max(1, min(10, len(records) // 5)):]
    speeds = sorted(r["tokens_per_s"] for r in records if r.get("tokens_per_s"))
    out = {
        "steps": last["step"],
        "tokens": last["tokens"],
        "loss_first": records[0]["loss"],
        "loss_last": sum(r["loss"] for r in tail) / len(tail),
        "lm_loss_last": sum(r["lm"] for r in tail) / len(tail),
        "mtp_loss_last": sum(r["mtp"] for r in tail) / len(tail),
        "lr_last": last["lr"],
        "grad_norm_last": last.get("grad_norm"),
        "expert_load_max_mean": last.get("expert_load_max_mean"),
        "tokens_per_s": speeds[len(speeds) // 2] if speeds else None,
    }
    # metrics an objective adds beyond loss/lm/mtp/balance (e.g. the DSA indexer's KL)
    standard = {"step", "tokens", "loss", "lm", "mtp", "balance", "lr", "grad_norm", "tokens_per_s",
                "expert_load_max_mean"}
    for key in sorted(set(last) - standard):
        if isinstance(last[key], (int, float)):
            out[f"{key}_last"] = sum(r.get(key, 0.0) for r in tail) / len(tail)
    return out
