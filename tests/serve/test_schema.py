"""Schemathesis over the live server's own ``/openapi.json`` (conftest's small real-engine server on
127.0.0.1): for every operation, generated requests, valid and invalid ones, never get a 5xx, and
every answer has a documented status, content type and body schema.

Bounded and reproducible: a fixed number of examples per operation and mode, a fixed seed,
derandomized, no example database: the same schema gives the same requests every run. Each
operation's cases come from schemathesis's Hypothesis strategy under ``@given`` (its pytest
plugin does not run under pytest 9.2, whose nodes lost the ``_nodeid`` it rewrites).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.serve.conftest import WAIT_S

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 25  # per operation and mode
SEED = 13
OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{name}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
]


@pytest.fixture(scope="module")
def api(small_server):
    url, _ = small_server
    return url, schemathesis.openapi.from_url(f"{url}/openapi.json")


def test_the_fuzzed_operations_are_all_the_documented_ones(api):
    _, schema = api
    documented = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert documented == set(OPERATIONS)


# Invalid requests exist only where there is a body to break (a path's name is any string; the
# profile routes take none).
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST" and "profile" not in p
]


@pytest.mark.parametrize("method, path, mode", CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_every_answer_is_documented_and_none_is_a_server_error(api, method, path, mode):
    url, schema = api

    @seed(SEED)
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=schema[path][method].as_strategy(mode))
    def answers(case):
        case.call_and_validate(base_url=url, checks=CHECKS, timeout=WAIT_S)

    answers()
