"""MiniStream in Hugging Face transformers: the file every converted folder carries.

Written into the folder by `ministream convert` from the template of the ministream version named in
config.json's ministream_converter; `ministream hf-files FOLDER` writes this version's again. It imports
transformers only, so the folder opens where ministream is not installed:
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`, and `AutoModel` for the model
without its head (vLLM's Transformers backend asks for that one).

MiniStream's math is LLaMA's: RMSNorm computed in float32, rotate-half RoPE over the whole head with
base rope_theta, SwiGLU (silu on the gate), grouped-query attention with scale 1/sqrt(head_dim), no
biases; and the converter writes LLaMA's tensor names. So the classes below are LLaMA's under
MiniStream's names. One rounding differs in 16-bit widths only: LLaMA's RMSNorm casts back to the input
dtype before multiplying by its weight, MiniStream's reference after; in float32 the two are the same.
"""

from transformers import LlamaForCausalLM, LlamaModel

from .__CONFIG_MODULE__ import __CONFIG_CLASS__


# Identical to LlamaModel except: its config class.
class __MODEL_CLASS__(LlamaModel):
    config_class = __CONFIG_CLASS__


# Identical to LlamaForCausalLM except: its config class. (Its body, self.model, is a LlamaModel: the same
# module as the class above, under LLaMA's name.)
class __ARCH__(LlamaForCausalLM):
    config_class = __CONFIG_CLASS__
