"""Testbed tests skip where they cannot run, except in CI as root, where they fail."""

from __future__ import annotations

import os

import pytest

from tests.testbed.conftest import must_run, skip_or_fail


@pytest.mark.parametrize(
    ("ci", "euid", "runs"),
    [
        ("true", 0, True),
        ("TRUE", 0, True),
        ("1", 0, True),
        ("true", 1000, False),  # not root: the privilege is missing, skipping stays
        (None, 0, False),  # a developer's machine
        ("false", 0, False),
        ("", 0, False),
    ],
)
def test_tests_must_run_only_in_ci_as_root(ci, euid, runs):
    assert must_run(ci, euid) is runs


def test_in_ci_as_root_a_reason_to_skip_is_a_failure(monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(pytest.fail.Exception, match="must run, but: no cgroup v2 here"):
        skip_or_fail("no cgroup v2 here")


@pytest.mark.parametrize(("ci", "euid"), [("true", 1000), ("false", 0)])
def test_elsewhere_the_reason_skips(monkeypatch, ci, euid):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        skip_or_fail("needs root")
