# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MiniStream config: LLaMA's config under its own model_type, "ministream".

MiniStream checkpoints (config.json "model_type": "ministream") carry exactly
LLaMA's keys; transformers does not know the model_type, so vLLM registers this
class for it (see _CONFIG_REGISTRY in vllm/transformers_utils/config.py).
"""

from transformers import LlamaConfig


class MiniStreamConfig(LlamaConfig):
    model_type = "ministream"
