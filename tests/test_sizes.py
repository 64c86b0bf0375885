import pytest

from kvpool.errors import ConfigError
from kvpool.sizes import parse_bytes


@pytest.mark.parametrize("text,expected", [("512MiB", 512 * 2**20), ("4GB", 4 * 10**9), ("1.5g", 1_500_000_000),
                                           ("1024", 1024), (7, 7), ("2 GiB", 2 * 2**30)])
def test_sizes_read_units(text, expected):
    assert parse_bytes(text, "size") == expected


def test_a_fraction_is_of_the_available_memory():
    assert parse_bytes("0.25", "kv", available=1000) == 250
    with pytest.raises(ConfigError, match="needs a known memory size"):
        parse_bytes("0.25", "kv")


def test_bad_size_names_the_flag_and_value():
    with pytest.raises(ConfigError, match=r"--kv-disk-size: cannot read '12 parsecs'"):
        parse_bytes("12 parsecs", "--kv-disk-size")
