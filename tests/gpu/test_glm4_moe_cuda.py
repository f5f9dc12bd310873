"""glm4_moe through the CUDA decoder: the checks of test_decoder.py for this family (its partial
rotary takes the torch attention step; experts take the Triton kernels)."""
import pytest

import test_decoder as decoder_tests

pytestmark = pytest.mark.gpu


def test_glm4_moe_decodes_through_the_decoder_like_the_reference(tiny_packed_model, tmp_path):
    decoder_tests.test_every_family_decodes_through_the_decoder_like_the_reference("glm4_moe", tiny_packed_model, tmp_path)


def test_glm4_moe_same_bits_for_every_cache_size(tiny_packed_model):
    decoder_tests.test_same_bits_for_every_cache_size_and_graphs_on_or_off("glm4_moe", tiny_packed_model)


@pytest.mark.parametrize("size", ["all", "min"])
def test_glm4_moe_step_of_t_tokens_equals_t_single_steps_on_cuda(size, tiny_packed_model):
    decoder_tests.test_step_of_t_tokens_equals_t_single_steps_on_cuda("glm4_moe", size, tiny_packed_model)
