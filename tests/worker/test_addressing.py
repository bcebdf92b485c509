import pytest

from common.errors import ConfigError
from services.worker.addressing import data_hosts


def test_a_loopback_coordinator_keeps_everything_on_loopback():
    assert data_hosts("", "", "tcp://127.0.0.1:5555") == ("127.0.0.1", "127.0.0.1")
    assert data_hosts("", "", "tcp://localhost:5555") == ("127.0.0.1", "127.0.0.1")


def test_binding_everywhere_advertises_the_route_to_the_coordinator():
    assert data_hosts("", "", "tcp://127.0.0.2:5555")[0] == "127.0.0.1"  # 127/8 is loopback
    bind, advertised = data_hosts("0.0.0.0", "", "tcp://127.0.0.1:5555")
    assert bind == "0.0.0.0" and advertised == "127.0.0.1"


def test_explicit_settings_win():
    assert data_hosts("10.1.2.3", "", "tcp://10.9.9.9:5555") == ("10.1.2.3", "10.1.2.3")
    assert data_hosts("0.0.0.0", "dev.lan", "tcp://10.9.9.9:5555") == ("0.0.0.0", "dev.lan")


def test_a_coordinator_address_without_host_is_named():
    with pytest.raises(ConfigError, match="coordinator: 'ipc:///tmp/x'"):
        data_hosts("", "", "ipc:///tmp/x")
