"""scale: what every tool costs against model size (`make bench-scale`), from the reference shape (81M
parameters with its tied head) to a LLaMA-2-7B-like shape, on this machine.

Per size: a training checkpoint of random weights written in bfloat16 directly (the cost of a tool does not
depend on the weights; a float32 copy of a 7B model is 28 GB), with the trainer's float32 Adam moments where
the disk allows (SIZES); then each tool as a user runs it (the `ministream` CLI in a child, timed_command: wall
time and peak RSS), its peak set against the bytes of weights it must hold; then vLLM (bfloat16 and w8a8)
against llama.cpp at the same width (bf16 GGUF, q8_0): engine start, first token and decode at batch 1 and 32,
the best of the repeats (workers.py, one process each). A tool that fails, or that would not fit, is a row saying
why, never the end of the run. One JSON per size under OUT (kept, and skipped the next time, unless --force),
the size's files deleted once its row is done, and OUT/scale.md, the table, written from the JSONs (`report`).

`ministream bench-scale [--sizes reference,1.2b] [--out DIR] [--quick] [--force] [--report]` (make bench-scale);
`python -m ministream.bench.scale perplexity FOLDER`: the reference model's perplexity on the held-out text
(checkpoint/perplexity.py), the tool that quantize's check runs, as a command of its own;
`python -m ministream.bench.scale write RAW SIZE`: the size's checkpoint (write_checkpoint), measured as a tool is.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..atomic import write_json, write_text
from ..paths import BUILD
from ..run import engine
from . import widths
from .machine import machine_line
from .reporting import new_result
from .workers import run_worker

DEFAULT_OUT = BUILD / "bench-scale"
SCHEMA = 1
GB = 1e9
COMMON = dict(max_seq_len=2048, vocab_size=32000, norm_eps=1e-6, rope_theta=10000.0, bos_id=0, eos_id=1)


@dataclass(frozen=True)
class Size:
    shape: dict  # the train config's shape (COMMON fills the rest)
    optimizer: bool  # the float32 Adam moments in model.pt, as the trainer saves them (8 bytes a parameter)
    why: str  # where it comes from; and why no optimizer where there is none


SIZES = {
    # demo.REFERENCE: the write-up's shape, every other figure of the project's
    "reference": Size(dict(d_model=768, n_layers=8, n_heads=12, d_ff=2048, head_dim=64), True, "the reference shape"),
    # issue 56's table: 24 layers, d_model 2048, GQA 16/8; model.pt 11.2 GiB with the moments
    "1.2b": Size(
        dict(d_model=2048, n_layers=24, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=5632), True, "issue 56's shape"
    ),
    # a ~3B GQA shape: its moments would make model.pt 29 GB, beyond what the size's other files leave of 50 GB
    "3b": Size(
        dict(d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128, d_ff=8192),
        False,
        "~3B GQA; no optimizer state (model.pt would be 29 GB)",
    ),
    # LLaMA-2-7B's shape (MHA, untied head): 13.5 GB in bf16; its moments (54 GB) do not fit the disk
    "7b": Size(
        dict(d_model=4096, n_layers=32, n_heads=32, head_dim=128, d_ff=11008, tie_embeddings=False),
        False,
        "LLaMA-2-7B's shape; no optimizer state (model.pt would be 67 GB)",
    ),
}

FULL = dict(widths=["bfloat16", "w8a8"], batches=[1, 32], new_tokens=128, prompt_len=32, repeats=3)
QUICK = dict(FULL, new_tokens=32, repeats=1)

# what each tool holds, for the ratio: "weights" the model's bf16 weights, "written" the file it writes
# (name, what it holds, arguments after `ministream`: {raw} {hf} {work} filled per size)
TOOLS: list[tuple[str, str, list[str]]] = [
    ("convert", "weights", ["convert", "{raw}", "{hf}", "--force"]),
    ("gguf q8_0", "written", ["gguf", "{hf}", "{work}/q8_0.gguf", "--dtype", "q8_0", "--force"]),
    ("gguf bf16", "written", ["gguf", "{hf}", "{work}/bf16.gguf", "--dtype", "bf16", "--force"]),
    ("doctor", "weights", ["doctor", "{hf}"]),
    ("quantize w8a8", "weights", ["quantize", "{hf}", "{hf}-w8a8", "--scheme", "w8a8", "--force"]),
    ("perplexity", "weights", ["-m", "ministream.bench.scale", "perplexity", "{hf}"]),
    ("verify --raw", "weights", ["verify", "{hf}", "--raw", "{raw}", "--out", "{work}/verify"]),
    ("fingerprint", "weights", ["fingerprint", "{hf}"]),
]
# --tools names them by their first word; convert always runs (every other tool and engine reads its folder)
TOOL_NAMES = tuple(dict.fromkeys(name.split()[0] for name, _, _ in TOOLS))[1:]
# the engines at each width: vLLM on the folder of the width (the quantize tool's for w8a8), llama.cpp on its GGUF
SYSTEMS = ("vllm", "llamacpp")


# ---------------------------------------------------------------- the model


def train_config(size: str):
    from ..spec import TrainConfig

    return TrainConfig(**{**COMMON, **SIZES[size].shape})


def model_bytes(size: str) -> dict:
    """The parameters of the size's shape, its weights' bytes in bfloat16, and what a tool that streams must hold:
    one block plus the largest tensor (the embedding, or an MLP matrix), both in bfloat16."""
    import torch

    from ..checkpoint.reference import MiniStream

    with torch.device("meta"):
        model = MiniStream(train_config(size))
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    largest = max(p.numel() for p in model.parameters())
    return {"parameters": params, "weights_bytes": 2 * params, "stream_bytes": 2 * (block + largest)}


def write_checkpoint(out: Path, size: str, seed: int = 0, log=print) -> dict:
    """out/model.pt (bfloat16 weights, N(0, 0.02), norms ones; the Adam moments where the size has them) and
    out/tokenizer.json. Each tensor lives in a file of its own under a scratch folder, mapped (torch.from_file),
    filled a slice at a time: torch.save reads them back from the page cache, so this process never holds the
    model in anonymous memory, at any size. The moments are zeros from sparse files: no disk until saved."""
    import torch

    from ..checkpoint.demo import train_tokenizer
    from ..checkpoint.format import save_checkpoint
    from ..checkpoint.reference import MiniStream

    cfg = train_config(size)
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.ndim) for k, v in MiniStream(cfg).state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="scale-tensors-", dir=out))
    g = torch.Generator().manual_seed(seed)

    def mapped(name: str, shape: tuple, dtype) -> torch.Tensor:
        n = math.prod(shape)
        return torch.from_file(str(scratch / name), shared=True, size=n, dtype=dtype).view(shape)

    try:
        state = {}
        for i, (key, (shape, ndim)) in enumerate(shapes.items()):
            t = mapped(f"w{i}", shape, torch.bfloat16)
            if ndim == 1:
                t.fill_(1.0)  # a norm's weight
            else:
                rows = max(1, 2**24 // shape[1])  # 64 MB of float32 at a time
                for r in range(0, shape[0], rows):
                    chunk = t[r : r + rows]
                    chunk.copy_(torch.randn(chunk.shape, generator=g) * 0.02)
            state[key] = t
        extra: dict[str, Any] = {"step": 1}
        if SIZES[size].optimizer:  # torch.optim.AdamW's state dict, parameters numbered in model order
            moments = {
                i: {
                    "step": torch.tensor(1.0),
                    "exp_avg": mapped(f"m{i}", shape, torch.float32),
                    "exp_avg_sq": mapped(f"v{i}", shape, torch.float32),
                }
                for i, (shape, _) in enumerate(shapes.values())
            }
            group = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False)
            extra["optimizer"] = {"state": moments, "param_groups": [{**group, "params": list(moments)}]}
        save_checkpoint(out / "model.pt", state, cfg, extra)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    train_tokenizer(32000).save(str(out / "tokenizer.json"))
    log(f"scale: wrote {out}/model.pt ({(out / 'model.pt').stat().st_size / GB:.1f} GB) and tokenizer.json")
    return {"model_pt_bytes": (out / "model.pt").stat().st_size}


def perplexity_main(folder: str) -> int:
    """The reference model's perplexity on the held-out text, on the folder's weights as stored."""
    from ..checkpoint.perplexity import chunks, folder_perplexity

    print(f"perplexity {folder_perplexity(Path(folder), chunks(Path(folder))):.3f}")
    return 0


# ---------------------------------------------------------------- the run


def _ms() -> str:
    return str(Path(sys.executable).parent / "ministream")


def tool_command(args: list[str], places: dict[str, Path]) -> list[str]:
    """The command line of a TOOLS row: `ministream ...`, or this Python's `-m ...`."""
    filled = [a.format(**places) for a in args]
    return [sys.executable, *filled] if filled[0] == "-m" else [_ms(), *filled]


