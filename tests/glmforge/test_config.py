from __future__ import annotations

import pytest

from glmforge.config import CONFIGS_DIR, ConfigError, load_config


def test_presets_validate():
    for path in sorted(CONFIGS_DIR.glob("*.yaml")):
        load_config(path.stem)


def test_override_sets_nested_values():
    cfg = load_config("tiny", overrides=["ingest.shard_size=7", "run.seed=99", "ingest.sources.0.max_documents=3"])
    assert cfg.ingest.shard_size == 7 and cfg.run.seed == 99 and cfg.ingest.sources[0].max_documents == 3


def test_unknown_preset_lists_known():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*tiny"):
        load_config("nope")


def test_bad_override_names_field_and_reason():
    with pytest.raises(ConfigError, match=r"--set ingest\.shard_size=0: field ingest\.shard_size: .*greater than 0"):
        load_config("tiny", overrides=["ingest.shard_size=0"])
    with pytest.raises(ConfigError, match=r"field ingest\.shard_sise: Extra inputs are not permitted"):
        load_config("tiny", overrides=["ingest.shard_sise=5"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config("tiny", overrides=["ingest.shard_size"])


def test_an_unknown_section_is_blamed_on_the_set_that_names_it():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=["ingest.shard_size=7", "nosuch.key=1"])
    assert str(err.value) == "invalid config: --set nosuch.key=1: field nosuch: Extra inputs are not permitted"


def test_a_file_that_is_not_utf8_is_named_with_its_line_and_byte_offset(tmp_path):
    path = tmp_path / "latin1.yaml"
    data = "run:\n  seed: 1  # café\n".encode("latin-1")
    path.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        load_config(config_file=path)
    assert str(err.value) == (f"{path}:2: not UTF-8 text (byte 0xe9 at byte offset {data.index(0xe9)}); "
                              "save the file as UTF-8")


def test_bad_file_names_file_line_field(tmp_path):
    text = (CONFIGS_DIR / "tiny.yaml").read_text().replace("shard_size: 1000", "shard_size: lots")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = next(i for i, l in enumerate(text.splitlines(), 1) if "shard_size: lots" in l)
    with pytest.raises(ConfigError, match=rf"bad\.yaml:{line}: field ingest\.shard_size: .*integer"):
        load_config(config_file=path)


def test_invalid_yaml_names_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("run:\n  name: x\n  seed: [1,\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:\d+: invalid YAML"):
        load_config(config_file=path)


def test_missing_section_is_reported(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("run: {seed: 3}\n")
    with pytest.raises(ConfigError, match=r"field ingest: Field required"):
        load_config(config_file=path)


def test_prefect_yaml_deploys_every_stage():
    import yaml

    from glmforge.pipeline import STAGE_NAMES

    spec = yaml.safe_load((CONFIGS_DIR.parent / "prefect.yaml").read_text())
    stages = [d["parameters"]["stage"] for d in spec["deployments"] if d["entrypoint"].endswith(":stage")]
    assert stages == STAGE_NAMES
    pipeline = [d for d in spec["deployments"] if d["entrypoint"].endswith(":pipeline")]
    assert len(pipeline) == 1 and pipeline[0]["schedules"][0]["active"] is False


def test_a_preset_extends_another_and_holds_only_its_differences(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("extends: tiny\nrun: {seed: 7}\npretrain:\n  max_steps: 3\n")
    base, cfg = load_config("tiny"), load_config(config_file=child)
    assert (cfg.run.seed, cfg.pretrain.max_steps) == (7, 3)
    # everything else, nested fields of the overridden section included, comes from tiny
    assert cfg.pretrain.model_copy(update={"max_steps": base.pretrain.max_steps}) == base.pretrain
    assert cfg.sft == base.sft and cfg.ingest == base.ingest
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: child.yaml\npretrain:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:3: field pretrain\.lr"):
        load_config(config_file=bad)
    loop = tmp_path / "loop.yaml"
    loop.write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(config_file=loop)
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        child.write_text("extends: nope\n")
        load_config(config_file=child)



def test_an_automatic_rerun_past_max_preemptions_is_refused_without_reading_as_a_preemption():
    from glmforge.config import RetryConfig, check_preemptions

    check_preemptions(3, RetryConfig(max_preemptions=3))
    with pytest.raises(RuntimeError, match=r"preempted 4 times in a row.*max_preemptions=3") as e:
        check_preemptions(4, RetryConfig(max_preemptions=3))
    assert "Preempted" not in str(e.value)  # else the automation would rerun the refusal too
