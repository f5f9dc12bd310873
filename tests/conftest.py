import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import build_checkpoint  # noqa: E402


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


INTERPRET_DIR = Path(__file__).parent / "interpret"

# The files that drive the server with third-party clients (requirements-clients.txt: lm-eval,
# LangChain, Schemathesis, the Anthropic SDK). CI installs those for a stage of their own,
# `python -m pytest --clients tests/server`; every other run leaves these files uncollected.
CLIENT_TESTS = {Path(__file__).parent / "server" / name for name in (
    "test_lm_eval.py", "test_langchain.py", "test_schemathesis.py", "test_schemathesis_wide.py",
    "test_sdk_apis_real.py", "test_server_features_real.py")}


def pytest_addoption(parser):
    parser.addoption("--clients", action="store_true",
                     help="run only the tests that need the third-party clients of requirements-clients.txt")


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix == ".py" and (collection_path in CLIENT_TESTS) != config.getoption("clients"):
        return True
    return None  # the default rules (--ignore and the like) decide


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks added here
def pytest_collection_modifyitems(config, items):
    # Triton reads TRITON_INTERPRET when first imported: the kernels run interpreted only in a
    # process started with it, CI's interpreter stage (tests/interpret/interpreter.py).
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    not_interpreting = pytest.mark.skip(reason="runs Triton's interpreter: TRITON_INTERPRET=1 python -m pytest -m interpret tests")
    for item in items:
        if INTERPRET_DIR in item.path.parents:
            item.add_marker(pytest.mark.interpret)
            if not interpreting:
                item.add_marker(not_interpreting)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run tests/gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The tests' models are tiny: torch's intra-op threads only add barrier waits, which on a
    shared 2-core CI machine stall each op for many times its work. (Tests of --threads restore
    the count they change; subprocesses keep torch's default.)"""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def float_activations(monkeypatch):
    """The native products on float32 activations, the path of a CPU without AVX-512 VNNI: the one held
    to transformers' float32 results (and to float32 rounding between two orders of the same sums),
    which int8-rounded activations (~0.5 % of a product, a rounding step apart where an input moves by
    an ulp) are not; their own tests bound them."""
    from moestream.cpu_share import kernels as native

    monkeypatch.setattr(native, "activations", lambda: "float")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family, **overrides) -> HF folder (cached per arguments for the session)."""
    cache = {}

    def make(family: str = "qwen3_moe", **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"hf-{family}")
            cache[key] = build_checkpoint(folder, family, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_packed_model(tiny_checkpoint, tmp_path_factory):
    """tiny_packed_model(family, quant="none", **overrides) -> packed model directory."""
    from moestream.convert.main import convert

    cache = {}

    def make(family: str = "qwen3_moe", quant: str = "none", **overrides):
        key = (family, quant, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"packed-{family}-{quant}") / "model"
            cache[key] = convert(tiny_checkpoint(family, **overrides), out, quant=quant)
        return cache[key]

    return make


@pytest.fixture(autouse=True, scope="session")
def _private_digest_cache(tmp_path_factory):
    """Resident-file digests go to a folder of the test session, not the user's ~/.cache: in this
    process through the library's default, in subprocesses through the CLI's environment variable."""
    import os

    from moestream.commands.engine_args import CACHE_DIR_ENV
    from moestream.format import integrity

    folder = tmp_path_factory.mktemp("digest-cache")
    saved_default, saved_env = integrity.default_cache_dir, os.environ.get(CACHE_DIR_ENV)
    integrity.default_cache_dir = lambda: folder
    os.environ[CACHE_DIR_ENV] = str(folder)
    yield folder
    integrity.default_cache_dir = saved_default
    if saved_env is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = saved_env
