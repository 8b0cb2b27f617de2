"""The reference model's math, each piece checked against an independent, naive computation of the format."""

import math

import pytest
import torch

from ministream.checkpoint.format import TrainConfig
from ministream.checkpoint.reference import MiniStream, apply_rope, rmsnorm, rope_tables


def config(**kw) -> TrainConfig:
    base = dict(
        vocab_size=96,
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_ff=96,
        max_seq_len=64,
        norm_eps=1e-6,
        rope_theta=10000.0,
        bos_id=0,
        eos_id=1,
        head_dim=16,
    )
    return TrainConfig(**{**base, **kw})


def random_model(cfg: TrainConfig, seed=0) -> MiniStream:
    torch.manual_seed(seed)
    m = MiniStream(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return m.eval()


def naive_forward(m: MiniStream, ids: list[int]) -> torch.Tensor:
    """The format's math written out per head and per position, float64, no batching, no cache."""
    c = m.cfg
    T, D, G = len(ids), c.head_dim, c.n_heads // c.n_kv_heads
    W = {k: v.double() for k, v in m.state_dict().items()}

    def norm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.norm_eps) * w

    def rope(x, p):  # x: (D,)
        out = torch.empty_like(x)
        for i in range(D // 2):
            th = p * c.rope_theta ** (-2 * i / D)
            a, b = x[i], x[i + D // 2]
            out[i] = a * math.cos(th) - b * math.sin(th)
            out[i + D // 2] = b * math.cos(th) + a * math.sin(th)
        return out

    x = W["embedding.weight"][ids]
    for layer in range(c.n_layers):
        p = f"blocks.{layer}."
        qkv = norm(x, W[p + "norm1.weight"]) @ W[p + "attn.Wqkv.weight"].T
        nq, nk = c.n_heads * D, c.n_kv_heads * D
        q = qkv[:, :nq].reshape(T, c.n_heads, D)
        k = qkv[:, nq : nq + nk].reshape(T, c.n_kv_heads, D)
        v = qkv[:, nq + nk :].reshape(T, c.n_kv_heads, D)
        o = torch.zeros(T, c.n_heads, D, dtype=torch.float64)
        for h in range(c.n_heads):
            j = h // G
            for t in range(T):
                qt = rope(q[t, h], t)
                scores = torch.stack([qt @ rope(k[s, j], s) / math.sqrt(D) for s in range(t + 1)])
                o[t, h] = scores.softmax(0) @ v[: t + 1, j]
        x = x + o.reshape(T, -1) @ W[p + "attn.out_proj.weight"].T
        gu = norm(x, W[p + "norm2.weight"]) @ W[p + "mlp.w12.weight"].T
        g, u = gu[:, : c.d_ff], gu[:, c.d_ff :]
        x = x + (g * torch.sigmoid(g) * u) @ W[p + "mlp.w3.weight"].T
    head = W["embedding.weight"] if c.tie_embeddings else W["lm_head.weight"]
    return norm(x, W["norm_f.weight"]) @ head.T


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # MHA, tied, head_dim = d_model / n_heads
        dict(n_kv_heads=2, head_dim=32, tie_embeddings=False),  # GQA, head_dim != d_model / n_heads, untied
        dict(n_kv_heads=1, rope_theta=500.0, norm_eps=1e-2),  # MQA, other constants
    ],
)
def test_forward_equals_the_naive_per_head_computation(kw):
    m = random_model(config(**kw))
    ids = [0, 5, 17, 33, 2, 90, 41]
    got = m(torch.tensor([ids]))[0].double()
    want = naive_forward(m, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_attention_scale_uses_head_dim_not_d_model():
    m = random_model(config(head_dim=32))  # 4 heads x 32 = 128 != d_model 64
    ids = [0, 3, 9, 27, 81]
    got = m(torch.tensor([ids]))[0].double()
    torch.testing.assert_close(got, naive_forward(m, ids), rtol=1e-4, atol=1e-4)


def test_rmsnorm_is_computed_in_float32_then_cast_back():
    x = torch.randn(3, 8, dtype=torch.bfloat16) * 5
    w = torch.randn(8, dtype=torch.bfloat16)
    xf = x.float()
    want = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(torch.bfloat16)
    got = rmsnorm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_rope_matches_the_rotate_half_formula():
    D, theta = 8, 10000.0
    x = torch.randn(1, 1, 5, D)
    cos, sin = rope_tables(torch.arange(5)[None], D, theta)
    got = apply_rope(x, cos, sin)
    for p in range(5):
        for i in range(D // 2):
            th = p * theta ** (-2 * i / D)
            a, b = x[0, 0, p, i].item(), x[0, 0, p, i + D // 2].item()
            assert got[0, 0, p, i].item() == pytest.approx(a * math.cos(th) - b * math.sin(th), abs=1e-5)
            assert got[0, 0, p, i + D // 2].item() == pytest.approx(b * math.cos(th) + a * math.sin(th), abs=1e-5)


def test_gqa_equals_mha_with_each_kv_head_repeated_over_its_query_group():
    gqa = random_model(config(n_kv_heads=2))
    c, D = gqa.cfg, gqa.cfg.head_dim
    mha = MiniStream(config())  # same shape, n_kv_heads = n_heads
    state = dict(gqa.state_dict())
    G = c.n_heads // c.n_kv_heads
    for layer in range(c.n_layers):
        W = state[f"blocks.{layer}.attn.Wqkv.weight"]
        q, k, v = W.split(c.qkv_sizes)

        def rep(t):  # (Nkv*D, H) -> (Nq*D, H): kv head j serves query heads j*G .. (j+1)*G-1
            return t.view(c.n_kv_heads, D, -1).repeat_interleave(G, dim=0).reshape(-1, t.shape[1])

        state[f"blocks.{layer}.attn.Wqkv.weight"] = torch.cat([q, rep(k), rep(v)])
    mha.load_state_dict(state)
    ids = torch.tensor([[0, 4, 8, 15, 16, 23, 42]])
    torch.testing.assert_close(gqa(ids), mha.eval()(ids), rtol=1e-5, atol=1e-5)


def test_cached_decoding_equals_recomputing_the_whole_sequence():
    m = random_model(config(n_kv_heads=2))
    prompt = [0, 7, 11, 13]
    cached = m.generate([prompt], 12, logprobs=3)[0]
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
    assert cached["ids"] == ids[len(prompt) :]


def test_left_padded_batch_equals_one_request_at_a_time():
    m = random_model(config(n_kv_heads=2))
    prompts = [[0, 5], [0, 9, 14, 3, 77, 12], [0, 60, 2, 4]]
    batch = m.generate(prompts, 10, logprobs=2)
    for p, b in zip(prompts, batch, strict=True):
        alone = m.generate([p], 10, logprobs=2)[0]
        assert b["ids"] == alone["ids"] and len(b["ids"]) == 10
        assert len(b["logprobs"]) == len(alone["logprobs"]) == 10  # every step's logprobs held below
        for x, y in zip(b["logprobs"], alone["logprobs"]):
            assert x.keys() == y.keys() and len(x) >= 2
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_generation_stops_at_a_stop_id():
    m = random_model(config())
    free = m.generate([[0, 1, 2]], 16)[0]["ids"]
    stop = free[4]
    stopped = m.generate([[0, 1, 2]], 16, stop_ids=(stop,))[0]["ids"]
    assert stopped == free[: free.index(stop) + 1]


def test_sampling_is_reproducible_with_a_seed_and_differs_from_greedy():
    m = random_model(config())
    a = m.generate([[0, 1], [0, 2]], 20, temperature=1.5, top_k=40, top_p=0.95, seed=7)
    b = m.generate([[0, 1], [0, 2]], 20, temperature=1.5, top_k=40, top_p=0.95, seed=7)
    greedy = m.generate([[0, 1], [0, 2]], 20)
    assert [x["ids"] for x in a] == [x["ids"] for x in b]
    assert [x["ids"] for x in a] != [x["ids"] for x in greedy]


def test_top_k_one_sampling_is_greedy():
    m = random_model(config())
    assert m.generate([[0, 3]], 15, temperature=1.0, top_k=1, seed=1)[0]["ids"] == m.generate([[0, 3]], 15)[0]["ids"]


def test_logprobs_are_the_log_softmax_of_the_logits():
    m = random_model(config())
    out = m.generate([[0, 3, 5]], 1, logprobs=4)[0]
    lp = torch.log_softmax(m(torch.tensor([[0, 3, 5]]))[0, -1], -1)
    top = lp.topk(4)
    assert list(out["logprobs"][0]) == top.indices.tolist()
    assert out["ids"][0] == top.indices[0].item()


def test_prompt_beyond_max_seq_len_is_refused():
    m = random_model(config(max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        m.generate([[0] * 10], 10)


def test_bfloat16_model_runs_and_mostly_agrees_with_float32(tiny):
    f32 = MiniStream.from_checkpoint(tiny, torch.float32)
    bf16 = MiniStream.from_checkpoint(tiny, torch.bfloat16)
    ids = torch.tensor([[0, 50, 60, 70, 80, 90]])
    a, b = f32(ids), bf16(ids)
    assert b.dtype == torch.float32  # logits are returned in float32
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
