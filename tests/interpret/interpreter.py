"""Helpers for the tests that run Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1).

Triton reads TRITON_INTERPRET when it is first imported, so these tests run in a pytest process of
their own, started with it: `TRITON_INTERPRET=1 python -m pytest -m interpret tests` (CI's interpreter
stage). Every test under tests/interpret/ carries the `interpret` mark (tests/conftest.py); a process
started without TRITON_INTERPRET=1 skips them and says how to run them."""
import importlib


def interpreted_module(name: str):
    """The kernel module `name`, imported in this interpreting process."""
    module = importlib.import_module(name)
    assert module._INTERPRETED, f"{name} was not interpreted: start pytest with TRITON_INTERPRET=1"
    return module


def gen(seed: int):
    """A seeded CPU generator (the kernels' inputs are drawn on the CPU, then moved)."""
    import torch

    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=None):
    """Normal values drawn in float32 with generator g, then cast to dtype."""
    import torch

    return torch.randn(*shape, generator=g).to(dtype or torch.float32)


def relative_error(y, ref) -> float:
    """max |y - ref| / max |ref|, in float64."""
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()

