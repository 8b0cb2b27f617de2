"""bench-accuracy: every width on both engines, measured the same way against the full-precision reference.

For one converted folder (float32), each system runs verify's prompts (DEFAULT_PROMPTS and those far into
the context) greedily with its top-k log-probabilities, and scores the held-out text (run/vllm_perplexity.py,
llama-perplexity's method). Against the reference model in float32 on the same folder:

- exact: prompts whose greedy token ids equal the reference model's, all of them;
- first divergence: the new token at which a prompt first differs (the mean, max_tokens where none);
- top-k rule: prompts whose first difference lies within each other's top-k (vLLM's check_logprobs_close);
- perplexity on the held-out text, and its change against the reference model's.

Systems: each width (widths.py) on each engine: vLLM on the folder in float32 and bfloat16 and on
`ministream quantize` folders (w8a8, w4a16 by RTN and by GPTQ, fp8), llama.cpp on `ministream gguf` files
(f32, bf16, q8_0, q4_0). Each vLLM system runs in a process of its own (one engine each); llama.cpp is
llama-server for the prompts and llama-perplexity for the text. Results: accuracy.json and accuracy.md in
--out, with the machine and the command.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import MiniStreamError
from ..atomic import check_output, write_json
from ..checkpoint.folder import checked
from ..checkpoint.perplexity import Chunks, chunks, folder_perplexity
from ..run.server import free_port
from ..run.verify import builtin_prompts, compare, make_golden, rule_passes
from . import llamacpp
from .machine import machine, machine_line
from .widths import WIDTHS, refusal, vllm_folder, vllm_width
from .workers import exit_note

# name -> (engine, width: widths.py says what each engine runs for it)
SYSTEMS = {
    "vllm float32": ("vllm", "float32"),
    "vllm bfloat16": ("vllm", "bfloat16"),
    "vllm w8a8": ("vllm", "w8a8"),
    "vllm w8a8 bf16": ("vllm", "w8a8-bf16"),
    "vllm w8a8 bf16 head": ("vllm", "w8a8-bf16-head"),
    "vllm w4a16": ("vllm", "w4a16"),
    "vllm w4a16 head": ("vllm", "w4a16-head"),
    "vllm fp8": ("vllm", "fp8"),
    "vllm w4a16 gptq": ("vllm", "w4a16-gptq"),
    "llama.cpp f32": ("llama.cpp", "float32"),
    "llama.cpp bf16": ("llama.cpp", "bfloat16"),
    "llama.cpp q8_0": ("llama.cpp", "w8a8"),
    "llama.cpp q4_0": ("llama.cpp", "w4a16"),
}
MAX_TOKENS, TOP_K = 32, 5
# llama.cpp's KV cache in the dtype vLLM keeps it in for the same system (llama.cpp's default is f16), so that the
# rows of one width differ by their engines' arithmetic and weights, not by a cache rounded by one of them only
KV_CACHE = {"float32": "f32", "bfloat16": "bf16"}


def width(name: str) -> str:
    """The width whose rule a system is held to (verify.RULES)."""
    return WIDTHS[SYSTEMS[name][1]].rule


def bench_accuracy(
    out: Path, folders: list[Path], presets: list[str], systems: list[str] | None = None, text: Path | None = None
) -> int:
    """`ministream bench-accuracy`: each folder, and each preset's model (made once under out/models), through
    every system; out/accuracy.md holds one table per model."""
    from .offline import prepare_model

    if unknown := [s for s in systems or [] if s not in SYSTEMS]:
        raise MiniStreamError(f"unknown system(s) {', '.join(unknown)}: choose from {', '.join(SYSTEMS)}")
    for name in systems or []:  # one named that this machine's vLLM cannot run: refused before anything runs
        if SYSTEMS[name][0] == "vllm":
            vllm_width(SYSTEMS[name][1])
    systems = systems or list(SYSTEMS)  # every system: one this machine cannot run is a row that says why
    out = Path(out)
    for folder in folders:  # the one folder check, before anything is made or run
        checked(folder)
    check_output(out, force=True, inputs=folders)  # a results folder, written again each run
    models = [(Path(f).resolve().name, Path(f)) for f in folders]
    models += [(p, Path(prepare_model(p, out / "models")["hf"])) for p in presets]
    tables = []
    for name, folder in models:
        result = run_accuracy(folder, out / name, systems, text)
        tables.append(f"### {name}\n\n{table(result)}")
    (out / "accuracy.md").write_text("\n".join(tables))
    print(f"bench-accuracy: wrote {out}/accuracy.md")
    return 0


def run_accuracy(folder: Path, out: Path, systems: list[str], text: Path | None = None, log=print) -> dict:
    """One converted float32 folder through `systems`; out/accuracy.json and accuracy.md."""
    folder, out = Path(folder).resolve(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise MiniStreamError(f"{folder} is quantized: give the converted full-precision folder it came from")
    prompts, context = builtin_prompts(folder, MAX_TOKENS)
    golden = make_golden(folder, folder, prompts, "float32", MAX_TOKENS, TOP_K, context)
    (out / "golden-float32.json").write_text(json.dumps(golden))
    c = chunks(folder, text, max_len=config.get("max_position_embeddings"))
    ref_ppl = folder_perplexity(folder, c)
    log(f"reference model, float32: perplexity {ref_ppl:.4f} on {c.scored} tokens of {c.text}")
    rows: list[dict] = [{"system": "reference float32", "width": "float32", "perplexity": ref_ppl}]
    with tempfile.TemporaryDirectory(dir=out, prefix=".work-") as work:
        for name in systems:
            engine, w = SYSTEMS[name]
            if engine == "vllm" and (why := refusal(w)):
                log(f"{name}: not run on this machine: {why}")
                rows.append({"system": name, "width": width(name), "not_run": why})
                continue
            got, ppl = (_vllm if engine == "vllm" else _llamacpp)(folder, Path(work), w, golden, c)
            want, got = (golden, got) if engine == "vllm" else until_eos(golden, got, config.get("eos_token_id"))
            row = _row(name, want, got, ppl, ref_ppl)
            log(_line(row))
            rows.append(row)
    result = {
        "folder": str(folder),
        "text": c.text,
        "n_ctx": len(c.ids[0]),
        "scored_tokens": c.scored,
        "prompts": len(prompts),
        "max_tokens": MAX_TOKENS,
        "top_k": TOP_K,
        "machine": machine(),
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    write_json(out / "accuracy.json", result)
    (out / "accuracy.md").write_text(table(result))
    log(f"wrote {out}/accuracy.json and accuracy.md")
    return result


def until_eos(golden: dict, got: list[dict], eos: int | list[int] | None) -> tuple[dict, list[dict]]:
    """The reference's outputs cut before its first end-of-text token, and `got` (llama.cpp's) to the same length:
    llama-server's ignore_eos bans the end-of-text tokens from sampling (vLLM's only keeps going), so where the
    reference model chose EOS llama.cpp takes its second choice, and what follows is another continuation."""
    ends = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    cut = []
    for ref, mine in zip(golden["outputs"], got):
        n = next((i for i, t in enumerate(ref["ids"]) if t in ends), len(ref["ids"]))
        cut.append(({k: v[:n] for k, v in ref.items()}, {k: v[:n] for k, v in mine.items()}))
    return {**golden, "outputs": [r for r, _ in cut]}, [m for _, m in cut]


def _row(name: str, golden: dict, got: list[dict], ppl: float, ref_ppl: float) -> dict:
    _, results = compare(golden["outputs"], got, exact=False)
    n = len(results)
    firsts = [r.first_difference if r.first_difference is not None else MAX_TOKENS for r in results]
    ties = [
        r.first_difference is not None and near_tie(golden["outputs"][i], got[i]["ids"], r.first_difference)
        for i, r in enumerate(results)
    ]
    row: dict = {
        "system": name,
        "width": width(name),
        "exact": sum(r.identical for r in results),
        "near_ties": sum(ties),  # of the rest: the first difference where the reference's top two all but tie
        "top_k_rule": sum(r.within_top_k for r in results),
        "prompts": n,
        "mean_first_divergence": sum(firsts) / n,
        "perplexity": ppl,
        "perplexity_change": ppl / ref_ppl - 1,
    }
    row["rule"] = rule_passes(row["width"], row["exact"] == n, row["top_k_rule"] == n, row["perplexity_change"])
    return row


# log-probability within which the reference model's first and second choices tie in float32's arithmetic: another
# engine's float32 (llama.cpp's own reduction order) may take the second there and stay the same model (a gap of
# 5e-4 on a trained test model: llama.cpp f32 took the other token)
NEAR_TIE = 1e-3


def near_tie(reference: dict, ids: list[int], step: int) -> bool:
    """Whether `ids`, another engine's new tokens, part from the reference's at new token `step` where the two
    tokens all but tie in the reference's top-k log-probabilities (its output as make_golden wrote it); False
    where either output ends before `step` (a difference in length is no tie)."""
    if step >= min(len(ids), len(reference["ids"]), len(reference["logprobs"])):
        return False
    top = {int(t): lp for t, lp in reference["logprobs"][step].items()}
    return ids[step] in top and top[reference["ids"][step]] - top[ids[step]] < NEAR_TIE


def _line(row: dict) -> str:
    return (
        f"{row['system']}: exact {row['exact']}/{row['prompts']}{_ties(row)}, top-{TOP_K} rule {row['top_k_rule']}/"
        f"{row['prompts']}, first divergence at {row['mean_first_divergence']:.1f} on average, perplexity "
        f"{row['perplexity']:.4f} ({row['perplexity_change']:+.2%}); {row['width']} rule: "
        f"{'PASS' if row['rule'] else 'FAIL'}"
    )


def _ties(row: dict) -> str:
    return f" ({row['near_ties']} at a near-tie)" if row.get("near_ties") else ""


def table(result: dict) -> str:
    lines = [
        "| system | width's rule | exact ids | top-k rule | mean first divergence | perplexity | change |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "not_run" in r:
            lines.append(f"| {r['system']} | {r['width']}: not run here | {r['not_run']} | | | | |")
            continue
        if "exact" not in r:
            lines.append(f"| reference model, float32 | (the reference) | | | | {r['perplexity']:.4f} | |")
            continue
        lines.append(
            f"| {r['system']} | {r['width']}: {'PASS' if r['rule'] else 'FAIL'} "
            f"| {r['exact']}/{r['prompts']}{_ties(r)} "
            f"| {r['top_k_rule']}/{r['prompts']} | {r['mean_first_divergence']:.1f} of {result['max_tokens']} "
            f"| {r['perplexity']:.4f} | {r['perplexity_change']:+.2%} |"
        )
    m = result["machine"]
    lines += [
        "",
        f"{result['folder']}; {result['prompts']} prompts, {result['max_tokens']} greedy tokens each; perplexity "
        f"on {result['scored_tokens']} tokens of {Path(result['text']).name} (n_ctx {result['n_ctx']}); "
        f"{machine_line(m)}; `{result['command']}`",
    ]
    return "\n".join(lines) + "\n"


# --- vLLM: one process per system ------------------------------------------------------------------------


def system_folder(folder: Path, work: Path, name: str, text: Path) -> Path:
    """The folder vLLM runs for the width `name`, made in `work` as bench makes it (widths.vllm_folder: scheme,
    method, head), its quantize record measured on `text`, the rows' held-out text."""
    return vllm_folder(folder, name, work / f"{folder.name}-{name}", text, log=lambda *a: None)


