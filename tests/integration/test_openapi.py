"""`/openapi.json`: a valid OpenAPI 3.1 document of every route, whose request schemas are
the ones the daemon validates against; and schemathesis fuzzing a real daemon (simulator,
admin key) from it: no 5xx, every error in OpenAI's shape, no hang.

Excluded from the fuzzing, and why: starting workflows (`POST /admin/v1/workflows`)
repartitions, swaps, drains: it is fuzzed on a throwaway daemon of its own, with the
fuzzer's kinds kept to names that are no workflow (the real ones have their own tests in
test_workflows.py). `/admin/v1/stream` never ends by design: it is fuzzed with a
streamed call that reads the status and closes.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
from aiohttp import web

from appliance.daemon import server
from appliance.daemon.openapi import document
from appliance.daemon.responses import OPERATIONS
from helpers.daemons import http, start_daemon

MODEL = "tiny-llama"
ADMIN_KEY = "adm-fuzz-1"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
CONFIG = (f'[auth]\nadmin_keys = ["{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"]\n'
          'metrics_access = "admin"\n[server]\nmax_body_bytes = 65536\n')
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))          # per operation: the whole fuzz stays near a minute on 2 busy cores
CALL_TIMEOUT_S = 20     # a request that takes longer is a hang


@pytest.fixture(scope="module")
def daemon(tiny_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("openapi"), tiny_model, "--devices", "cpu",
                     "--engine", "sim", "--sim-speed", "1000", config=CONFIG)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def served(daemon) -> dict:
    code, _, doc = http("GET", daemon.url + "/openapi.json")
    assert code == 200, doc
    return doc


def _bare_app() -> web.Application:
    """The daemon's routes, added as `server.build_app` adds them (no service behind)."""
    app = web.Application()
    server.add_surfaces(app)
    return app


def test_the_document_is_valid_openapi_3_1(served):
    from openapi_spec_validator import validate
    from openapi_spec_validator.validation.exceptions import OpenAPIValidationError
    validate(served)                                    # raises on an invalid document
    assert served["openapi"].startswith("3.1")
    broken = json.loads(json.dumps(served))
    broken["paths"]["/v1/models"]["get"]["responses"] = "nothing"
    with pytest.raises(OpenAPIValidationError):        # the validator does look
        validate(broken)


def test_every_registered_route_is_documented(served):
    app = _bare_app()
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD"}                  # aiohttp's HEAD twin of each GET
    documented = {(m.upper(), path) for path, item in served["paths"].items() for m in item}
    assert routes == documented
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready",
            "/metrics", "/openapi.json", "/admin/v1/status", "/admin/v1/workflows/{id}"} \
        <= set(served["paths"])
    # The served document is the one rendered from the registered declarations.
    assert document(app[OPERATIONS]) == served
    # A route added without a declaration would be missing from it:
    async def secret(request):
        return web.Response()
    app2 = _bare_app()
    app2.router.add_get("/admin/v1/secret", secret)
    assert ("GET", "/admin/v1/secret") not in {
        (op.method, op.path) for op in app2[OPERATIONS]}


def test_the_documented_schema_is_the_validating_one(daemon, served):
    """Bounds changed in the declaration change both: the document shows the bound the
    daemon enforces, for a body and for a query parameter."""
    chat = served["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    temp = chat["properties"]["temperature"]
    assert (temp["minimum"], temp["maximum"]) == (0, 2)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1}
    assert daemon.post("/v1/chat/completions", {**body, "temperature": 2})[0] == 200
    code, _, err = daemon.post("/v1/chat/completions", {**body, "temperature": 2.01})
    assert code == 400 and err["error"]["param"] == "temperature", err
    assert "at most 2" in err["error"]["message"]
    limit = next(p for p in served["paths"]["/admin/v1/workflows"]["get"]["parameters"]
                 if p["name"] == "limit")["schema"]
    assert limit["maximum"] == 1000
    ok = http("GET", daemon.url + "/admin/v1/workflows?limit=1000", headers=AUTH)
    too_many = http("GET", daemon.url + "/admin/v1/workflows?limit=1001", headers=AUTH)
    assert ok[0] == 200 and too_many[0] == 400 and too_many[2]["error"]["param"] == "limit"


# ---- schemathesis -------------------------------------------------------------------


def _error_shape(response) -> None:
    """Every non-2xx answer is OpenAI's error JSON."""
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"], body
    assert "Traceback" not in err["message"], body


def _check(case, response) -> None:
    assert response.status_code < 500, (case.as_curl_command(), response.status_code,
                                        response.text[:500])
    _error_shape(response)


@pytest.fixture(scope="module")
def api(daemon, served):
    import schemathesis
    return schemathesis.openapi.from_dict(served)