# timed_command's peak RSS is getrusage's, which keeps at exec the peak of the process that forked the command
# (Python forks by vfork: its whole life's peak): from this process, which has imported torch, every tool would
# show at least this process's peak. A small Python in between forks the tool instead: its ~15 MB is the floor.
LAUNCHER = (
    "import json, sys; from ministream.bench.memory import timed_command; "
    "print(json.dumps(timed_command(sys.argv[1:])))"
)


def measured(command: list[str]) -> dict:
    """timed_command(command), run from LAUNCHER: the command's own wall time and peak RSS."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, *command], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"command": " ".join(command), "error": f"could not start: {proc.stderr.strip()[-500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_tool(name: str, holds: str, command: list[str], sizes: dict) -> dict:
    """One tool's row: wall time, peak RSS and the ratio to what it holds, or, where it failed, why."""
    print(f"scale: {name} ...", end=" ", flush=True)
    row: dict[str, Any] = {"tool": name, **measured(command)}
    if row.get("error", "").startswith("exit -9"):  # SIGKILL: the kernel's OOM killer, on this machine
        row["error"] = "killed (out of memory?): " + row["error"]
    held = sizes.get(holds)
    row["holds"], row["holds_bytes"] = holds, held
    if held and row.get("peak_rss_mib"):
        row["rss_over_held"] = row["peak_rss_mib"] * 2**20 / held
    print(f"{row.get('seconds', 0):.0f}s" + (f" FAILED ({row['error'][:200]})" if "error" in row else ""), flush=True)
    return row


