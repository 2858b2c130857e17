"""Decode benchmark: speculative decoding with the MTP draft (3 tokens) vs plain greedy, on CPU.

An untrained MTP module accepts almost nothing, so the script first trains the model briefly
(LM + MTP loss) on real text at byte level (vocab 256): code, the Python standard library's own
source (sysconfig.get_paths()["stdlib"]), and prose, Tiny Shakespeare (samples/) -- then decodes
held-out prompts of each kind both ways and reports tokens/s, mean acceptance length and the
speed-up per kind. Greedy speculative output must equal plain greedy output; the script checks it.

    .venv/bin/python bench/decode.py [--model-preset tiny|small] [--train-seconds 120] [--json]

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


def shakespeare_bytes() -> tuple[bytes, bytes]:
    """(train, held-out) prose: samples/tinyshakespeare, the last tenth held out."""
    text = (Path(__file__).resolve().parents[1] / "samples" / "tinyshakespeare" / "input.txt").read_bytes()
    cut = len(text) * 9 // 10
    return text[:cut], text[cut:]


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


def held_out_prompts(held: bytes, n: int, length: int, seed: int) -> list[torch.Tensor]:
    data = torch.tensor(list(held), dtype=torch.long)
    rng = random.Random(seed)
    return [data[s:s + length][None] for s in (rng.randrange(0, len(data) - length) for _ in range(n))]


def compare(model: GLMModel, prompts: list[torch.Tensor], args) -> dict:
    """Plain greedy vs speculative on the same prompts, interleaved prompt by prompt, each
    decoder's best of --repeats runs (the machine is shared: load spikes hit both alike)."""
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
    return {"plain_tokens_per_s": n_plain / plain_t, "speculative_tokens_per_s": n_spec / spec_t,
            "speedup": (n_spec / spec_t) / (n_plain / plain_t), "mean_acceptance_length": sum(acc) / len(acc),
            "greedy_outputs_identical": same,
            # an under-trained model drifts into runs of spaces, which any draft predicts: report it
            "whitespace_fraction_of_output": sum(t in (9, 10, 32) for t in generated) / max(len(generated), 1),
            "sample": bytes(generated[: args.new_tokens]).decode("utf-8", "replace")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-preset", choices=["tiny", "small"], default="tiny",
                    help="model.config preset (tiny: 4 layers of 128; small: 12 layers of 512), vocabulary 256 bytes")
    ap.add_argument("--train-seconds", type=float, default=120)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prompts", type=int, default=6, help="prompts per kind (code, prose)")
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
    code_train, code_held = stdlib_bytes(3_000_000, args.seed)
    prose_train, prose_held = shakespeare_bytes()
    data = torch.tensor(list(code_train + prose_train), dtype=torch.long)
    cfg = preset(args.model_preset, vocab_size=256, dense_attention=True, max_position_embeddings=4096,
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
    kinds = {"code": held_out_prompts(code_held, args.prompts, args.prompt_len, args.seed),
             "prose": held_out_prompts(prose_held, args.prompts, args.prompt_len, args.seed + 1)}
    generate(model, kinds["code"][0], 8, greedy=True)               # warm-up
    speculative_generate(model, kinds["code"][0], 8)
    per_kind = {k: compare(model, ps, args) for k, ps in kinds.items()}
    both = {k: sum(r[k] for r in per_kind.values()) / len(per_kind)
            for k in ("speedup", "mean_acceptance_length", "whitespace_fraction_of_output")}
    res = {
        "model_preset": args.model_preset, "params": sum(p.numel() for p in model.parameters()),
        "train_steps": len(losses), "train_seconds": args.train_seconds,
        "final_lm_loss_nats_per_byte": sum(losses[-10:]) / min(10, len(losses)),
        **both, "greedy_outputs_identical": all(r["greedy_outputs_identical"] for r in per_kind.values()),
        "per_kind": {k: {m: v for m, v in r.items() if m != "sample"} for k, r in per_kind.items()},
        "draft_tokens": 3, "draft_threshold": args.draft_threshold, "prompts_per_kind": args.prompts,
        "new_tokens": args.new_tokens, "decode_threads": args.decode_threads, "mtp_loss_weight": args.mtp_loss_weight,
    }
    if args.json:
        print(json.dumps({**res, "samples": {k: r["sample"] for k, r in per_kind.items()}}, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
        for k, r in per_kind.items():
            print(f"{k} sample continuation:\n" + r["sample"])


if __name__ == "__main__":
    main()
