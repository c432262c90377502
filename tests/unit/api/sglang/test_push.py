"""Where SGLang's messages may go (service/api/sglang/push.py): addresses in --sglang-allowed-hosts only, IPv4,
IPv6 and IPv4-mapped alike, never a name; a rank's host:port parsed as SGLang writes it."""

import pytest

from service.api.sglang.push import Endpoint, Pusher
from service.errors import RequestError


def test_only_addresses_in_the_allowed_networks_and_never_a_name():
    p = Pusher(["127.0.0.0/8", "::1/128", "10.1.0.0/16"], 1.0)
    assert [p.allowed(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "10.1.200.3", "::ffff:10.1.0.9")] == [True] * 6
    assert [p.allowed(h) for h in ("10.2.0.1", "169.254.169.254", "::2", "localhost", "example.com", "", "fe80::1%eth0",
                                   "::ffff:8.8.8.8")] == [False] * 8
    with pytest.raises(RequestError, match="prefill_host '10.2.0.1' is not in --sglang-allowed-hosts") as e:
        p.endpoint("10.2.0.1", 5000, "prefill_host")
    assert e.value.status == 403


def test_a_ranks_receive_url_is_host_port_with_an_ipv6_host_in_brackets():
    p = Pusher(["127.0.0.0/8", "::1/128"], 1.0)
    assert p.parse_receive_url("127.0.0.1:5001") == Endpoint("127.0.0.1", 5001)
    assert p.parse_receive_url("[::1]:5002").url == "tcp://[::1]:5002"
    for bad in ("127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", ":5000", "127.0.0.1:x"):
        with pytest.raises(RequestError, match="is not host:port"):
            p.parse_receive_url(bad)
    with pytest.raises(RequestError) as e:
        p.parse_receive_url("10.0.0.1:5000")
    assert e.value.status == 403
