"""The stage registry, and the tiny preset's curate chain end to end on a small real corpus."""
from __future__ import annotations

import json

from data_processing.common import SAMPLES_DIR
from data_processing.document import Document, read_documents
from data_processing.packing import PackedDataset
from glmforge.pipeline import BY_NAME as STEPS
from glmforge.pipeline import CURATION
from runtime.stage import Workdir

STAGES = [s for s in CURATION if s.name != "ingest"]

from .conftest import gsm8k_records, stdlib_docs, write_docs


def test_registry_order_and_parents(tiny):
    names = [s.name for s in STAGES]
    assert names == ["quality", "dedup-exact", "dedup-minhash", "dedup-semantic", "issue-pr", "decontaminate", "tokenize", "pack"]
    assert STEPS["decontaminate"].parents == ("dedup-semantic", "issue-pr")
    assert STEPS["issue-pr"].parents == () and STEPS["quality"].parents == ("ingest",)
    seen = {"ingest"}
    for s in STAGES:  # parents come first
        assert set(s.parents) <= seen, s.name
        seen.add(s.name)
    for s in STAGES:
        cfg = getattr(tiny, s.section)
        assert isinstance(cfg, s.config_cls)
        # the runner hashes the JSON dump into the stage key: it must load back to the same config
        assert s.config_cls.model_validate(json.loads(cfg.model_dump_json())) == cfg


def test_tiny_chain_end_to_end(tmp_path, tiny):
    docs = stdlib_docs(80) + [Document(f"gsm8k-{i:04d}", r["question"] + "\n" + r["answer"], "gsm8k") for i, r in enumerate(gsm8k_records(400))]
    docs.append(Document("copy", docs[5].text, "stdlib"))  # an exact duplicate
    test_q = json.loads((SAMPLES_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()[5])
    docs.append(Document("gsm8k-test-5", test_q["question"] + "\n" + test_q["answer"], "web"))  # an eval leak
    dirs = {"ingest": write_docs(tmp_path / "ingest", docs, shard_size=200)}
    cfgs = {s.section: getattr(tiny, s.section) for s in STAGES}
    cfgs["tokenize"] = cfgs["tokenize"].model_copy(update={"vocab_size": 2048})
    metrics = {}
    for s in STAGES:
        wd = Workdir.at(tmp_path / s.name)
        metrics[s.name] = s.run(cfgs[s.section], {p: dirs[p] for p in s.parents}, wd)
        json.dumps(metrics[s.name])  # JSON-able
        dirs[s.name] = wd.out
    assert metrics["dedup-exact"]["removed"] == 1
    # GSM8K train lines 0-199 are SFT's held-out set: all 200 are removed; the test-split leak too
    assert metrics["decontaminate"]["hits"]["gsm8k_sft_heldout"] == 200
    assert metrics["decontaminate"]["hits"]["gsm8k"] == 1
    kept_ids = {d.id for d in read_documents(dirs["decontaminate"])}
    assert "gsm8k-0199" not in kept_ids and "gsm8k-test-5" not in kept_ids and "gsm8k-0300" in kept_ids
    assert any(i.startswith("huggingface__datasets-") for i in kept_ids)  # issue-pr joined
    ds = PackedDataset(dirs["pack"])
    assert len(ds) == metrics["pack"]["train_sequences"] > 0
