"""End to end on 2 CPU ranks (torchrun, gloo): training, checkpoints, kill -9 + step-exact
resume, a corrupt newest checkpoint, held-out loss and perplexity, the published artifact.

Exactness: fp32 on CPU, one thread per rank (torchrun), deterministic algorithms, the same
launch layout: a resumed run must reproduce every logged per-step value bit for bit."""
from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.stage import Workdir
from tests.training.conftest import MODEL_OVERRIDES, stdlib_docs
from training import checkpoint, metrics
from training.config import PretrainConfig
from training.launch import TrainingFailed
from training.drivers import run_pretrain

STEPS, EVERY = 24, 6
EXACT = ("tokens", "loss", "lm", "mtp", "balance", "lr", "grad_norm", "expert_load_max_mean")


def config(**kw) -> PretrainConfig:
    base = dict(model_overrides=MODEL_OVERRIDES, micro_batch_size=4, max_steps=STEPS, checkpoint_every=EVERY,
                keep_last=2, lr=0.02, warmup_steps=2, eval_sequences=32, launch={"nproc_per_node": 2})
    return PretrainConfig(**{**base, **kw})


def workdir(root: Path) -> tuple[Workdir, list[str]]:
    persisted: list[str] = []
    wd = Workdir.at(root, seed=7)
    latest = wd.checkpoint / checkpoint.LATEST
    wd.persist_checkpoint = lambda: persisted.append(latest.read_text() if latest.exists() else "(no checkpoint)")
    return wd, persisted


def steps(wd: Workdir) -> list[dict]:
    return metrics.read(wd.checkpoint / "metrics.jsonl")


@pytest.fixture(scope="module")
def reference(packed, tmp_path_factory):
    """An uninterrupted 2-rank ZeRO-0 run (Muon Split + AdamW) of STEPS steps."""
    wd, persisted = workdir(tmp_path_factory.mktemp("reference"))
    result = run_pretrain(config(), packed, wd)
    return wd, result, persisted


def test_two_rank_run_checkpoints_every_n_steps(reference):
    wd, result, persisted = reference
    assert result["world_size"] == 2 and result["zero_stage"] == 0 and result["steps"] == STEPS
    assert [r["step"] for r in steps(wd)] == list(range(1, STEPS + 1))
    assert persisted == [checkpoint.tag_for(s) for s in range(EVERY, STEPS + 1, EVERY)]  # after each one
    kept = checkpoint.tags(wd.checkpoint)
    assert kept == [checkpoint.tag_for(STEPS - EVERY), checkpoint.tag_for(STEPS)]     # keep_last=2
    assert all(checkpoint.verify(wd.checkpoint, t) is None for t in kept)
    assert (wd.checkpoint / checkpoint.LATEST).read_text() == checkpoint.tag_for(STEPS)
    meta = checkpoint.select_resume(wd.checkpoint)[1]
    assert meta["step"] == STEPS and meta["world_size"] == 2 and len(meta["rng"]) == 2
    assert meta["loader"]["world"] == 2 and meta["tokens"] == STEPS * 4 * 2 * 64


def test_loss_goes_down_on_held_out_text(reference):
    wd, result, _ = reference
    assert result["val_loss_after"] < result["val_loss_before"] - 0.5
    assert result["val_ppl_after"] == pytest.approx(math.exp(result["val_loss_after"]))
    assert result["loss_last"] < result["loss_first"]
    for k in ("lr_last", "grad_norm_last", "tokens_per_s", "expert_load_max_mean", "mtp_loss_last"):
        assert result[k] is not None and result[k] > 0, k


def test_artifact_holds_weights_hf_export_and_curves(reference):
    from glmforge.cli_model import perplexity

    wd, result, _ = reference
    out = wd.out
    for f in ("consolidated.safetensors", "hf/config.json", "hf/model.safetensors", "hf/tokenizer.json",
              "metrics.jsonl", "loss.png", "eval.json"):
        assert (out / f).is_file(), f
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    unseen = [d.text[:4000] for d in stdlib_docs(42)[40:]]          # modules the run never saw
    ppl = perplexity(out / "hf", unseen, max_length=64)["perplexity"]
    assert ppl < 0.5 * 512                                          # untrained: about the vocab size


def _rank_pids(spec: Path) -> dict[int, int]:
    """RANK -> pid of the rank processes started for this spec file (not their launcher)."""
    found = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            if str(spec).encode() not in cmd or b"training.launch" not in cmd or b"training.spawn" in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in (p / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(p.name)
    return found


def test_kill_9_a_rank_then_resume_is_step_exact(reference, packed, tmp_path, caplog):
    ref_wd, ref_result, _ = reference
    wd, _ = workdir(tmp_path / "killed")
    killed: dict[str, str] = {}

    def kill_rank_1_after_first_checkpoint() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            if (wd.checkpoint / checkpoint.LATEST).exists():
                pids = _rank_pids(wd.checkpoint / "launch.json")
                if 1 in pids:
                    os.kill(pids[1], signal.SIGKILL)
                    killed["after"] = (wd.checkpoint / checkpoint.LATEST).read_text()
            time.sleep(0.01)

    watcher = threading.Thread(target=kill_rank_1_after_first_checkpoint, daemon=True)
    watcher.start()
    with pytest.raises(TrainingFailed) as failure:
        run_pretrain(config(), packed, wd)
    watcher.join()
    assert killed, "the watcher never saw a checkpoint"
    assert "rank 1 failed (killed by signal 9)" in str(failure.value)
    done = [r["step"] for r in steps(wd)]
    assert done and done[-1] < STEPS                                # stopped mid-training

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="glmforge"):
        result = run_pretrain(config(), packed, wd)                 # the retry
    assert "resuming from checkpoint" in caplog.text
    assert 0 < result["resumed_from_step"] < STEPS
    ref, got = steps(ref_wd), steps(wd)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert {k: a[k] for k in EXACT} == {k: b[k] for k in EXACT}, f"step {a['step']} differs"
    assert result["val_loss_after"] == ref_result["val_loss_after"]
    w_ref, w_got = load_file(ref_wd.out / "consolidated.safetensors"), load_file(wd.out / "consolidated.safetensors")
    assert w_ref.keys() == w_got.keys() and all(torch.equal(w_ref[k], w_got[k]) for k in w_ref)


