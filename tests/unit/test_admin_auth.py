"""The admin surface and /metrics: who may read them (issue: admin surfaces behind keys)."""
from __future__ import annotations

import hashlib
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from appliance.daemon.auth import Auth, Caller
from appliance.daemon.openai_protocol import ApiError

ADMIN_KEY, TENANT_KEY = "adm-secret-1", "sk-search-1"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _request(peer: str, key: str | None = None, path: str = "/admin/v1/status"):
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: \
        (peer, 51000) if name == "peername" else default
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return make_mocked_request("GET", path, headers=headers, transport=transport)


def test_no_admin_keys_means_loopback_only():
    auth = Auth({_digest(TENANT_KEY): "search"})
    assert auth.caller(_request("127.0.0.1")) == Caller(admin=True)
    assert auth.caller(_request("::1")) == Caller(admin=True)
    with pytest.raises(ApiError) as err:
        auth.caller(_request("10.1.2.3"))
    assert err.value.status == 403 and "loopback" in err.value.message
    # a tenant key from anywhere is a tenant, not an operator
    assert auth.caller(_request("10.1.2.3", TENANT_KEY)) == Caller(admin=False, tenant="search")
    with pytest.raises(ApiError) as err:
        auth.caller(_request("127.0.0.1", "wrong"))
    assert err.value.status == 401


def test_admin_keys_are_required_even_on_loopback():
    auth = Auth({}, [_digest(ADMIN_KEY)])
    for peer in ("127.0.0.1", "192.168.7.7"):
        with pytest.raises(ApiError) as err:
            auth.caller(_request(peer))
        assert err.value.status == 401
        assert auth.caller(_request(peer, ADMIN_KEY)) == Caller(admin=True)
        with pytest.raises(ApiError):
            auth.caller(_request(peer, "not-the-key"))


@pytest.mark.parametrize("access,peer,key,allowed", [
    ("open", "10.0.0.9", None, True),
    ("loopback", "127.0.0.1", None, True),
    ("loopback", "10.0.0.9", None, False),
    ("loopback", "10.0.0.9", ADMIN_KEY, True),
    ("admin", "127.0.0.1", None, False),
    ("admin", "127.0.0.1", ADMIN_KEY, True),
    ("admin", "10.0.0.9", TENANT_KEY, False),
])
def test_metrics_access(access, peer, key, allowed):
    auth = Auth({_digest(TENANT_KEY): "search"}, [_digest(ADMIN_KEY)], access)
    assert auth.metrics_allowed(_request(peer, key, "/metrics")) is allowed
