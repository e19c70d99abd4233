from __future__ import annotations

import pytest

import fastpersist as fp
from fastpersist.config import MiB, IOConfig, config_from_env


def test_environment_overrides():
    cfg = config_from_env({
        "FASTPERSIST_CHUNK_MB": "8", "FASTPERSIST_BUFFERS": "3", "FASTPERSIST_WRITERS": "5",
        "FASTPERSIST_READERS": "6", "FASTPERSIST_READ_CHUNK_MB": "2", "FASTPERSIST_DIRECT": "OFF",
        "FASTPERSIST_VERIFY": "0", "FASTPERSIST_DRAIN_NICE": "17", "FASTPERSIST_PIPELINE": " On",
        "FASTPERSIST_SINGLE_ZERO_COPY": "1", "FASTPERSIST_SAVE_NICE": "5",
    })
    assert (cfg.chunk_bytes, cfg.num_buffers, cfg.writer_threads) == (8 * MiB, 3, 5)
    assert (cfg.reader_threads, cfg.read_chunk_bytes, cfg.direct, cfg.verify) == (6, 2 * MiB, "off", False)
    assert cfg.pool_bytes == 24 * MiB and cfg.drain_nice == 17 and cfg.snapshot_pipeline == "on"
    assert cfg.single_file_zero_copy and not IOConfig().single_file_zero_copy
    assert cfg.save_process_nice == 5 and IOConfig().save_process_nice == 0


def test_defaults_bound_the_pool():
    assert IOConfig().pool_bytes <= 256 * MiB


@pytest.mark.parametrize("env", [{"FASTPERSIST_CHUNK_MB": "x"}, {"FASTPERSIST_DIRECT": "sometimes"},
                                 {"FASTPERSIST_BUFFERS": "0"}, {"FASTPERSIST_DRAIN_NICE": "20"},
                                 {"FASTPERSIST_PIPELINE": "sometimes"}, {"FASTPERSIST_SAVE_NICE": "-1"}])
def test_bad_settings_are_errors(env):
    with pytest.raises(fp.CheckpointError):
        config_from_env(env)


def test_unaligned_chunk_is_an_error():
    with pytest.raises(fp.CheckpointError, match="4096"):
        IOConfig(chunk_bytes=1000)


def test_configure_restores():
    before = fp.get_config()
    with fp.configure(num_buffers=2) as cfg:
        assert cfg.num_buffers == 2 and fp.get_config().num_buffers == 2
    assert fp.get_config() == before
