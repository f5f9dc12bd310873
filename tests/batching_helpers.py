"""Decoding several prompts alone and together (step_many), for the CPU and GPU batching tests; greedy
steps with their logits rows (GPU kernel tests)."""
import torch

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "The quick brown fox", "import os\nclass Thing:", "Hello world! 12"]
STEPS = 16
# (first step, last step + 1) each sequence takes part in: one joins late, one leaves early, and
# the last takes the slot it left
SCHEDULE = [(0, STEPS), (3, STEPS), (0, 10), (12, STEPS)]


def alone(engine, prompt, steps):
    """Logits of prefill then `steps` greedy steps, one sequence (slot 0)."""
    engine.reset()
    logits, _ = engine.prefill(prompt)
    out = [logits[-1]]
    for _ in range(steps):
        out.append(engine.step([int(out[-1].argmax())])[-1])
    return out


def together(engine, prompts, schedule):
    """The same greedy decoding of every prompt, their steps taken together through step_many;
    a sequence is prefilled when it joins and its slot closed when it leaves."""
    slots, outs = {}, {n: [] for n in range(len(prompts))}
    for step in range(max(end for _, end in schedule)):
        for n, (begin, end) in enumerate(schedule):
            if step == end:
                engine.close_sequence(slots.pop(n))
        for n, (begin, end) in enumerate(schedule):
            if step == begin:
                slots[n] = engine.open_sequence()
                logits, _ = engine.prefill(prompts[n], seq=slots[n])
                outs[n].append(logits[-1])
        logits = engine.step_many({slot: [int(outs[n][-1].argmax())] for n, slot in slots.items()})
        for n, slot in slots.items():
            outs[n].append(logits[slot][-1])
    return outs


def assert_same_bits(got: dict, expected: list) -> None:
    """Every sequence's logits taken together equal, bit for bit and step for step, its logits alone."""
    for n in range(len(expected)):
        assert len(got[n]) == len(expected[n])
        for step, (a, b) in enumerate(zip(got[n], expected[n])):
            assert torch.equal(a, b), f"sequence {n} differs at step {step}"


def greedy_rows(engine, prompt, n):
    """n greedy tokens after prefilling `prompt`, one step each, and the logits row each step gave."""
    logits = engine.prefill(prompt)[0][-1]
    out, rows = [int(logits.argmax())], []
    for _ in range(n - 1):
        rows.append(engine.step([out[-1]])[-1].clone())
        out.append(int(rows[-1].argmax()))
    return out, rows