def _fuzz(api, url: str, method: str, path: str, mode: str, examples: int = EXAMPLES,
          body: dict | None = None) -> int:
    """Fuzz one operation with `examples` cases of `mode` (positive: bodies the schema
    allows; negative: bodies it refuses, which must be 4xx). Returns the calls made."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import checks
    from schemathesis.generation import GenerationMode

    op = api[path][method]
    strategy = op.as_strategy(GenerationMode(mode))
    calls = []
    statuses: dict[int, int] = {}
    extra = [checks.negative_data_rejection] if mode == "negative" else []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        calls.append(case)
        if path == "/admin/v1/stream":      # never ends: read the answer's head, close
            import requests
            with requests.request(**case.as_transport_kwargs(url, AUTH), stream=True,
                                  timeout=CALL_TIMEOUT_S) as response:
                if response.status_code != 200:
                    _check(case, response)
                else:
                    assert next(response.iter_lines()) == b": keepalive"
            return
        if mode == "positive" and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL      # the served one: a body that may reach a worker
        if mode == "positive" and isinstance(case.body, dict) and body:
            case.body.update(body)
        response = case.call(url, headers=AUTH, timeout=CALL_TIMEOUT_S)   # a hang raises
        key = response.status_code
        if key >= 400 and path.startswith("/v1/"):
            key = f"{key} {response.json()['error']['param']}"
        statuses[key] = statuses.get(key, 0) + 1
        _check(case, response)
        if extra:
            case.validate_response(response, checks=extra, headers=AUTH)

    try:
        run()
    except Unsatisfiable:       # nothing to break: a path parameter that takes any string
        assert mode == "negative"
    print(method, path, mode, sorted(statuses.items(), key=lambda kv: -kv[1]))
    return len(calls)


def _operations(doc: dict, mode: str, skip=()) -> list[tuple[str, str]]:
    """Negative cases need something to break: operations without parameters or a body
    have none."""
    return [(m.upper(), path) for path, item in doc["paths"].items() for m, op in item.items()
            if (m.upper(), path) not in skip
            and (mode == "positive" or op.get("parameters") or op.get("requestBody"))]


DESTRUCTIVE = {("POST", "/admin/v1/workflows")}


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzing_every_operation_finds_no_5xx_and_only_openai_errors(api, served, daemon, mode):
    made = {}
    only = os.environ.get("FUZZ_ONLY")         # a path, to rerun one operation's fuzzing
    for method, path in _operations(served, mode, skip=DESTRUCTIVE):
        if only and path != only:
            continue
        started = time.monotonic()
        made[(method, path)] = _fuzz(api, daemon.url, method, path, mode)
        print(f"{mode} {method} {path}: {made[(method, path)]} cases, "
              f"{time.monotonic() - started:.1f} s")
    assert only or made[("POST", "/v1/chat/completions")] >= EXAMPLES, made
    assert mode == "negative" or all(n > 0 for n in made.values()), made
    assert daemon.proc.poll() is None          # and the daemon is still there
    code, _, status = http("GET", daemon.url + "/admin/v1/status", headers=AUTH)
    assert code == 200 and status["workers"], status


def test_fuzzing_workflow_starts_on_a_throwaway_daemon(daemon_factory, tiny_model, tmp_path):
    """Starting workflows repartitions, swaps models, drains: fuzzed on a daemon of its own
    (whatever the fuzzer starts, nothing else uses that daemon)."""
    import schemathesis
    d = daemon_factory("--devices", "cpu", "--engine", "sim", "--sim-speed", "1000",
                       model=tiny_model, config=CONFIG)
    code, _, doc = http("GET", d.url + "/openapi.json")
    api = schemathesis.openapi.from_dict(doc)
    from appliance.workflows.kinds import KINDS
    for mode in ("positive", "negative"):
        assert _fuzz(api, d.url, "POST", "/admin/v1/workflows", mode) > 0
    for kind in KINDS:          # each real kind with the fuzzer's params
        assert _fuzz(api, d.url, "POST", "/admin/v1/workflows", "positive",
                     body={"kind": kind}) > 0
    assert d.proc.poll() is None
    code, _, listed = http("GET", d.url + "/admin/v1/workflows", headers=AUTH)
    assert code == 200, listed


def test_absurd_planner_what_ifs_are_a_400_not_a_500(daemon):
    """Found by the fuzzer: traffic_x=4.6e307 made the plan's numbers overflow 64-bit
    integers when the daemon had seen traffic, and the answer could not be serialized."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for _ in range(3):
        assert daemon.post("/v1/chat/completions", body)[0] == 200
    url = daemon.url + "/admin/v1/plan?"
    for query, param in (("traffic_x=4.645683791270823e%2B307", "traffic_x"),
                         ("itl_slo=1e300", "itl_slo"), ("prompt_tokens=1e30", "prompt_tokens")):
        code, _, err = http("GET", url + query, headers=AUTH)
        assert code == 400 and err["error"]["param"] == param, err
    code, _, plan = http("GET", url + "traffic_x=1000&prompt_tokens=1048576&output_tokens="
                         "1048576&ttft_slo=1e-9&itl_slo=1e-9", headers=AUTH)
    assert code == 200, plan


def test_integers_written_as_whole_floats_are_integers(daemon):
    """Found by the fuzzer: JSON Schema's integers include 2.0, which the schema let
    through and `range(n)` then failed on (a 500). They are read as the integers they are."""
    code, _, body = daemon.post("/v1/completions", {
        "model": MODEL, "prompt": [1.0, 2.0, 3.0], "n": 2.0, "max_tokens": 3.0, "seed": 7.0,
        "top_k": 5.0, "stop_token_ids": [9.0], "min_tokens": 1.0})
    assert code == 200, body
    assert len(body["choices"]) == 2 and body["usage"]["prompt_tokens"] == 3
    assert all(c["finish_reason"] in ("length", "stop") for c in body["choices"])
    code, _, err = daemon.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2.5})
    assert code == 400 and err["error"]["param"] == "n", err
