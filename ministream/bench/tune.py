"""tune: the CPU defaults that are the machine's to decide, chosen on the machine by one quick same-run check.

Machines of one kind differ: zentorch and the core binding have each won on one machine and lost on another
(docs/tune.md). So no figure from one machine sets the default on another. `ministream tune` (`make install`
runs it) starts the reference shape (random weights, bfloat16) on the installed vLLM once per candidate and
decodes at batch 1, 8 and 64, each cell the median of repeats with their range (workers.measure):

  vllm      vLLM's own: VLLM_CPU_OMP_THREADS_BIND=auto, zentorch hidden (its plain CPU platform)
  ours      every core to the model (engine.core_binding), zentorch hidden
  zentorch  the binding chosen above, on vLLM's ZenCpuPlatform (only where zentorch is installed and used)
  in_process  the settings chosen above, the offline engine's core (and its worker) in the caller's process
            (VLLM_ENABLE_V1_MULTIPROCESSING=0): no process hop a step; offline engines at one rank only, since
            `vllm serve` keeps its own processes

A candidate replaces vLLM's own by RULE: where the serving batch (the largest measured, 64: what `serve`'s
ceiling under load rests on) tells the two apart beyond the spread (one's slowest repeat above the other's
fastest), it decides; where it cannot, the candidate must be faster beyond the spread at a smaller batch and
slower beyond it at none. Else vLLM's own. The cells of every batch stay in the record, so what the choice
costs at batch 1 is there to read. The record (run/tuned.py) holds the choice, every cell and the
machine; every engine at one rank follows it. A record for this machine and these releases is
kept: tune again with --force (after a BIOS or kernel change, say).
"""

import datetime
import sys
import time
from pathlib import Path

from .. import MiniStreamError
from ..atomic import write_json
from ..paths import BUILD
from ..run import engine, tuned
from .offline import prepare_model
from .workers import run_worker

DEFAULT_OUT = BUILD / "tune"
FULL = dict(dtype="bfloat16", batches=[1, 8, 64], new_tokens=32, prompt_len=32, repeats=5, serial_requests=1)
QUICK = dict(FULL, batches=[1], new_tokens=8, repeats=3, eager=True)
RULE = (
    "a candidate replaces vLLM's own where faster beyond the spread at the serving batch (the largest); where that "
    "batch cannot tell them apart, where faster beyond the spread at a smaller batch and slower beyond it at none"
)


def faster(a: list[dict], b: list[dict]) -> bool:
    """Whether cells `a` beat cells `b` by RULE ("beyond the spread": one's slowest repeat above the other's
    fastest)."""
    pairs = {
        x["batch"]: (x["tokens_per_s_range"], y["tokens_per_s_range"]) for x in a for y in b if x["batch"] == y["batch"]
    }
    if not pairs:
        raise ValueError("no batch size measured on both sides")
    ra, rb = pairs.pop(max(pairs))  # the serving batch
    if ra[0] > rb[1] or rb[0] > ra[1]:
        return ra[0] > rb[1]
    rest = pairs.values()
    return any(ra[0] > rb[1] for ra, rb in rest) and not any(rb[0] > ra[1] for ra, rb in rest)


def decide(cells: dict[str, list[dict]]) -> dict:
    """The choice from the candidates' rows: ours over vLLM's binding, then zentorch over the plain platform
    at the chosen binding, then the core in process over the settings chosen so far (each None where it was
    not measured: zentorch not installed or not used by vLLM; in_process in a run that had none)."""
    binding = "ours" if faster(cells["ours"], cells["vllm"]) else "vllm"
    zen = cells.get("zentorch")
    zentorch = None if zen is None else faster(zen, cells[binding])
    inproc = cells.get("in_process")
    best = "zentorch" if zentorch else binding
    return {
        "binding": binding,
        "zentorch": zentorch,
        "in_process": None if inproc is None else faster(inproc, cells[best]),
    }


