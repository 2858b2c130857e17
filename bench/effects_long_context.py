"""Long-context effect benchmark (issue 16): full attention vs DSA vs sliding-window attention on
multi-query associative recall (MQAR, evals/mqar.py), with the library's model and DSA losses.

What it does, in one process on one thread:
  1. dense pretraining of a small GLMModel (bench/effects_common.model_config: MLA + indexer +
     MoE, 2 layers, hidden 64, 311K params at vocab 1024) with Muon Split lr 0.005: a copy
     warm-up at random offsets (evals/mqar.copy_batch: forms the induction circuit), then MQAR
     (16 pairs, keys and values from 64 + 64 reserved ids) over a length curriculum
     (--curriculum T:B:steps,...; default 64 -> 256 -> 1024);
  2. DSA indexer warm-up (training/dsa_loss.warmup_indexer_loss: KL to the head-summed dense
     attention, every weight but the indexers frozen), AdamW 3e-3, 400 steps at T=256;
  3. adaptation from the same weights, same batches, same steps (--adapt-steps, T=1024), arms:
       full  dense attention (indexer off), LM loss;
       dsa   top-k attention (index_topk = --topk), LM loss + sparse indexer KL
             (training/dsa_loss.sparse_indexer_loss), as training/dsa.py's dsa-adapt;
       swa   evals.long_context.baseline_configs' SWA variant (layer 1 of 2 slides a window of
             --swa-window tokens), LM loss;
     plus the dense weights evaluated as DSA (warm-up only) and with the window (no adapt);
  4. evaluation at --lengths: greedy accuracy on every query of --eval-docs documents per
     length (16 queries each), also over the queries whose key lies beyond the SWA window.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python bench/effects_long_context.py            # ~12 min
    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python bench/effects_long_context.py --smoke    # seconds

What it showed (seed 0, 256 queries per length; bench/EFFECTS_NOTES.md has every run):
                        256    512   1024   mean   (beyond the 64-token window: 256/512/1024)
    full               .984   .984   .992   .987   (.991 .991 .996)
    dsa  (top-64)     1.000   .996   .988   .995   (1.000 .996 .987)
    swa  (window 64)   .145   .074   .055   .091   (.009 .017 .013)
745 s on one (shared) core. With the indexer warm-up at 150 steps / lr 1e-3 (recall .81), DSA
reached only .879 mean: the indexer's top-k recall decides DSA's accuracy.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import effects_common as C  # bench/effects_common.py (this script's directory is on sys.path)
from evals.long_context import baseline_configs
from evals.mqar import mqar_accuracy
from model.model import GLMModel, freeze_all_but_indexer, indexer_parameters, unfreeze_all
from training.dsa_loss import forward_kwargs, sparse_indexer_loss, warmup_indexer_loss


def parse_curriculum(s: str) -> list[tuple]:
    out = []
    for part in s.split(","):
        bits = part.split(":")
        out.append((bits[0], *map(int, bits[1:])) if bits[0] in ("copy", "facts", "mqar") else tuple(map(int, bits)))
    return out


def clone(model: GLMModel, cfg) -> GLMModel:
    m = GLMModel(cfg)
    missing, unexpected = m.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".indexer." in k for k in unexpected), (missing, unexpected)
    return m


def evaluate(model, args, lengths, window) -> dict:
    res = {}
    for L in lengths:
        spec = C.mqar_spec(L, args.pairs, args.vocab, args.key_range, args.key_range)
        res[L] = mqar_accuracy(model, spec, args.eval_docs, f"eval/{args.seed}", batch_size=4, windows=[window])
    return res


def indexer_warmup(model: GLMModel, args) -> dict:
    """Stage 1: dense forward, KL(p || softmax(I)), only the indexers train (AdamW)."""
    freeze_all_but_indexer(model)
    opt = torch.optim.AdamW(indexer_parameters(model), lr=args.warmup_lr, weight_decay=0.0)
    T, B = args.warmup_len or args.adapt_len, args.warmup_batch or args.adapt_batch
    spec = C.mqar_spec(T, args.pairs, args.vocab, args.key_range, args.key_range)
    t0, first, last = time.perf_counter(), None, None
    model.train()
    for i in range(args.warmup_steps):
        b = C.mqar_batch(spec, B, f"warmup/{args.seed}/{i}")
        out = model(b["input_ids"], **forward_kwargs("warmup"))
        loss, m = warmup_indexer_loss(out)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first = first or m
        last = m
        if (i + 1) % 50 == 0:
            print(f"warmup {i + 1}/{args.warmup_steps} kl {m['kl']:.4f} recall {m['recall_sparse_rows']:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    unfreeze_all(model)
    return {"kl_first": first["kl"], "kl_last": last["kl"], "recall_sparse_first": first["recall_sparse_rows"],
            "recall_sparse_last": last["recall_sparse_rows"], "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1024, help="model vocabulary (the pipeline's is 8192: ~3x slower steps here, not run)")
    ap.add_argument("--key-range", type=int, default=64, help="ids for keys, and as many for values, at the vocab's top")
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--curriculum", default="copy:64:32:400,64:32:200,256:8:300,1024:2:300",
                    help="T:B:steps,... (a 'copy:T:B:steps' entry trains the copy warm-up)")
    ap.add_argument("--warmup-steps", type=int, default=400)
    ap.add_argument("--warmup-lr", type=float, default=3e-3)
    ap.add_argument("--adapt-steps", type=int, default=300)
    ap.add_argument("--adapt-lr", type=float, default=0.002)
    ap.add_argument("--adapt-len", type=int, default=1024)
    ap.add_argument("--adapt-batch", type=int, default=2)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--swa-window", type=int, default=64)
    ap.add_argument("--lengths", default="256,512,1024")
    ap.add_argument("--eval-docs", type=int, default=16, help="documents per length (x pairs queries)")
    ap.add_argument("--dense-mlp", action="store_true", help="no MoE layer (first_k_dense = layers)")
    ap.add_argument("--save", default="", help="write the results JSON here")
    ap.add_argument("--ckpt", default="", help="pretrained weights: loaded if the file exists, else written after pretraining")
    ap.add_argument("--warmup-len", type=int, default=256, help="indexer warm-up seq len (0 = --adapt-len)")
    ap.add_argument("--warmup-batch", type=int, default=8, help="indexer warm-up batch (0 = --adapt-batch)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.curriculum, args.warmup_steps, args.adapt_steps = "64:8:20,256:2:10", 10, 10
        args.lengths, args.eval_docs, args.adapt_len, args.warmup_len, args.warmup_batch = "128,256", 2, 256, 128, 2
    C.set_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.manual_seed(args.seed)
    t_all = time.perf_counter()

    cfg = C.model_config(hidden=args.hidden, vocab=args.vocab, topk=args.topk, max_len=max(lengths + [args.adapt_len]))
    if args.dense_mlp:
        cfg = cfg.replace(first_k_dense=cfg.num_layers)
    model = GLMModel(cfg)
    print(f"params {sum(p.numel() for p in model.parameters()) / 1e3:.0f}K", flush=True)

    def ev(T):
        a = mqar_accuracy(model, C.mqar_spec(T, args.pairs, args.vocab, args.key_range, args.key_range), 8,
                          f"probe/{args.seed}", batch_size=4)["acc"]
        return f"acc@{T} {a:.3f}"

    import os
    if args.ckpt and os.path.exists(args.ckpt):
        model.load_state_dict(torch.load(args.ckpt))
        pre = {"wall_s": 0.0, "curve": []}
    else:
        pre = C.train_mqar(model, parse_curriculum(args.curriculum), pairs=args.pairs, vocab=args.vocab, lr=args.lr,
                           seed=args.seed, eval_fn=ev, tag="pretrain", key_range=args.key_range,
                           value_range=args.key_range, log_every=100)
        if args.ckpt:
            torch.save(model.state_dict(), args.ckpt)
    print(f"pretrain {pre['wall_s']:.0f}s", flush=True)
    results = {"dense pretrained": evaluate(model, args, lengths, args.swa_window)}

    warm = indexer_warmup(model, args)
    print(f"indexer warm-up: kl {warm['kl_first']:.4f} -> {warm['kl_last']:.4f}, top-{args.topk} recall (rows with "
          f"> k keys) {warm['recall_sparse_first']:.3f} -> {warm['recall_sparse_last']:.3f} ({warm['wall_s']:.0f}s)",
          flush=True)

    variants = baseline_configs(cfg, lengths, 0.25)
    arms = {"full": cfg.replace(dense_attention=True),
            "dsa": cfg.replace(dense_attention=False),
            "swa": variants["swa"].replace(sliding_window=args.swa_window)}
    results["dsa (warm-up only)"] = evaluate(clone(model, arms["dsa"]), args, lengths, args.swa_window)
    results["swa (no adapt)"] = evaluate(clone(model, arms["swa"]), args, lengths, args.swa_window)
    walls = {}
    for name, acfg in arms.items():
        m = clone(model, acfg)
        extra = (lambda out: sparse_indexer_loss(out)[0]) if name == "dsa" else None
        fk = {"return_indexer": True, "return_attn_probs": True} if name == "dsa" else None
        r = C.train_mqar(m, [(args.adapt_len, args.adapt_batch, args.adapt_steps)], pairs=args.pairs, vocab=args.vocab,
                         lr=args.adapt_lr, seed=args.seed + 1000, extra_loss=extra, forward_kwargs=fk, tag=f"adapt/{name}",
                         key_range=args.key_range, value_range=args.key_range, log_every=50, warmup=10)
        walls[name] = r["wall_s"]
        results[name] = evaluate(m, args, lengths, args.swa_window)

    w = args.swa_window
    print(f"\nMQAR accuracy ({args.pairs} pairs, {args.eval_docs * args.pairs} queries per length; SWA window {w}, "
          f"DSA top-{args.topk}); beyond = queries whose key is >= {w} tokens back")
    print(f"{'model':22s}" + "".join(f"{L:>9d}" for L in lengths) + "   mean  | beyond-window" + "".join(f"{L:>7d}" for L in lengths))
    for name, res in results.items():
        accs = [res[L]["acc"] for L in lengths]
        print(f"{name:22s}" + "".join(f"{a:9.3f}" for a in accs) + f" {sum(accs) / len(accs):6.3f}  |" + " " * 13 +
              "".join(f"{res[L][f'acc_beyond_{w}']:7.3f}" for L in lengths))
    print(f"wall: pretrain {pre['wall_s']:.0f}s, warm-up {warm['wall_s']:.0f}s, adapt " +
          ", ".join(f"{k} {v:.0f}s" for k, v in walls.items()) + f"; total {time.perf_counter() - t_all:.0f}s")
    if args.save:
        with open(args.save, "w") as fh:
            json.dump({"args": vars(args), "results": {k: {str(L): v for L, v in r.items()} for k, r in results.items()},
                       "warmup": warm, "pretrain_curve": pre["curve"], "adapt_wall_s": walls}, fh, indent=1)


if __name__ == "__main__":
    main()