def test_zero2_deepspeed_muon_falls_back_past_a_corrupt_newest_checkpoint(packed, tmp_path, caplog):
    cfg = config(zero_stage=2, optimizer="deepspeed_muon", grad_clip=0.0, max_steps=6, checkpoint_every=3,
                 keep_last=3)
    wd, _ = workdir(tmp_path / "zero2")
    first = run_pretrain(cfg, packed, wd)
    assert first["zero_stage"] == 2 and first["val_loss_after"] < first["val_loss_before"]
    want = steps(wd)
    shard = wd.checkpoint / checkpoint.tag_for(6) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for p in wd.out.iterdir():                                      # the runner rebuilds out/ per attempt
        p.unlink() if p.is_file() else __import__("shutil").rmtree(p)

    with caplog.at_level(logging.WARNING, logger="glmforge"):
        again = run_pretrain(cfg, packed, wd)
    assert "step_00000006" in caplog.text and "digest mismatch" in caplog.text
    assert again["resumed_from_step"] == 3
    got = steps(wd)
    assert [{k: r[k] for k in EXACT} for r in got] == [{k: r[k] for k in EXACT} for r in want]


def test_context_phase_continues_from_pretrain_on_packed_long_documents(reference, packed, tmp_path):
    import json

    from data_processing.document import Document, ShardWriter
    from training.config import ContextConfig
    from glmforge.pipeline import get_stage

    docs = stdlib_docs(40)
    # a "repository" of three modules and issue-PR threads: the mix's favoured sources
    repo = [Document(f"cpython/{d.id}", d.text, "issue-pr", {"repo": "python/cpython", "path": d.id}) for d in docs[:3]]
    w = ShardWriter(tmp_path / "decontaminate", 100)
    w.write_all(repo + docs[3:])
    w.close()
    ref_wd, ref_result, _ = reference
    context_1 = get_stage("context-1")
    cfg = ContextConfig(seq_len=128, rope_theta=40000.0, max_steps=6, checkpoint_every=3, micro_batch_size=2,
                        lr=0.01, eval_sequences=16, launch={"nproc_per_node": 1},
                        mix={"sources": {"issue-pr": 3.0}, "long_chars": 8000, "long_weight": 2.0})
    wd, persisted = workdir(tmp_path / "context-1")
    inputs = {"pretrain": ref_wd.out, "decontaminate": tmp_path / "decontaminate", "tokenize": packed["tokenize"]}
    result = context_1.run(cfg, inputs, wd)
    assert result["seq_len"] == 128 and result["rope_theta"] == 40000.0 and result["world_size"] == 1
    assert set(result["mix_chars_share"]) == {"issue-pr", "stdlib"}
    assert (wd.checkpoint / "packed" / "PACKED").exists()
    # it starts from the pretrained weights: far below the untrained model's held-out loss
    assert result["val_loss_before"] < ref_result["val_loss_before"] - 0.5
    hf = json.loads((wd.out / "hf" / "config.json").read_text())
    assert hf["rope_parameters"]["rope_theta"] == 40000.0 and hf["max_position_embeddings"] >= 128
    assert (wd.out / "consolidated.safetensors").is_file()
    assert persisted == ["(no checkpoint)", "step_00000003", "step_00000006"]  # packed data, then each checkpoint


def test_synthetic_tasks_reserve_ids_and_a_later_phase_needs_them(reference, packed, tmp_path):
    from data_processing.document import ShardWriter
    from data_processing.tokenizer import load_tokenizer
    from glmforge.pipeline import get_stage
    from model.hf import STATE_FILE, state_config
    from training.config import ContextConfig
    from training.synthetic import RESERVED_IDS

    synthetic = {"docs": [{"task": "copy", "length": 32, "count": 40}, {"task": "mqar", "length": 64, "count": 10}],
                 "mqar_pairs": 8}
    wd, _ = workdir(tmp_path / "pretrain")
    result = run_pretrain(config(max_steps=2, checkpoint_every=2, launch={"nproc_per_node": 1}, synthetic=synthetic),
                          packed, wd)
    base = load_tokenizer(packed["tokenize"]).get_vocab_size()
    assert state_config(wd.out / STATE_FILE).vocab_size == base + RESERVED_IDS
    assert result["synthetic"]["base"] == base and (wd.checkpoint / "packed" / "MIXED").exists()
    # a phase that adds synthetic documents to a model pretrained without them is refused
    w = ShardWriter(tmp_path / "decontaminate", 100)
    w.write_all(stdlib_docs(20))
    w.close()
    cfg = ContextConfig(seq_len=128, max_steps=2, checkpoint_every=2, micro_batch_size=1, eval_sequences=4,
                        mix={"sources": {"stdlib": 1.0}}, synthetic=synthetic)
    ref_wd, _, _ = reference
    inputs = {"pretrain": ref_wd.out, "decontaminate": tmp_path / "decontaminate", "tokenize": packed["tokenize"]}
    with pytest.raises(ValueError, match=rf"context-1: synthetic tasks need vocab_size >= tokenizer's {base} "
                                         rf"\+ {RESERVED_IDS} reserved ids"):
        get_stage("context-1").run(cfg, inputs, workdir(tmp_path / "context-1")[0])
