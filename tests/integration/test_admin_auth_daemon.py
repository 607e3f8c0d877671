"""The admin surface and /metrics on a real daemon: the admin key is required, a tenant
key is refused, and the CLI sends the key it is given."""
from __future__ import annotations

import hashlib
from helpers.daemons import http

ADMIN_KEY, TENANT_KEY = "adm-secret-1", "sk-search-1"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_daemon_admin_routes_need_the_admin_key(daemon_factory, tiny_model):
    config = (f'[auth]\nadmin_keys = ["{_digest(ADMIN_KEY)}"]\nmetrics_access = "admin"\n'
              f'[auth.keys]\n"{_digest(TENANT_KEY)}" = "search"\n')
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "50",
                       model=tiny_model, config=config)
    code, headers, body = http("GET", d.url + "/admin/v1/status")
    assert code == 401 and body["error"]["code"] == "invalid_api_key"
    assert "model_dir" not in str(body)
    code, _, body = http("GET", d.url + "/admin/v1/status",
                         headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert code == 403 and body["error"]["type"] == "permission_error"
    code, _, body = http("GET", d.url + "/admin/v1/status",
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert code == 200 and body["workers"]
    code, _, body = http("GET", d.url + "/metrics")
    assert code == 403 and body["error"]["code"] == "forbidden"
    code, _, text = http("GET", d.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert code == 200 and b"applianced_worker_up" in text
    # the CLI sends the key it is given, and says in one line when it has none
    from appliance.cli import main
    assert main(["status", "--url", d.url, "--admin-key", ADMIN_KEY, "--json"]) == 0
    assert main(["status", "--url", d.url]) == 1
