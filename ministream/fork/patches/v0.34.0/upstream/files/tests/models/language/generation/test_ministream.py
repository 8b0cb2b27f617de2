# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MiniStream: vLLM against transformers on the example models of tests/models/registry.py.

transformers has no MiniStream classes: MiniStream checkpoints hold LLaMA's tensors and math
under model_type "ministream", so the reference is transformers' LlamaConfig and
LlamaForCausalLM under that model_type. The example models are small trained ones, one with
GQA, an untied head and a padded vocabulary, one with MHA and a tied head.
"""

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ...registry import HF_EXAMPLE_MODELS
from ...utils import check_logprobs_close, check_outputs_equal


class HfMiniStreamConfig(LlamaConfig):
    model_type = "ministream"


class HfMiniStreamForCausalLM(LlamaForCausalLM):
    config_class = HfMiniStreamConfig


def _register_hf_classes():
    # Registered just before use: HfRunner drops a config class of vLLM's own
    # (vllm.transformers_utils.configs) from the Auto mapping to load the HF one.
    AutoConfig.register("ministream", HfMiniStreamConfig, exist_ok=True)
    AutoModelForCausalLM.register(
        HfMiniStreamConfig, HfMiniStreamForCausalLM, exist_ok=True
    )


MODEL_INFO = HF_EXAMPLE_MODELS.get_hf_info("MiniStreamForCausalLM")
MODELS = [MODEL_INFO.default, *MODEL_INFO.extras.values()]


def _generate(hf_runner, vllm_runner, prompts, model, dtype, max_tokens, num_logprobs):
    MODEL_INFO.check_available_online(on_fail="skip")
    MODEL_INFO.check_transformers_version(on_fail="skip")
    _register_hf_classes()
    with hf_runner(model, dtype=dtype) as hf_model:
        hf_outputs = hf_model.generate_greedy_logprobs_limit(
            prompts, max_tokens, num_logprobs
        )
    with vllm_runner(
        model, dtype=dtype, max_model_len=MODEL_INFO.max_model_len
    ) as vllm_model:
        vllm_outputs = vllm_model.generate_greedy_logprobs(
            prompts, max_tokens, num_logprobs
        )
    return hf_outputs, vllm_outputs


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("max_tokens", [32])
@pytest.mark.parametrize("num_logprobs", [5])
@pytest.mark.cpu_model
def test_models_float32(
    hf_runner, vllm_runner, example_prompts, model, max_tokens, num_logprobs
) -> None:
    """In float32 greedy decoding is exact: the same tokens, logprobs close."""
    hf_outputs, vllm_outputs = _generate(
        hf_runner, vllm_runner, example_prompts, model, "float", max_tokens,
        num_logprobs,
    )
    check_outputs_equal(
        outputs_0_lst=[(ids, text) for ids, text, _ in hf_outputs],
        outputs_1_lst=[(ids, text) for ids, text, _ in vllm_outputs],
        name_0="hf",
        name_1="vllm",
    )
    check_logprobs_close(
        outputs_0_lst=hf_outputs,
        outputs_1_lst=vllm_outputs,
        name_0="hf",
        name_1="vllm",
    )


@pytest.mark.parametrize("model", MODELS[:1])
@pytest.mark.parametrize("max_tokens", [32])
@pytest.mark.parametrize("num_logprobs", [5])
@pytest.mark.cpu_model
def test_models_bfloat16(
    hf_runner, vllm_runner, example_prompts, model, max_tokens, num_logprobs
) -> None:
    hf_outputs, vllm_outputs = _generate(
        hf_runner, vllm_runner, example_prompts, model, "bfloat16", max_tokens,
        num_logprobs,
    )
    check_logprobs_close(
        outputs_0_lst=hf_outputs,
        outputs_1_lst=vllm_outputs,
        name_0="hf",
        name_1="vllm",
    )
