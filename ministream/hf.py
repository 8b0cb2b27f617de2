"""The converted folder in Hugging Face transformers: MiniStreamConfig and MiniStreamForCausalLM.

Importing this module registers both with the Auto classes, so a converted folder loads with
`AutoModelForCausalLM.from_pretrained(folder)` after `import ministream.hf`.
"""

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from .format import TrainConfig


class MiniStreamConfig(LlamaConfig):
    """Identical to LlamaConfig except: model_type "ministream" (head_dim is always explicit)."""

    model_type = "ministream"


class MiniStreamForCausalLM(LlamaForCausalLM):
    """Identical to LlamaForCausalLM: the converter writes LLaMA's tensor names and MiniStream's math
    (RMSNorm, rotate-half RoPE, SwiGLU, GQA, scale 1/sqrt(head_dim)) is LLaMA's."""

    config_class = MiniStreamConfig


AutoConfig.register("ministream", MiniStreamConfig, exist_ok=True)
AutoModelForCausalLM.register(MiniStreamConfig, MiniStreamForCausalLM, exist_ok=True)


def to_hf_config(cfg: TrainConfig, dtype: str = "float32") -> MiniStreamConfig:
    from .convert import hf_config

    values = {k: v for k, v in hf_config(cfg, dtype).items() if k not in ("architectures", "model_type")}
    return MiniStreamConfig(**values)