def engine_rows(hf: Path, settings: dict, logs: Path, vocab: int, kv_gib: int) -> Iterator[dict]:
    """vLLM and llama.cpp at each width: start, first token, decode tok/s at each batch (run_worker, its log under
    LOGS/logs), or why not."""
    for name in map(widths.runnable, settings["widths"]):  # the int8 width this machine's vLLM runs
        w = widths.width(name)
        folder = hf if w.scheme is None else hf.parent / f"{hf.name}-{w.scheme}"
        base = {k: settings[k] for k in ("batches", "new_tokens", "prompt_len", "repeats")}
        base |= {"vocab": vocab, "dtype": w.dtype, "width": name, "serial_requests": 1}
        for system in SYSTEMS:
            row: dict[str, Any] = {"system": system, "width": name}
            why = widths.refusal(name) if system == "vllm" else None
            why = why or (None if folder.is_dir() else f"no folder {folder}: its quantize row failed or did not run")
            why = why or would_not_fit(folder, w.dtype, kv_gib)
            if why:
                yield {**row, "error": why}
                continue
            spec = {**base, "kind": system, "model_dir": str(folder if system == "vllm" else hf)}
            if system == "llamacpp":
                from ..run.server import free_port

                spec["port"] = free_port()
            env = {engine.KV_CACHE: str(kv_gib)}
            yield {**row, **summarize_worker(run_worker(f"{system}-{name}", spec, logs, env))}