def candidates(binding: str | None = None, zentorch: bool | None = None) -> dict[str, dict]:
    """Each candidate's environment; the zentorch one at `binding` (the chosen one), the in_process one at the
    binding and platform chosen (`zentorch`: the choice; False or None: hidden)."""
    hidden = {"PYTHONPATH": tuned.hide_zentorch()}
    bind = {"vllm": "auto", "ours": engine.core_binding(1)}
    envs = {"vllm": {engine.BIND: "auto", **hidden}, "ours": {engine.BIND: bind["ours"], **hidden}}
    if binding is not None:
        envs["zentorch"] = {engine.BIND: bind[binding]}
        envs["in_process"] = {**(envs["zentorch"] if zentorch else envs[binding]), engine.IN_PROCESS: "0"}
    return envs


def tune(out: Path = DEFAULT_OUT, model: Path | None = None, quick: bool = False, force: bool = False) -> int:
    """`ministream tune`: measure, decide, write the record (atomically; an old one stays where a run fails)."""
    record = tuned.record_path()
    if engine.has_gpu():
        print("tune: a GPU answers: vLLM's own defaults, nothing to choose")
        return 0
    if not force and tuned.chosen() is not None:
        print(f"tune: {tuned.describe(tuned.chosen())}; measured before on this machine (--force measures again)")
        return 0
    if tuned.fingerprint()["vllm"] is None:
        raise MiniStreamError("tune: vllm is not installed in this environment: run `make install` first")
    settings = dict(QUICK if quick else FULL)
    out.mkdir(parents=True, exist_ok=True)
    folder = model or Path(prepare_model("reference", out / "models")["hf"])
    spec = {"kind": "vllm", "model_dir": str(folder), "vocab": _vocab(folder), **settings}
    # the candidates see no record, old or new: only the environment each is given
    base = {tuned.RECORD_ENV: str(out / "no-record"), engine.KV_CACHE: "1"}
    t = time.perf_counter()
    cells, runs = {}, {}
    for name, env in candidates().items():
        runs[name] = _measure(name, spec, {**base, **env}, out)
        cells[name] = runs[name]["rows"]
    binding = decide(cells)["binding"]
    if tuned.fingerprint()["zentorch"] is not None:
        runs["zentorch"] = _measure("zentorch", spec, {**base, **candidates(binding)["zentorch"]}, out)
        if runs["zentorch"].get("vllm_platform") == "ZenCpuPlatform":
            cells["zentorch"] = runs["zentorch"]["rows"]
    so_far = decide(cells)
    inproc = candidates(binding, so_far["zentorch"])["in_process"]
    runs["in_process"] = _measure("in_process", spec, {**base, **inproc}, out)
    cells["in_process"] = runs["in_process"]["rows"]
    choice = decide(cells)
    write_json(
        record,
        {
            "schema": tuned.SCHEMA,
            "fingerprint": tuned.fingerprint(),
            "choice": choice,
            "rule": RULE,
            "settings": settings,
            "model": str(folder),
            "runs": runs,
            "seconds": round(time.perf_counter() - t, 1),
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["ministream", *sys.argv[1:]]),
        },
    )
    _print(cells)
    print(f"tune: {tuned.describe(choice)}")
    return 0


def _measure(name: str, spec: dict, env: dict, out: Path) -> dict:
    run = run_worker(f"tune-{name}", spec, out, env)
    if "error" in run:
        raise MiniStreamError(
            f"tune: the {name} candidate failed ({run['error']}; log {run['log']}):\n{run['log_tail']}\n"
            "the record is unchanged: engines keep their defaults"
        )
    return run


def _vocab(folder: Path) -> int:
    from ..checkpoint.folder import checked

    found = checked(folder).folder  # the prompts' random ids stay inside the tokenizer, else the embedding
    return found.tokenizer_size or int(found.config["vocab_size"])


def _print(cells: dict[str, list[dict]]) -> None:
    print(f"{'candidate':<10} {'batch':>5} {'tok/s':>8}  range")
    for name, rows in cells.items():
        for r in rows:
            lo, hi = r["tokens_per_s_range"]
            print(f"{name:<10} {r['batch']:>5} {r['tokens_per_s']:>8.1f}  {lo:.1f}-{hi:.1f}")
