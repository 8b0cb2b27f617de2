"""The converted folder in Hugging Face transformers: MiniStreamConfig and MiniStreamForCausalLM.

Importing this module registers both with the Auto classes, so a converted folder loads with
`AutoModelForCausalLM.from_pretrained(folder)` after `import ministream.checkpoint.hf`.
"""

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ..spec import MODEL_TYPE, TrainConfig, hf_config


class MiniStreamConfig(LlamaConfig):
    """Identical to LlamaConfig except: model_type "ministream" (head_dim is always explicit)."""

    model_type = MODEL_TYPE

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, dtype: str = "float32") -> "MiniStreamConfig":
        return cls(**{k: v for k, v in hf_config(cfg, dtype).items() if k not in ("architectures", "model_type")})


class MiniStreamForCausalLM(LlamaForCausalLM):
    """Identical to LlamaForCausalLM: the converter writes LLaMA's tensor names and MiniStream's math
    (RMSNorm, rotate-half RoPE, SwiGLU, GQA, scale 1/sqrt(head_dim)) is LLaMA's."""

    config_class = MiniStreamConfig


AutoConfig.register(MODEL_TYPE, MiniStreamConfig, exist_ok=True)
AutoModelForCausalLM.register(MiniStreamConfig, MiniStreamForCausalLM, exist_ok=True)
