"""MiniStream's configuration in Hugging Face transformers: the file every converted folder carries.

Written into the folder by `ministream convert` from the template of the ministream version named in
config.json's ministream_converter; `ministream hf-files FOLDER` writes this version's again. It imports
transformers only, so the folder opens where ministream is not installed:
`AutoConfig.from_pretrained(folder, trust_remote_code=True)`.
"""

from transformers import LlamaConfig


# Identical to LlamaConfig except: model_type. config.json holds LLaMA's keys with every value written out
# (head_dim too, which need not be hidden_size / num_attention_heads), so nothing else differs.
class __CONFIG_CLASS__(LlamaConfig):
    model_type = "__MODEL_TYPE__"
