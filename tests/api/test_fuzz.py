"""A property-based fuzz of every endpoint's schema: whatever a request holds, the answer is
never a 5xx, an error is always in the shape of its API, and the connection survives.

The values and corruptions are freetoken/bench/fuzz.py's (the same that `freetoken bench
soak fuzz` sends by the thousand); hypothesis picks the endpoint, the place in its valid
body and what goes there, and shrinks a failure to its smallest form. A runner that answers
at once stands in for the model (tests/api/fake_runner.py), so what is measured is the
server's side, in a bounded time.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freetoken.bench import fuzz
from freetoken.store import Store
from tests.pull.harness import ThreadRegistry
from tests.server.harness import add_model, local_client, make_config


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    add_model(Store(root / "models"), fuzz.MODEL)
    python = root / "python"
    script = Path(__file__).with_name("fake_runner.py")
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    with ThreadRegistry(root / "registry") as registry:
        env = {"FREETOKEN_RUNNER_PYTHON": str(python), "FREETOKEN_REGISTRY": registry.url}
        with local_client(make_config(root / "models", **env)) as c:
            yield c


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
# anything JSON can hold (infinities come out as Infinity), the known nasty values, and
# text with lone surrogates (encoded as the invalid UTF-8 a broken client would send)
VALUES = (
    st.sampled_from(fuzz.NASTY)
    | _JSON
    | st.text(st.characters(blacklist_categories=()), max_size=8)
    | st.sampled_from([v for values in fuzz.OPTION_VALUES.values() for v in values])
)


@st.composite
def cases(draw) -> fuzz.Case:
    ep = draw(st.sampled_from([e for e in fuzz.ENDPOINTS if e.body is not None]))
    if ep.path.startswith("/api/blobs/"):
        return fuzz.case(ep, random.Random(draw(st.integers(0, 99))))
    body, how = ep.body, draw(st.sampled_from(("replace", "delete", "add", "option", "valid")))
    places = fuzz.places(body)
    if how == "replace":
        body = fuzz.replace(body, draw(st.sampled_from(places)), draw(VALUES))
    elif how == "delete":
        body = fuzz.replace(body, draw(st.sampled_from(places)), None, delete=True)
    elif how == "add":
        body = {
            **body,
            draw(st.sampled_from(("zz", "format", "tools", "keep_alive"))): draw(VALUES),
        }
    elif how == "option":
        name = draw(st.sampled_from(sorted(fuzz.OPTION_VALUES)))
        body = {**body, "options": {name: draw(VALUES)}, name: draw(VALUES)}
    data = fuzz.encode(body)
    if draw(st.booleans()) and draw(st.booleans()):  # a quarter of them: the bytes spoiled
        kind = draw(st.sampled_from(fuzz.CORRUPTIONS))
        data, how = fuzz.corrupt(data, kind, random.Random(draw(st.integers(0, 99)))), kind
    return fuzz.Case(ep.method, ep.path, data, ep.api, how)


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,  # the same cases every run: CI never fails on a new draw
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
def test_no_request_gets_a_5xx_or_an_error_in_the_wrong_shape(client, case):
    r = client.request(case.method, case.path, content=case.content, headers=case.headers)
    wrong = fuzz.verdict(case, r.status_code, r.headers.get("content-type", ""), r.content)
    assert wrong is None, (case.how, case.content[:300], r.status_code, r.text[:300])


def test_the_generated_cases_are_what_the_soak_sends():
    cases = list(fuzz.cases(random.Random(1), 400))
    assert {c.path for c in cases} == {e.path for e in fuzz.ENDPOINTS}
    assert sum(c.how == "valid" for c in cases) > 5 and sum("bytes" in c.how for c in cases) > 20
