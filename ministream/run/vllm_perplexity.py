"""vLLM's perplexity on held-out text, by checkpoint/perplexity.py's method (llama-perplexity's): the chunks'
prompt log-probabilities from an offline engine."""

from ..checkpoint.perplexity import Chunks, from_logprobs


def vllm_perplexity(llm, c: Chunks) -> float:
    """An offline vLLM engine's perplexity of the chunks (its max_model_len at least n_ctx + 1)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in c.ids], params, use_tqdm=False)
    per_chunk = []
    for ids, o in zip(c.ids, outputs, strict=True):
        # prompt_logprobs[j]: position j's token given those before it (None for j = 0)
        per_chunk.append([o.prompt_logprobs[j][ids[j]].logprob for j in range(c.first + 1, len(ids))])
    return from_logprobs(per_chunk)
