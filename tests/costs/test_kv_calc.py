import pytest

from kvpool.costs.kv_calc import format_table, kv_calc_table, prefill_flops
from kvpool.costs.presets import HARDWARE, MODELS
from kvpool.errors import ConfigError

A100 = HARDWARE["a100-80gb"]


def test_kv_bytes_follow_the_model_shape():
    (row,) = kv_calc_table(MODELS["llama2-70b"], A100, [1000])
    assert row.kv_bytes == 1000 * 2 * 80 * 8 * 128 * 2  # K+V, layers, kv heads, head dim, fp16


def test_gqa_stores_far_fewer_bytes_per_flop_than_mha():
    (gqa,) = kv_calc_table(MODELS["llama2-70b"], A100, [2048])
    (mha,) = kv_calc_table(MODELS["opt-13b"], A100, [2048])
    assert mha.bytes_per_gflop > 10 * gqa.bytes_per_gflop
    assert gqa.speedup("disk") > mha.speedup("disk")


def test_recompute_grows_faster_than_reading_with_context():
    rows = kv_calc_table(MODELS["opt-13b"], A100, [512, 32768])
    assert rows[1].speedup("host") > rows[0].speedup("host")
    assert prefill_flops(MODELS["opt-13b"], 2) > 2 * prefill_flops(MODELS["opt-13b"], 1)


def test_local_nvme_is_the_slowest_tier_on_an_a100():
    (row,) = kv_calc_table(MODELS["llama2-7b"], A100, [4096])
    assert max(row.host_s, row.remote_s) < row.disk_s


def test_bad_arguments_name_the_value():
    with pytest.raises(ConfigError, match="1.5"):
        kv_calc_table(MODELS["opt-13b"], A100, mfu=1.5)
    with pytest.raises(ConfigError, match="-3"):
        kv_calc_table(MODELS["opt-13b"], A100, [-3])


def test_format_table_has_one_line_per_row_plus_header():
    rows = kv_calc_table(MODELS["opt-13b"], A100)
    assert len(format_table(rows).splitlines()) == len(rows) + 1
