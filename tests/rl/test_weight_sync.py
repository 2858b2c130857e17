"""Bucketed weight sync: a version is published in bounded buckets by several ranks, loaded only
whole and verified, expert shards joined, and anything missing, corrupt or half-written refused."""
from __future__ import annotations

import json

import pytest
import torch

from rl import weight_sync
from rl.weight_sync import CorruptBucket, IncompleteVersion, Shard
from tests.rl.conftest import small_model

VOCAB = 64


def _publish_on(world: int, root, version: int, model, bucket_bytes: int):
    sent = []
    for r in range(world):
        sent.append(weight_sync.publish(root, version, weight_sync.rank_part(model, r, world), rank=r, world=world,
                                        config_json=model.config.model_dump_json(), bucket_bytes=bucket_bytes))
    return sent


@pytest.mark.parametrize("world", [1, 3])
def test_a_version_published_in_buckets_by_ranks_loads_back_exactly(world, tmp_path):
    model = small_model(VOCAB)
    state = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    sent = _publish_on(world, tmp_path, 5, model, bucket_bytes=16 << 10)
    assert sum(s.buckets for s in sent) > world          # bounded buckets: more than one per rank
    if world > 1:                                        # the ranks share the bytes
        assert max(s.bytes for s in sent) < 0.6 * sum(s.bytes for s in sent)
    for p in tmp_path.glob("v*/*.safetensors"):
        tensors = weight_sync.load_file(str(p))
        if len(tensors) > 1:                             # a tensor over the bound goes alone
            assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 16 << 10
    config, loaded, moved = weight_sync.load_version(tmp_path, 5)
    assert moved == sum(s.bytes for s in sent) and moved >= total
    other = small_model(VOCAB, seed=1)
    weight_sync.apply(other, loaded)
    for k, v in state.items():
        assert torch.equal(other.state_dict()[k], v), k
    assert json.loads(config)["vocab_size"] == VOCAB


def test_expert_shards_are_joined_in_order(tmp_path):
    full = torch.arange(24.0).reshape(4, 6)
    for r in range(2):
        weight_sync.publish(tmp_path, 1, {"experts.w": full[2 * r:2 * r + 2], **({"norm": torch.ones(3)} if r == 0 else {})},
                            rank=r, world=2, shards={"experts.w": Shard(r, 2)})
    _, state, _ = weight_sync.load_version(tmp_path, 1)
    assert torch.equal(state["experts.w"], full) and torch.equal(state["norm"], torch.ones(3))


def test_a_version_missing_a_rank_or_a_shard_is_refused(tmp_path):
    model = small_model(VOCAB)
    weight_sync.publish(tmp_path, 2, weight_sync.rank_part(model, 0, 2), rank=0, world=2)
    assert not weight_sync.complete(tmp_path, 2)
    with pytest.raises(IncompleteVersion, match="version 2 is not complete"):
        weight_sync.load_version(tmp_path, 2)
    weight_sync.publish(tmp_path, 3, {"experts.w": torch.zeros(2, 2)}, rank=0, world=1, shards={"experts.w": Shard(0, 2)})
    with pytest.raises(IncompleteVersion, match=r"expert shards \[0\] of 2"):
        weight_sync.load_version(tmp_path, 3)


def test_a_corrupt_bucket_is_refused_and_nothing_is_applied(tmp_path):
    model = small_model(VOCAB)
    _publish_on(2, tmp_path, 4, model, bucket_bytes=16 << 10)
    bucket = sorted(tmp_path.glob("v00000004/rank00001-*.safetensors"))[0]
    raw = bytearray(bucket.read_bytes())
    raw[-1] ^= 0xFF
    bucket.write_bytes(bytes(raw))
    with pytest.raises(CorruptBucket, match=bucket.name):
        weight_sync.load_version(tmp_path, 4)


