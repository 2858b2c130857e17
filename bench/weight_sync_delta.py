"""Weight sync by delta vs whole (rl.weight_sync, rl.served): the bytes one RL policy version
costs when every byte is published, and when only what changed since the version the servers
hold (XOR with the last version, then zstd), with the seconds to publish and to load it.

For each preset (the model at its shapes, random weights, vocabulary 300) and dtype (fp32, as the
CPU stages train; bf16, as GPU weights are served), the policy takes `--steps` AdamW steps on a
language-model loss at each RL learning rate in `--lr` (the presets' rl-reasoning 1e-4, and GLM-5's
1e-6), each step a version: version 0 whole, then deltas. The ratio
printed is whole bytes / delta bytes per version, measured side by side on the same versions.

    .venv/bin/python bench/weight_sync_delta.py [--presets tiny small] [--steps 3] [--lr 1e-4 1e-6] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model.config import preset  # noqa: E402
from model.model import GLMModel  # noqa: E402
from rl import weight_sync  # noqa: E402


def measure(name: str, dtype: torch.dtype, steps: int, lr: float, vocab: int = 300) -> dict:
    torch.manual_seed(0)
    model = GLMModel(preset(name).model_copy(update={"vocab_size": vocab}))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    tokens = torch.randint(0, vocab, (4, 64))

    def served() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}

    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        base = served()
        weight_sync.publish(root, 0, base, config_json=model.config.model_dump_json())
        for v in range(1, steps + 1):
            logits = model(tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            now = served()
            delta = weight_sync.publish(root, v, now, base=(v - 1, base))
            t = time.perf_counter()
            _, held, _ = weight_sync.load_version(root, v - 1)
            _, state, _ = weight_sync.load_version(root, v, held=(v - 1, held))
            load_delta_s = time.perf_counter() - t
            assert all(torch.equal(state[k], now[k]) for k in now), "a delta did not land the version's bytes"
            with tempfile.TemporaryDirectory() as w:
                whole = weight_sync.publish(Path(w), v, now)
                t = time.perf_counter()
                weight_sync.load_version(Path(w), v)
                load_whole_s = time.perf_counter() - t
            changed = sum(int((now[k] != base[k]).sum()) for k in now) / sum(t.numel() for t in now.values())
            rows.append({"version": v, "whole_bytes": whole.bytes, "delta_bytes": delta.bytes,
                         "publish_whole_s": whole.seconds, "publish_delta_s": delta.seconds,
                         "load_whole_s": load_whole_s, "load_delta_s": load_delta_s, "changed_fraction": changed})
            base = now
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"preset": name, "dtype": str(dtype).removeprefix("torch."), "lr": lr,
            "params": sum(p.numel() for p in model.parameters()), "versions": rows,
            "whole_bytes": med("whole_bytes"), "delta_bytes": med("delta_bytes"),
            "ratio": med("whole_bytes") / med("delta_bytes"), "changed_fraction": med("changed_fraction"),
            "publish_s": {"whole": med("publish_whole_s"), "delta": med("publish_delta_s")},
            "load_s": {"whole": med("load_whole_s"), "delta": med("load_delta_s")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-4, 1e-6])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(p, dt, args.steps, lr) for p in args.presets for lr in args.lr
            for dt in (torch.float32, torch.bfloat16)]
    out = {"rows": rows, "settings": {"steps": args.steps, "optimizer": "AdamW", "vocab": 300}}
    for r in rows:
        print(f"{r['preset']:6s} lr {r['lr']:.0e} {r['dtype']:8s} {r['params']:>11,} params: whole {r['whole_bytes'] / 2**20:8.2f} MiB, "
              f"delta {r['delta_bytes'] / 2**20:8.2f} MiB per version = {r['ratio']:.2f}x fewer bytes "
              f"({r['changed_fraction']:.0%} of the values changed); publish {r['publish_s']['whole']:.2f} -> "
              f"{r['publish_s']['delta']:.2f} s, load {r['load_s']['whole']:.2f} -> {r['load_s']['delta']:.2f} s")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
