"""On CUDA (graphs on, prompts joining decode steps): a request's n seeded choices run side by side
on 4 sequence slots, the later ones sharing the first one's prompt blocks, and give the tokens they
give one after another on one slot."""
import pytest

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.types import SamplingParams
from moestream.server.jobs import Choice, Finished, Job, TextDelta
from job_events import event_collector
from moestream.server.worker import Worker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


class Steps:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.reused: list[int] = []

    def batch_step(self, rows: int) -> None:
        self.sizes.append(rows)

    def choice_done(self, prompt_tokens, generated, reason, receipt) -> None:
        self.reused.append(int(receipt.get("reused_tokens", 0)))

    def __getattr__(self, name: str):
        return lambda *args: None


def run(packed, parallel: int, prompt_text: str, n: int, seed: int) -> tuple[list[str], Steps]:
    worker = Worker(lambda: Engine.load(packed, options=EngineOptions(device="cuda", dtype="bfloat16",
                                                                       max_context=256, max_sequences=parallel)),
                    parallel=parallel)
    steps = Steps()
    worker.observers.append(steps)
    worker.start()
    try:
        assert worker.wait_ready(300), worker.error
        ids = worker.tokenizer.encode(prompt_text)
        no_eos = tuple((t, -100.0) for t in worker.tokenizer.eos_token_ids)
        choices = [Choice(list(ids), 24, SamplingParams(temperature=0.9, top_p=0.95, top_k=64, seed=seed + 7919 * i,
                                                        logit_bias=no_eos)) for i in range(n)]
        events, done, sink = event_collector()
        worker.submit(Job(choices, sink=sink))
        assert done.wait(300)
    finally:
        worker.shutdown(30)
    assert sum(isinstance(e, Finished) for e in events) == n
    return ["".join(e.text for e in events if isinstance(e, TextDelta) and e.index == i) for i in range(n)], steps


@pytest.mark.parametrize("words", [4, 30])  # a prompt inside one KV block, one of several blocks
def test_n_choices_side_by_side_on_cuda_equal_one_after_another(words, tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16", max_position_embeddings=512)
    prompt = "Side by side: " + " ".join(f"w{i}" for i in range(words))
    apart, _ = run(packed, 1, prompt, 3, seed=99)
    together, steps = run(packed, 4, prompt, 3, seed=99)
    assert together == apart
    assert len(set(together)) > 1
    assert 3 in steps.sizes
    if words == 30:
        assert sorted(steps.reused)[1] >= 16