def would_not_fit(folder: Path, dtype: str, kv_gib: int) -> str | None:
    """Why an engine on the folder would not fit this machine's memory now, or None: its weights in the dtype it
    computes in (Folder.held_bytes, as the engines' pre-flight counts them) and its KV cache, against 0.9 of what is
    available now (a benchmark skips what would likely be killed; the pre-flight refuses only what cannot start)."""
    import psutil

    from ..checkpoint.findings import FolderError
    from ..checkpoint.folder import examine

    try:
        need = examine(folder).folder.held_bytes(dtype) + kv_gib * 2**30
    except FolderError as e:
        return f"{folder} cannot be read: {e.text}"
    have = psutil.virtual_memory().available
    return f"would need {need / GB:.1f} GB, {have / GB:.1f} GB available" if need > 0.9 * have else None


def summarize_worker(r: dict) -> dict:
    """A worker's result, cut to what the table shows: the best of the repeats at each batch."""
    if "error" in r:  # with the log's last line: what the worker said last (its error, where it raised one)
        said = next((line.strip() for line in reversed(r.get("log_tail", "").splitlines()) if line.strip()), "")
        return {"error": f"{r['error']}: {said[-400:]}", "log": r.get("log")}
    batches = {
        str(row["batch"]): {"best_tok_s": row["tokens_per_s_range"][1], "median_tok_s": row["tokens_per_s"]}
        for row in r["rows"]
    }
    one = next((row for row in r["rows"] if row["batch"] == 1), r["rows"][0])
    return {
        "start_s": r["start_s"],
        "first_token_s": one["ttft_s"],
        "decode": batches,
        "peak_rss_mib": r.get("peak_rss_mib"),
        "weights_file_bytes": r.get("weights_file_bytes"),
        "compiled_model": r.get("compiled_model"),
    }


def measure_size(size: str, out: Path, settings: dict, keep: bool = False) -> dict:
    """One size's row: the checkpoint, every tool, the engines; saved after each step (partial until the end)."""
    started = time.time()
    result: dict[str, Any] = {
        **new_result(SCHEMA, started, SIZES[size].why),
        "size": size,
        "shape": train_config(size).to_dict(),
        "optimizer_state": SIZES[size].optimizer,
        "settings": settings,
        **model_bytes(size),
        "tools": [],
        "engines": [],
    }
    work = out / f"work-{size}"
    raw, hf = work / "raw", work / "hf"
    path = out / f"scale-{size}.json"
    # a KV cache for the largest batch's tokens in float32 (w8a8 computes in it): the figures do not depend on
    # its size beyond that, and a larger one takes memory the 7B shape needs
    tokens = max(settings["batches"]) * (settings["prompt_len"] + settings["new_tokens"])
    kv_gib = max(1, math.ceil(kv_bytes(size) * tokens * 2 / 2**30))
    env = {engine.KV_CACHE: os.environ.get(engine.KV_CACHE) or str(kv_gib)}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # verify's engine, as the workers' (timed_command passes this environment on)
    try:
        shutil.rmtree(work, ignore_errors=True)
        print(f"scale: {size}: writing the checkpoint", flush=True)
        result["checkpoint"] = measured([sys.executable, "-m", "ministream.bench.scale", "write", str(raw), size])
        if "error" in result["checkpoint"]:
            return _save(result, path, started)
        result["checkpoint"]["model_pt_bytes"] = (raw / "model.pt").stat().st_size
        places = {"raw": raw, "hf": hf, "work": work}
        for name, holds, args in TOOLS:
            if name != "convert" and name.split()[0] not in settings.get("tools", TOOL_NAMES):
                continue
            sizes = {"weights": result["weights_bytes"]}
            row = run_tool(name, holds, tool_command(args, places), sizes)
            if holds == "written" and "error" not in row:  # the ratio to the file it wrote
                written = Path(args[2].format(**places))
                row["holds_bytes"] = written.stat().st_size
                row["rss_over_held"] = row["peak_rss_mib"] * 2**20 / row["holds_bytes"]
            result["tools"].append(row)
            _save(result, path, started, partial=True)
        if hf.is_dir():
            from ..checkpoint.folder import checked

            # the prompts' ids: the tokenizer's own (the vocabulary is padded past it)
            vocab = checked(hf).folder.tokenizer_size or train_config(size).vocab_size
            for gguf in work.glob("*.gguf"):  # the gguf rows' files: llama.cpp's worker exports its own
                gguf.unlink()
            for row in engine_rows(hf, settings, out / f"engines-{size}", vocab, kv_gib):
                result["engines"].append(row)
                _save(result, path, started, partial=True)
        else:
            result["engines"] = [
                {"system": s, "width": w, "error": "no converted folder: the convert row failed"}
                for w in settings["widths"]
                for s in SYSTEMS
            ]
        return _save(result, path, started)
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def kv_bytes(size: str) -> int:
    """KV cache bytes a token takes in bfloat16 (keys and values, every layer)."""
    cfg = train_config(size)
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2


