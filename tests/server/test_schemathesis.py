"""Property-based conformance against OpenAI's own spec (the four operations, cut out by
make_openai_subset.py): schemathesis generates valid and invalid requests; every answer must be
documented, shaped as the spec says, never a 5xx, invalid input must be refused and valid input
accepted, and a missing key must be refused."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

from conftest import API_KEY, live_server  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402
from moestream.server.app import RequestDefaults  # noqa: E402

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run

SPEC = Path(__file__).with_name("openai_subset.json")
MAX_GENERATED = 32  # tokens: the length of a reply is not what is tested here

schema = schemathesis.openapi.from_path(SPEC)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=40)


@pytest.fixture(scope="module")
def target():
    engine = FakeEngine(max_context=1 << 16, eos_every=40)
    with live_server(engine, api_key=API_KEY, defaults=RequestDefaults(max_tokens=MAX_GENERATED)) as s:
        yield s


def shorten(case) -> None:
    """Keep valid max_tokens small: long replies cost time and test nothing more."""
    body = case.body
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_GENERATED:
                body[name] = MAX_GENERATED


@schema.parametrize()
# derandomize: the same examples on every run, so the suite's time is bounded (a random search that
# finds a slow case spends minutes shrinking it); widen max_examples or drop this to search further
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_openai_spec(case, target):
    shorten(case)
    case.call_and_validate(base_url=target.base_url, headers={"Authorization": f"Bearer {API_KEY}"})
