"""Decode benchmark: speculative decoding with the MTP draft (3 tokens) vs plain greedy, on CPU.

An untrained MTP module accepts almost nothing, so the script first trains the tiny model
briefly (LM + MTP loss) on real text -- the Python standard library's own source, read from
sysconfig.get_paths()["stdlib"] and tokenised at byte level (vocab 256) -- then decodes the
same held-out prompts both ways and reports tokens/s, mean acceptance length and the speed-up.
Greedy speculative output must equal plain greedy output; the script checks it.

    .venv/bin/python bench/decode.py [--train-seconds 120] [--new-tokens 128] [--json]

Training runs with dense attention (sequences of --seq-len tokens; the indexer is not trained
here), decoding likewise, so both decoders run the same model.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

from model.config import preset
from model.generate import generate
from model.hf import load_state, save_state
from model.model import GLMModel
from model.speculative import speculative_generate


def stdlib_bytes(max_bytes: int, seed: int) -> tuple[bytes, bytes]:
    """(train, held-out) byte strings from the stdlib's .py files, split by file."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    held, train = files[:10], files[10:]
    read = lambda fs, n: b"".join(f.read_bytes() for f in fs)[:n]  # noqa: E731
    return read(train, max_bytes), read(held, 200_000)


def train(model: GLMModel, data: torch.Tensor, seconds: float, seq_len: int, batch: int, lr: float,
          seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    device = next(model.parameters()).device
    losses, t0, step = [], time.time(), 0
    while time.time() - t0 < seconds:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        # batches are cut on CPU (same generator, same data on any device), then moved
        x = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).to(device)
        warm = min(1.0, (step + 1) / 20)
        for group in opt.param_groups:
            group["lr"] = lr * warm
        out = model(x[:, :-1], labels=x[:, 1:])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.losses["lm"].item())
        if step % 20 == 0:
            print(f"step {step:4d}  lm {out.losses['lm'].item():.3f}  mtp {out.losses['mtp'].item():.3f}"
                  f"  {time.time() - t0:5.1f}s", file=sys.stderr, flush=True)
        step += 1
    model.eval()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-seconds", type=float, default=120)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--train-threads", type=int, default=1)
    ap.add_argument("--decode-threads", type=int, default=1)
    ap.add_argument("--draft-threshold", type=float, default=0.0,
                    help="stop drafting when the draft's probability falls below this (0 = always 3)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and decoder (best kept)")
    ap.add_argument("--mtp-loss-weight", type=float, default=1.0,
                    help="lambda of the MTP loss while training (the draft quality is what is measured)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="reuse this trained model if it exists, else train and save it there")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    train_bytes, held_bytes = stdlib_bytes(8_000_000, args.seed)
    data = torch.tensor(list(train_bytes), dtype=torch.long)
    cfg = preset("tiny", vocab_size=256, dense_attention=True, max_position_embeddings=4096,
                 mtp_loss_weight=args.mtp_loss_weight)
    torch.set_num_threads(args.train_threads)
    if args.checkpoint is not None and args.checkpoint.exists():
        model, losses = load_state(args.checkpoint).eval(), [float("nan")]
    else:
        model = GLMModel(cfg)
        losses = train(model, data, args.train_seconds, args.seq_len, args.batch, args.lr, args.seed)
        if args.checkpoint is not None:
            save_state(model, args.checkpoint)

    torch.set_num_threads(args.decode_threads)
    held = torch.tensor(list(held_bytes), dtype=torch.long)
    rng = random.Random(args.seed)
    prompts = [held[s:s + args.prompt_len][None] for s in
               (rng.randrange(0, len(held) - args.prompt_len) for _ in range(args.prompts))]
    generate(model, prompts[0], 8, greedy=True)               # warm-up
    speculative_generate(model, prompts[0], 8)

    # Interleave the two decoders prompt by prompt and keep each one's best of --repeats runs:
    # the machine is shared, and load spikes hit both alike.
    plain_t = spec_t = 0.0
    n_plain = n_spec = 0
    acc, same, generated = [], True, []
    for p in prompts:
        tp, ts = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            a = generate(model, p, args.new_tokens, greedy=True)
            tp.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = speculative_generate(model, p, args.new_tokens, greedy=True, num_draft=3,
                                     draft_threshold=args.draft_threshold)
            ts.append(time.perf_counter() - t)
        plain_t += min(tp)
        spec_t += min(ts)
        n_plain += a.new_tokens.shape[1]
        n_spec += b.new_tokens.shape[1]
        acc += b.acceptance_lengths
        same &= torch.equal(a.tokens, b.tokens)
        generated += a.new_tokens[0].tolist()
    res = {
        "train_steps": len(losses), "train_seconds": args.train_seconds,
        "final_lm_loss_nats_per_byte": sum(losses[-10:]) / min(10, len(losses)),
        "plain_tokens_per_s": n_plain / plain_t, "speculative_tokens_per_s": n_spec / spec_t,
        "speedup": (n_spec / spec_t) / (n_plain / plain_t),
        "mean_acceptance_length": sum(acc) / len(acc), "draft_tokens": 3,
        "draft_threshold": args.draft_threshold,
        "greedy_outputs_identical": same,
        # An under-trained model drifts into runs of spaces, which any draft predicts: report it.
        "whitespace_fraction_of_output": sum(t in (9, 10, 32) for t in generated) / max(len(generated), 1),
        "prompts": args.prompts, "new_tokens": args.new_tokens,
        "decode_threads": args.decode_threads, "mtp_loss_weight": args.mtp_loss_weight,
    }
    sample = bytes(b.new_tokens[0].tolist()).decode("utf-8", "replace")
    if args.json:
        print(json.dumps({**res, "sample": sample}, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
        print("sample continuation:\n" + sample)


if __name__ == "__main__":
    main()