def _vllm(folder: Path, work: Path, name: str, golden: dict, c: Chunks):
    model, dtype = system_folder(folder, work, name, Path(c.text)), WIDTHS[name].dtype
    job, answer_file = work / "job.json", work / "answer.json"
    write_json(job, {"model": str(model), "dtype": dtype, "golden": golden, "chunks": c.ids, "first": c.first})
    answer_file.unlink(missing_ok=True)  # the system before this one left its own
    done = subprocess.run(
        [sys.executable, "-c", f"from {__name__} import _vllm_child; _vllm_child({str(job)!r})"],
        capture_output=True,
        text=True,
    )
    if not answer_file.is_file():
        raise MiniStreamError(f"vLLM on {model} in {dtype} failed: {done.stderr.strip()[-1500:]}")
    if note := exit_note(done.returncode):
        print(f"bench-accuracy: vLLM on {model} in {dtype}: {note}", file=sys.stderr)
    answer = json.loads(answer_file.read_text())
    return answer["outputs"], answer["perplexity"]


def _vllm_child(job_path: str) -> None:
    """In its own process: one engine, the prompts and the held-out chunks."""
    from ..run.engine import EngineSettings
    from ..run.generate import vllm_engine, vllm_generate
    from ..run.vllm_perplexity import vllm_perplexity

    job = json.loads(Path(job_path).read_text())
    golden, ids = job["golden"], job["golden"]["prompt_ids"]
    longest = max(max(map(len, ids)) + golden["max_tokens"], len(job["chunks"][0]) + 1)
    llm = vllm_engine(
        Path(job["model"]),
        EngineSettings(dtype=job["dtype"], max_model_len=longest, enforce_eager=True),
        max_num_batched_tokens=max(longest, 2048),
    )
    outputs = vllm_generate(llm, ids, golden["max_tokens"], golden["top_k"])
    ppl = vllm_perplexity(llm, Chunks(job["chunks"], job["first"], ""))
    write_json(Path(job_path).with_name("answer.json"), {"outputs": outputs, "perplexity": ppl})


# --- llama.cpp -----------------------------------------------------------------------------------------


def _llamacpp(folder: Path, work: Path, name: str, golden: dict, c: Chunks):
    from ..checkpoint.gguf import export

    w = WIDTHS[name]
    dtype = w.dtype
    gguf = work / f"{folder.name}-{w.gguf}.gguf"
    export(folder, gguf, w.gguf, force=True)
    ctx = max(max(map(len, golden["prompt_ids"])) + golden["max_tokens"], len(c.ids[0]))
    outputs = []
    kv = KV_CACHE[dtype]
    server = llamacpp.server(
        gguf,
        free_port(),
        threads=2,
        ctx_per_slot=ctx,
        log_file=work / "server.log",
        extra=("-ctk", kv, "-ctv", kv),
    )
    with server as url:
        for ids in golden["prompt_ids"]:
            outputs.append(llamacpp.greedy_with_logprobs(url, ids, golden["max_tokens"], golden["top_k"]))
    ppl = llamacpp.perplexity(gguf, Path(c.text), len(c.ids[0]), kv=kv)
    return outputs, ppl
