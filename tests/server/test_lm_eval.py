"""lm-eval's `local-completions` loglikelihood against the real server (tiny packed model).

test_loglikelihood_request_shape sends, over plain HTTP, the exact request lm-eval sends for
loglikelihood (a batch of token-id prompts, echo, logprobs 1, max_tokens 1) and reads the answer
the way lm-eval does (token_logprobs[ctxlen:-1], greedy when each equals the top alternative): the
sums must be the engine's own log-probabilities. test_lm_eval_harness runs lm-eval itself on a
tiny local multiple-choice task (where lm-eval is installed) and checks every scored choice the
same way."""
from __future__ import annotations

import json

import httpx
import pytest

from conftest import live_server

pytest.importorskip("torch")
import torch  # noqa: E402

Engine = pytest.importorskip("moestream.engine.engine").Engine
from moestream.engine.options import EngineOptions  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MODEL_ID = "tiny-moe"
DOCS = [{"question": "The quick brown fox", "choices": [" jumps", " sleeps", " runs away"], "answer": 0},
        {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b"], "answer": 0},
        {"question": "Paris is the capital of", "choices": [" France", " Spain", " Italy"], "answer": 0}]


@pytest.fixture(scope="module")
def model_dir(tiny_packed_model):
    return tiny_packed_model("qwen3_moe", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.load(model_dir, options=EngineOptions(device="cpu"))


@pytest.fixture(scope="module")
def real(model_dir):
    with live_server(load=lambda: Engine.load(model_dir, options=EngineOptions(device="cpu")),
                     model_id=MODEL_ID) as s:
        yield s


def engine_loglikelihood(engine, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The engine's own log P(continuation | context), and whether every token was the argmax."""
    ids = context + continuation
    logits, _ = engine.prefill(ids, all_logits=True)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = [logprobs[i - 1, ids[i]] for i in range(len(context), len(ids))]
    greedy = all(int(logprobs[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
    return float(sum(picked)), greedy


def lm_eval_parse(answer: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-eval's LocalCompletionsAPI.parse_logprobs reads from an answer."""
    out = []
    for choice, ctxlen in zip(sorted(answer["choices"], key=lambda c: c["index"]), ctxlens):
        tokens = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))))
    return out


def test_loglikelihood_request_shape(real, engine):
    tok = engine.tokenizer
    pairs = []
    for doc in DOCS:
        for choice in doc["choices"]:
            whole = tok.encode(doc["question"] + choice, add_special_tokens=False)
            context = tok.encode(doc["question"], add_special_tokens=False)
            pairs.append((context, whole[len(context):]))
    # the continuation that is the model's own greedy choice must be reported greedy
    context = pairs[0][0]
    logits, _ = engine.prefill(context, all_logits=True)
    pairs.append((context, [int(logits[-1].argmax())]))
    for batch in (pairs[:1], pairs[1:4], pairs):  # lm-eval batches by --batch_size
        payload = {"model": MODEL_ID, "prompt": [c + k for c, k in batch], "temperature": 0, "max_tokens": 1,
                   "logprobs": 1, "seed": 1234, "echo": True}
        with httpx.Client(base_url=real.url, timeout=120) as http:
            answer = http.post("/v1/completions", json=payload)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert len(body["choices"]) == len(batch)
        for choice, (c, k) in zip(body["choices"], batch):
            assert len(choice["logprobs"]["token_logprobs"]) == len(c) + len(k) + 1  # the prompt and 1 new token
        got = lm_eval_parse(body, [len(c) for c, _ in batch])
        for (ll, greedy), (c, k) in zip(got, batch):
            want_ll, want_greedy = engine_loglikelihood(engine, c, k)
            assert ll == pytest.approx(want_ll, abs=1e-4)
            assert greedy == want_greedy
    assert got[-1][1] is True  # the argmax continuation


def test_lm_eval_harness(real, engine, model_dir, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")  # heavy; CI installs it (requirements-ci.txt)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # caches stay in the test's folder
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    data = tmp_path / "tiny_choice.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_choice.yaml").write_text(
        "task: tiny_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  cache_dir: {tmp_path / 'datasets'}\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'target_delimiter: ""\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    lm = get_model("local-completions")(
        model=MODEL_ID, base_url=real.url + "/v1/completions", tokenizer=str(model_dir),
        tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1, max_retries=1, batch_size=2)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_choice"], task_manager=TaskManager(include_path=str(tmp_path)),
                                      log_samples=True, bootstrap_iters=0)
    samples = results["samples"]["tiny_choice"]
    assert len(samples) == len(DOCS)
    scored = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ll, greedy = resp[0]
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            want_ll, want_greedy = engine_loglikelihood(engine, ctx_ids, cont_ids)
            assert float(ll) == pytest.approx(want_ll, abs=1e-4)
            assert bool(greedy) == want_greedy
            scored += 1
    assert scored == sum(len(d["choices"]) for d in DOCS)
    assert 0.0 <= results["results"]["tiny_choice"]["acc,none"] <= 1.0
