"""Sizes and bandwidths as typed on a command line: one reading each, or a refusal."""

import pytest
from pydantic import BaseModel, Field, ValidationError

from common.units import Bytes, BytesPerSecond


class Limits(BaseModel):
    size: Bytes = Field(0, ge=0)
    positive: Bytes = Field(1, gt=0)
    rate: BytesPerSecond = Field(1.0, gt=0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1 << 30),
        ("2GB", 2 * 10**9),
        ("2 gb", 2 * 10**9),
        ("512MiB", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("0", 0),
        (4096, 4096),
    ],
)
def test_sizes_take_decimal_and_binary_units(text, expected):
    assert Limits(size=text).size == expected


@pytest.mark.parametrize("text", ["2GX", "-1", "lots", "1e9", "2GBps", "2 GB please", "2GB,"])
def test_an_unreadable_size_shows_the_accepted_forms(text):
    with pytest.raises(ValidationError) as err:
        Limits(size=text)
    (only,) = err.value.errors()
    assert only["type"] == "byte_size"
    assert "2GB or 512MiB" in only["msg"]


def test_a_size_keeps_its_range_check():
    with pytest.raises(ValidationError, match="greater than 0"):
        Limits(positive="0")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("125e6", 125e6),
        ("125000000", 125e6),
        ("125MB/s", 125e6),
        (" 12 kB/s ", 12e3),
        ("1MiB/s", float(1 << 20)),
        (3, 3.0),
    ],
)
def test_bandwidths_are_bytes_per_second(text, expected):
    assert Limits(rate=text).rate == pytest.approx(expected)


@pytest.mark.parametrize("text", ["1gbit", "100Mbps", "100Mb/s", "1GBIT", "10 bits"])
def test_bits_are_refused_by_name(text):
    with pytest.raises(ValidationError, match="that is bits per second; bandwidths are bytes"):
        Limits(rate=text)


@pytest.mark.parametrize("text", ["125M", "fast", "inf", "nan", "125 MB"])
def test_a_bandwidth_without_its_unit_is_refused_not_guessed(text):
    with pytest.raises(ValidationError) as err:
        Limits(rate=text)
    (only,) = err.value.errors()
    assert only["type"] == "bandwidth"
    assert not only["msg"].startswith("that is bits")
    assert "125MB/s" in only["msg"]


def test_a_bandwidth_keeps_its_range_check():
    with pytest.raises(ValidationError, match="greater than 0"):
        Limits(rate="0")
