"""QAT vs PTQ effect benchmark (issue 16): does INT4 round-to-nearest PTQ of every linear layer
(experts included) hurt a small GLMModel that has learned something, and how much of it does
INT4 QAT (quant/qat.py) recover?

The task (--task facts, default): two-token fact recall (evals/mqar.fact_batch), 128 x 128 =
16,384 facts "a b -> v" of one fixed random table, 256 values, 22 facts per 66-token document,
loss and score on the values. The answers live in the weights, at capacity for this model, so
weight precision matters. (--task mqar: in-context recall; INT4 does not hurt it, see notes.)

Per seed, in one process on one thread:
  1. pretrain the bench model (bench/effects_common.model_config: 2 layers, hidden 64, MoE
     4 experts of width 64 + shared, 311K params at vocab 1024) for --curriculum (1,400 steps);
  2. from that checkpoint, two continuations on the SAME batches (same seed, steps and lr
     schedule; --decay 1.0 decays the lr linearly to 0 over them):
       plain  full precision; its INT4 round-to-nearest copy is the PTQ model;
       qat    fake INT4 (quant.qat.prepare_qat, group --group) switched on after
              --qat-start of the continuation steps (0 = from the first step), with
              --qat-lr-mult on its lr, optionally with learned scales (--lsq, enable_lsq);
     the QAT model is then baked to its INT4 values (remove_qat(bake=True));
  3. scored on held-out documents (same table, other draws): greedy accuracy on every answer
     and the perplexity of the answers (exp of the mean cross-entropy on the answer positions).
INT4 everywhere means: experts (routed, packed, and shared), MLA projections, the dense MLP and
lm_head (--no-head to leave it out), group 32 along the input dim; not the embeddings, the
router or the DSA indexer. Recovery (GLM-5's comparison, both against the plain run's fp):
    recovery = (metric(QAT INT4) - metric(PTQ INT4)) / (metric(plain fp) - metric(PTQ INT4)).

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python bench/effects_qat.py --seeds 0,1,2    # ~15 min
    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python bench/effects_qat.py --smoke     # seconds

What it showed (3 seeds, 1 thread; bench/EFFECTS_NOTES.md has every run):
  defaults (600 continuation steps, lr 0.005 decayed linearly to 0, round-to-nearest QAT):
    PTQ INT4 costs +8.8 +- 0.5 % answer perplexity (1.005 -> 1.093; fp seed spread < 0.01 %) and
    1.8 +- 0.2 accuracy points; QAT recovers 0.71 +- 0.01 of the perplexity, 0.89 +- 0.03 of
    the accuracy. ~2 min per seed after a 2-min pretraining.
  300 annealed steps: PTQ +15 % ppl / 4.0 points; recovery 0.63 / 0.82 (RTN), 0.65 / 0.85 (LSQ).
  300 steps at a constant lr (--decay 0 --cont-steps 300): the model sits at .85 accuracy, PTQ
    costs 10.4 points / +45 % ppl, and QAT recovers only 0.23 / 0.18.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import effects_common as C  # bench/effects_common.py (this script's directory is on sys.path)
import torch

from evals.mqar import IGNORE, fact_batch, mqar_batch
from model.model import GLMModel
from quant.qat import QATConfig, prepare_qat, ptq_int4, remove_qat


@torch.no_grad()
def score(model: GLMModel, args, seq_len: int) -> dict[str, float]:
    """Greedy accuracy and answer perplexity on args.eval_docs held-out documents."""
    model.eval()
    hit = n = 0
    nll = 0.0
    for s in range(0, args.eval_docs, 8):
        if args.task == "facts":
            fa, fb, table = C.facts_ids(args.vocab)
            b = fact_batch(seq_len, min(8, args.eval_docs - s), fa, fb, table, f"qat-eval/{s}")
        else:
            spec = C.mqar_spec(seq_len, args.pairs, args.vocab, args.key_range, args.key_range)
            b = mqar_batch(spec, min(8, args.eval_docs - s), f"qat-eval/{s}")
        logits = model(b["input_ids"]).logits.float()
        mask = b["labels"] != IGNORE
        lab = b["labels"][mask]
        lg = logits[mask]
        hit += int((lg.argmax(-1) == lab).sum())
        nll += float(torch.nn.functional.cross_entropy(lg, lab, reduction="sum"))
        n += int(mask.sum())
    model.train()
    return {"acc": hit / n, "ppl": math.exp(nll / n), "n": n}


def qat_config(args) -> QATConfig:
    return QATConfig(group_size=args.group, experts=True, attention=True, dense_mlp=True, mtp=True,
                     head=args.head, embeddings=False, indexer=False)


def continue_training(model: GLMModel, args, seed: int, qat: bool) -> GLMModel:
    """args.cont_steps MQAR steps at --cont-len; with qat, fake quantization from step
    int(qat_start * steps) on (the optimizer state carries over the switch)."""
    from training.optim import build_optimizer

    m = copy.deepcopy(model)
    opt = build_optimizer(m, args.cont_lr, 0.1, num_heads=m.config.num_heads)
    start = int(args.qat_start * args.cont_steps)
    phases = []
    if not qat or start > 0:
        phases.append((args.task, args.cont_len, args.cont_batch, start if qat else args.cont_steps))
    r1 = None
    if phases:
        r1 = C.train_mqar(m, phases, pairs=args.pairs, vocab=args.vocab, lr=args.cont_lr, seed=seed, tag="cont",
                          key_range=args.key_range, value_range=args.key_range, log_every=10 ** 9, warmup=1,
                          optimizer=opt, total_steps=args.cont_steps, decay_fraction=args.decay)
    if qat:
        prepare_qat(m, qat_config(args))
        if args.lsq:
            from quant.qat import enable_lsq
            enable_lsq(m)
            _add_scale_params(opt, m, args.lsq_lr / (args.cont_lr * args.qat_lr_mult))
        C.train_mqar(m, [(args.task, args.cont_len, args.cont_batch, args.cont_steps - start)], pairs=args.pairs, vocab=args.vocab,
                     lr=args.cont_lr * args.qat_lr_mult, seed=seed, tag="qat", key_range=args.key_range,
                     value_range=args.key_range, log_every=10 ** 9, warmup=1, optimizer=opt, step_offset=start,
                     total_steps=args.cont_steps, decay_fraction=args.decay)
        remove_qat(m, bake=True)
    return m


def _add_scale_params(opt, model, lr_mult):
    from quant.qat import lsq_parameters
    ps = lsq_parameters(model)
    known = {id(p) for g in opt.param_groups for p in g["params"]}
    ps = [p for p in ps if id(p) not in known]
    if ps:
        opt.add_param_group({"params": ps, "algorithm": "adamw", "weight_decay": 0.0, "lr_mult": lr_mult})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--task", choices=("facts", "mqar"), default="facts",
                    help="facts: two-token fact recall (16,384 facts in the weights); mqar: in-context recall")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--key-range", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--curriculum", default="facts:66:32:1400", help="pretraining phases (mqar: e.g. copy:64:32:400,64:32:300,256:8:300)")
    ap.add_argument("--cont-steps", type=int, default=600)
    ap.add_argument("--cont-lr", type=float, default=0.005)
    ap.add_argument("--cont-len", type=int, default=66)
    ap.add_argument("--cont-batch", type=int, default=32)
    ap.add_argument("--decay", type=float, default=1.0, help="fraction of continuation steps with linear lr decay to 0")
    ap.add_argument("--qat-start", type=float, default=0.0, help="fake quantization from this fraction of the steps")
    ap.add_argument("--qat-lr-mult", type=float, default=1.0, help="lr multiplier in the QAT phase")
    ap.add_argument("--lsq", action="store_true", help="learned scales (LSQ) in the QAT phase")
    ap.add_argument("--lsq-lr", type=float, default=1e-3)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--head", action=argparse.BooleanOptionalAction, default=True, help="quantize lm_head too")
    ap.add_argument("--eval-len", default="66")
    ap.add_argument("--eval-docs", type=int, default=64)
    ap.add_argument("--save", default="")
    ap.add_argument("--ckpt-dir", default="", help="keep/reuse each seed's pretrained weights here")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.seeds, args.curriculum, args.cont_steps, args.eval_docs = "0", "facts:66:8:20", 10, 8
    C.set_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    lens = [int(x) for x in args.eval_len.split(",")]
    rows = []
    t_all = time.perf_counter()
    for seed in seeds:
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        model = GLMModel(C.model_config(hidden=args.hidden, vocab=args.vocab, max_len=max(lens + [args.cont_len])))
        ckpt = f"{args.ckpt_dir}/qat_pretrain_seed{seed}.pt" if args.ckpt_dir else ""
        if ckpt and os.path.exists(ckpt):
            model.load_state_dict(torch.load(ckpt))
        else:
            C.train_mqar(model, C_parse(args.curriculum), pairs=args.pairs, vocab=args.vocab, lr=args.lr, seed=seed,
                         tag=f"seed {seed} pretrain", key_range=args.key_range, value_range=args.key_range,
                         log_every=200)
            if ckpt:
                torch.save(model.state_dict(), ckpt)
        t_pre = time.perf_counter() - t0
        plain = continue_training(model, args, seed + 100, qat=False)
        qat = continue_training(model, args, seed + 100, qat=True)
        ptq = ptq_int4(plain, qat_config(args))
        row = {"seed": seed, "pretrain_s": t_pre, "total_s": time.perf_counter() - t0}
        for L in lens:
            for name, m in (("pre", model), ("fp", plain), ("ptq", ptq), ("qat", qat)):
                row[f"{name}@{L}"] = score(m, args, L)
        rows.append(row)
        print(f"seed {seed}: " + "; ".join(
            f"L={L} acc fp {row[f'fp@{L}']['acc']:.3f} ptq {row[f'ptq@{L}']['acc']:.3f} qat {row[f'qat@{L}']['acc']:.3f} "
            f"ppl fp {row[f'fp@{L}']['ppl']:.3f} ptq {row[f'ptq@{L}']['ppl']:.3f} qat {row[f'qat@{L}']['ppl']:.3f}"
            for L in lens) + f" ({row['total_s']:.0f}s)", flush=True)

    print(f"\nINT4 group {args.group}, head {'on' if args.head else 'off'}; QAT from {args.qat_start:.0%} of "
          f"{args.cont_steps} steps, lr x{args.qat_lr_mult}{', LSQ' if args.lsq else ''}; {len(seeds)} seeds")
    for L in lens:
        for metric in ("acc", "ppl"):
            fp = [r[f"fp@{L}"][metric] for r in rows]
            ptq = [r[f"ptq@{L}"][metric] for r in rows]
            qat = [r[f"qat@{L}"][metric] for r in rows]
            cost = [p - f for f, p in zip(fp, ptq)] if metric == "ppl" else [f - p for f, p in zip(fp, ptq)]
            rec = [(q - p) / (f - p) if abs(f - p) > 1e-9 else float("nan") for f, p, q in zip(fp, ptq, qat)]
            mf, sf = C.mean_std(fp)
            mc, sc = C.mean_std(cost)
            mr, sr = C.mean_std(rec)
            rel = f" ({mc / mf:+.1%} of fp)" if metric == "ppl" else ""
            print(f"L={L} {metric}: fp {mf:.4f}±{sf:.4f}  PTQ cost {mc:+.4f}±{sc:.4f}{rel}  "
                  f"QAT recovery {mr:.2f}±{sr:.2f}  (per seed {', '.join(f'{x:.2f}' for x in rec)})")
    print(f"wall {time.perf_counter() - t_all:.0f}s")
    if args.save:
        with open(args.save, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


def C_parse(s: str):
    from effects_long_context import parse_curriculum
    return parse_curriculum(s)


if __name__ == "__main__":
    main()