def _save(result: dict, path: Path, started: float, partial: bool = False) -> dict:
    result["partial"], result["seconds"] = partial, time.time() - started
    result["load_average_end"] = os.getloadavg()
    write_json(path, result)
    return result


def scale_command(
    out: Path = DEFAULT_OUT,
    sizes: list[str] | None = None,
    quick: bool = False,
    force: bool = False,
    report_only: bool = False,
    keep: bool = False,
    tools: list[str] | None = None,
    **overrides,
) -> int:
    """Measure each size not yet measured in OUT (or every size, --force), then write OUT/scale.md from all of
    OUT's results. Exit 1 where a tool or engine failed (its row says why), 0 where every row has figures.
    tools: the tools after convert to run (TOOL_NAMES, all by default); a size's result records them."""
    sizes = sizes or ["reference", "1.2b"]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise MiniStreamError(f"--sizes {','.join(unknown)}: unknown size; choose from {', '.join(SIZES)}")
    unknown = [t for t in tools or () if t not in TOOL_NAMES]
    if unknown:
        raise MiniStreamError(
            f"--tools {','.join(unknown)}: no such tool; choose from {', '.join(TOOL_NAMES)} (convert always runs)"
        )
    settings = {**(QUICK if quick else FULL), **{k: v for k, v in overrides.items() if v is not None}}
    settings["tools"] = list(TOOL_NAMES if tools is None else tools)
    out.mkdir(parents=True, exist_ok=True)
    for size in [] if report_only else to_measure(out, sizes, force):
        measure_size(size, out, settings, keep)
    return report(out)


def to_measure(out: Path, sizes: list[str], force: bool) -> list[str]:
    """The sizes without a whole result in OUT (an interrupted one's is partial), or all of them with --force."""
    todo = []
    for size in sizes:
        path = out / f"scale-{size}.json"
        if path.is_file() and not force and not read(path).get("partial"):
            print(f"scale: {size}: measured already ({path}; --force measures it again)")
        else:
            todo.append(size)
    return todo