def test_a_state_that_does_not_cover_the_model_is_not_applied(tmp_path):
    model = small_model(VOCAB)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    partial = dict(small_model(VOCAB, seed=1).state_dict())
    partial.pop(next(iter(partial)))
    with pytest.raises(IncompleteVersion, match="missing"):
        weight_sync.apply(model, partial)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_prune_keeps_the_newest_complete_versions_and_one_in_progress(tmp_path):
    model = small_model(VOCAB)
    for v in (1, 2, 3):
        _publish_on(1, tmp_path, v, model, 1 << 30)
    weight_sync.publish(tmp_path, 4, {"x": torch.zeros(1)}, rank=0, world=2)      # rank 1 still writing
    weight_sync.prune(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v00000002", "v00000003", "v00000004"]


def _nudge(model, scale: float = 1e-3, every: int = 2) -> None:
    """An optimizer-step-like change: every `every`-th tensor moves a little, the rest stay."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % every == 0:
                p.add_(scale * torch.randn_like(p))


def test_a_delta_version_loads_to_the_same_bytes_as_a_full_one_on_ranks_with_expert_shards(tmp_path):
    torch.manual_seed(0)
    model = small_model(VOCAB)
    expert = {k for k in model.state_dict() if ".experts." in k}
    assert expert

    def parts(m):
        state = m.state_dict()
        out = []
        for r in range(2):
            part = {k: v.clone() for k, v in weight_sync.rank_part(m, r, 2, {k: Shard(r, 2) for k in expert}).items()}
            part.update({k: state[k].chunk(2)[r].clone() for k in expert})       # rank r holds shard r
            out.append(part)
        return out

    def publish(version, m, base=None):
        sent = []
        for r, part in enumerate(parts(m)):
            sent.append(weight_sync.publish(tmp_path, version, part, rank=r, world=2, bucket_bytes=16 << 10,
                                            shards={k: Shard(r, 2) for k in expert},
                                            base=None if base is None else (version - 1, base[r])))
        return sent

    full = publish(1, model)
    v1 = parts(model)
    _nudge(model)
    delta = publish(2, model, base=v1)
    assert all(s.base == 1 for s in delta) and all(s.base is None for s in full)
    assert sum(s.bytes for s in delta) < 0.8 * sum(s.full_bytes for s in delta)   # half the tensors did not move
    assert sum(s.full_bytes for s in delta) == sum(s.full_bytes for s in full)
    want = model.state_dict()
    _, held, _ = weight_sync.load_version(tmp_path, 1)
    _, applied, moved = weight_sync.load_version(tmp_path, 2, held=(1, held))       # on the version held
    _, rebuilt, moved_chain = weight_sync.load_version(tmp_path, 2)                 # from its chain
    assert moved == sum(s.bytes for s in delta) and moved_chain > moved
    for k, v in want.items():
        assert torch.equal(applied[k], v) and torch.equal(rebuilt[k], v), k
    assert weight_sync.chain(tmp_path, 2) == [1, 2]
    assert weight_sync.first_difference(weight_sync.expected_checksums(tmp_path, 2),
                                        weight_sync.checksums(applied, tmp_path, 2)) is None
    # a reader holding another version than the delta's base ends with other bytes: refused by checksum
    _nudge(model, every=1)
    with pytest.raises(CorruptBucket, match="does not match its checksum"):
        weight_sync.load_version(tmp_path, 2, held=(1, model.state_dict()))


def test_checksums_name_the_stale_piece(tmp_path):
    model = small_model(VOCAB)
    _publish_on(1, tmp_path, 1, model, 1 << 30)
    held = {k: v.clone() for k, v in model.state_dict().items()}
    name = sorted(held)[3]
    held[name][..., 0] += 1
    assert weight_sync.first_difference(weight_sync.expected_checksums(tmp_path, 1),
                                        weight_sync.checksums(held, tmp_path, 1)) == name


def test_prune_keeps_the_chain_a_delta_needs(tmp_path):
    model = small_model(VOCAB)
    _publish_on(1, tmp_path, 1, model, 1 << 30)
    for v in (2, 3, 4):
        base = {k: t.clone() for k, t in model.state_dict().items()}
        _nudge(model)
        weight_sync.publish(tmp_path, v, model.state_dict(), base=(v - 1, base))
    weight_sync.prune(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v00000001", "v00000002", "v00000003", "v00000004"]
    _, state, _ = weight_sync.load_version(tmp_path, 4)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="differ in"):
        weight_sync.publish(tmp_path, 5, {"x": torch.zeros(1)}, base=(4, {"y": torch.zeros(1)}))


def test_a_delta_must_name_an_earlier_version(tmp_path):
    t = {"x": torch.zeros(2)}
    weight_sync.publish(tmp_path, 3, t)
    with pytest.raises(ValueError, match="cannot be a delta on version 3"):
        weight_sync.publish(tmp_path, 3, t, base=(3, t))


def test_an_engine_reads_only_the_expert_shards_it_serves_deltas_included(tmp_path):
    """An expert-parallel server worker's read (load_pieces + expert_selector): the dense pieces
    and the shards holding its experts, fewer bytes than the whole version, each piece equal to
    the published one; a delta applies on the pieces it holds; a partly read bucket whose piece
    was altered is refused by the piece's checksum."""
    torch.manual_seed(0)
    model = small_model(VOCAB)
    E = model.config.n_routed_experts
    expert = sorted(k for k in model.state_dict() if ".experts." in k)
    shards = {k: Shard(0, 4) for k in expert}

    def publish(version, base=None):
        state, sent = model.state_dict(), []
        for r in range(4):
            part = {k: v.clone() for k, v in weight_sync.rank_part(model, r, 4, shards).items()}
            part.update({k: state[k].chunk(4)[r].clone() for k in expert})         # rank r holds shard r of 4
            sent.append((part, weight_sync.publish(tmp_path, version, part, rank=r, world=4, bucket_bytes=1 << 20,
                                                   shards={k: Shard(r, 4) for k in expert},
                                                   base=None if base is None else (version - 1, base[r]))))
        return [p for p, _ in sent], sum(s.bytes for _, s in sent)

    v1, _ = publish(1)
    local = {k.rsplit(".", 1)[0]: set(range(E // 4, 2 * E // 4)) for k in expert}    # shard 1's experts only
    want = weight_sync.expert_selector(local, E)
    _, pieces, moved = weight_sync.load_pieces(tmp_path, 1, want=want)
    _, every, moved_all = weight_sync.load_pieces(tmp_path, 1)
    assert moved < moved_all
    sharded = {pid for pid, (_, s) in pieces.where.items() if s is not None}
    assert sharded == {weight_sync.piece_id(k, (1, 4)) for k in expert}
    assert all(torch.equal(pieces.tensors[pid], every.tensors[pid]) for pid in pieces.tensors)
    assert {pid for pid, (_, s) in pieces.where.items() if s is None} == \
        {pid for pid, (_, s) in every.where.items() if s is None}
    with pytest.raises(IncompleteVersion):
        pieces.whole()                                  # three shards of each expert tensor were not read

    _nudge(model)
    publish(2, base=v1)
    held = pieces.tensors
    _, after, _ = weight_sync.load_pieces(tmp_path, 2, (1, lambda n, s: held[weight_sync.piece_id(n, s)]), want)
    _, rebuilt, _ = weight_sync.load_pieces(tmp_path, 2, want=want)                # its chain, the same filter
    state = model.state_dict()
    for pid, t in after.tensors.items():
        name, shard = after.where[pid]
        ref = state[name] if shard is None else state[name].chunk(4)[shard[0]]
        assert torch.equal(t, ref) and torch.equal(rebuilt.tensors[pid], ref), pid

    # a bucket read in part (rank 0's: its dense share and the unwanted shard 0): its sha256 is
    # not checked, each piece's checksum is
    target = weight_sync.version_dir(tmp_path, 1) / "rank00000-0000.safetensors"
    tensors = weight_sync.load_file(str(target))
    name = next(k for k in sorted(tensors) if ".experts." not in k)
    tensors[name] = tensors[name] + 1
    weight_sync.save_file(tensors, str(target))
    with pytest.raises(CorruptBucket, match=f"{name}.* does not match its checksum"):
        weight_sync.load_pieces(tmp_path, 1, want=want)