def read(path: Path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------- the report


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _start_note(row: dict) -> str:
    how = row.get("compiled_model") or ""
    return {"loaded": "start: its compiled model loaded", "compiled": "start: its model compiled"}.get(how, "")


def _why(row: dict) -> str:
    return row["error"].splitlines()[0][:160].replace("|", "/")


def results(out: Path) -> list[dict]:
    """OUT's results, smallest size first."""
    found = [read(p) for p in out.glob("scale-*.json")]
    return sorted(found, key=lambda r: r.get("parameters", 0))


def table(result: dict) -> str:
    """One size's markdown: the tools (wall, peak RSS, the ratio to what each holds), then the engines."""
    gib = 2**30
    lines = [
        f"### {result['size']}: {result['parameters'] / 1e9:.2f}B parameters, {result['weights_bytes'] / GB:.2f} GB "
        f"in bf16 (one block + the largest tensor {result['stream_bytes'] / GB:.2f} GB)",
        "",
        f"{result.get('note', '')}; {machine_line(result.get('machine', {}))}; started {result.get('started')}, "
        f"load average {_f(result.get('load_average_start', [None])[0])} at the start"
        + (" (PARTIAL: interrupted)" if result.get("partial") else ""),
        "",
    ]
    ck = result.get("checkpoint", {})
    if "error" in ck:
        lines += [f"checkpoint: {ck['error']}", ""]
    elif ck:
        lines += [
            f"model.pt {ck['model_pt_bytes'] / gib:.1f} GiB"
            + (" (bf16 weights + fp32 Adam moments)" if result.get("optimizer_state") else " (bf16 weights only)")
            + f", written in {ck['seconds']:.0f} s",
            "",
        ]
    lines += ["| tool | wall (s) | peak RSS (GB) | holds (GB) | RSS / holds | note |", "|---|---|---|---|---|---|"]
    for t in result.get("tools", []):
        rss = t.get("peak_rss_mib")
        held = t.get("holds_bytes")
        lines.append(
            f"| {t['tool']} | {_f(t.get('seconds'))} | {_f(rss and rss * 2**20 / GB, '{:.2f}')} | "
            f"{_f(held and held / GB, '{:.2f}')} ({t.get('holds')}) | {_f(t.get('rss_over_held'), '{:.2f}x')} | "
            f"{_why(t) if 'error' in t else ''} |"
        )
    st = result.get("settings", {})
    batches = st.get("batches", [1, 32])
    head = " | ".join(f"tok/s batch {b}" for b in batches)
    lines += [
        "",
        f"engines: the best of {st.get('repeats')} repeats of {st.get('new_tokens')} new tokens after "
        f"{st.get('prompt_len')}-token prompts; peak RSS of the engine's process tree",
        "",
        f"| engine | width | start (s) | first token (s) | {head} | peak RSS (GB) | note |",
        "|---|---|---|---|" + "---|" * len(batches) + "---|---|",
    ]
    for e in result.get("engines", []):
        decode = e.get("decode", {})
        cells = " | ".join(_f(decode.get(str(b), {}).get("best_tok_s")) for b in batches)
        rss = e.get("peak_rss_mib")
        lines.append(
            f"| {e['system']} | {e['width']} | {_f(e.get('start_s'))} | {_f(e.get('first_token_s'), '{:.2f}')} | "
            f"{cells} | {_f(rss and rss * 2**20 / GB, '{:.2f}')} | {_why(e) if 'error' in e else _start_note(e)} |"
        )
    lines += ["", f"measured in {_f(result.get('seconds', 0) / 60, '{:.0f}')} min", ""]
    return "\n".join(lines)


def report(out: Path) -> int:
    """OUT/scale.md from every result in OUT; exit 1 if any row failed."""
    found = results(out)
    if not found:
        raise MiniStreamError(f"{out}: no scale-*.json; run `make bench-scale` first")
    text = "\n".join(
        [
            "# bench-scale: every tool's cost against model size",
            "",
            "Random bf16 weights. Peak RSS is the tool's own (getrusage: the largest process of its tree), against "
            "the bytes it must hold: the model's bf16 weights, or the file it writes (gguf).",
            "",
            *(table(r) for r in found),
        ]
    )
    path = write_text(out / "scale.md", text)
    print(text)
    print(f"scale: {path}")
    failed = any("error" in row for r in found for row in [*r.get("tools", []), *r.get("engines", [])])
    return 1 if failed or any(r.get("partial") for r in found) else 0


def main(argv: list[str] | None = None) -> int:
    """The two steps measure_size runs as tools of their own (a fresh process each: its own peak RSS)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["perplexity"] and len(argv) == 2:
            return perplexity_main(argv[1])
        if argv[:1] == ["write"] and len(argv) == 3:  # the checkpoint, in a process of its own (measure_size)
            write_checkpoint(Path(argv[1]), argv[2])
            return 0
    except MiniStreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("usage: python -m ministream.bench.scale perplexity FOLDER | write RAW SIZE (the run: bench-scale)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
