"""bench-kernels: a decode step's matrix products at batch 1 and 32, by the kernels vLLM's CPU build runs them with,
as the rate each reads the weights at against this machine's read bandwidth (machine.read_bandwidth), and how far
each is from the exact product.

At batch 1 a step reads every weight once and does two flops a weight, so a kernel that reads at the machine's
bandwidth is as fast as the step can be; llama.cpp's decode comes near that (issue 56: at 1.2B in bf16 vLLM's step
read the weights at about half llama.cpp's rate). Per size (bench/scale.py's shapes) and width, every layer's
linear weights are allocated (random: a kernel's cost does not depend on the values; 8 layers' worth, --layers)
and each product is run over them in turn, so the weights come from memory as in a step, not from a cache that
holds one matrix:

    bfloat16    oneDNN's matmul through vLLM's handler (ops.create_onednn_mm) where oneDNN makes one (AVX-512 on),
                else torch's F.linear: dispatch_cpu_unquantized_gemm's choice without zentorch; and there
                the CPU part's product: its own matrix-vector kernel for a few rows, widened to float32 from
                more on (fork/cpu.py GEMM_HELPER)
    float32     the same, on float32 weights, and F.linear beside it
    w8a8        oneDNN's int8 matmul through vLLM's handler (ops.create_onednn_scaled_mm, the CPU scaled-mm
                kernel's choice without AMX), the activation quantized per token first, as vLLM does; and the
                CPU part's products where oneDNN's would saturate (fork/cpu.py INT8_HELPER): its own int8 kernel,
                and oneDNN's split in two products, which it takes where the kernel cannot be built

`ministream bench-kernels [--size 1.2b] [--out DIR]` (make bench-kernels); one JSON and a table under OUT.
"""

import statistics
import time
from pathlib import Path

import torch

from .. import MiniStreamError
from ..atomic import write_json
from ..paths import BUILD
from .machine import machine, machine_line, read_bandwidth

DEFAULT_OUT = BUILD / "bench" / "kernels"
WIDTHS = ("bfloat16", "float32", "w8a8")
STEPS, ROUNDS = 5, 3  # passes over every layer per round; the best round's median kept
BATCHES = (1, 32)  # decode at batch 1, and at the bench's batch
LAYERS = 8  # copies of a layer's weights cycled: far beyond any cache, and a third of 1.2B's memory and time
SLOW_PASS_S = 2.0  # a kernel whose first pass over the layers takes longer is timed over one more pass


def shapes(size: str) -> dict[str, tuple[int, int]]:
    """The linear weights of one layer, [out, in], as vLLM fuses them (qkv, gate_up), and the head."""
    from .scale import train_config

    cfg = train_config(size)
    attn = cfg.n_heads * cfg.head_dim
    return {
        "qkv_proj": ((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.d_model),
        "o_proj": (cfg.d_model, attn),
        "gate_up_proj": (2 * cfg.d_ff, cfg.d_model),
        "down_proj": (cfg.d_model, cfg.d_ff),
        "lm_head": (cfg.vocab_size, cfg.d_model),
    }


def _cpu_part(helper: bytes) -> dict:
    """One of the CPU part's helpers (fork/cpu.py: INT8_HELPER, GEMM_HELPER) run as vLLM's file would run it, with
    the names that file gives it, on whatever CPU this is: its functions by name."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum

    scope: dict = {"torch": torch, "ops": ops, "current_platform": current_platform, "CpuArchEnum": CpuArchEnum}
    exec(helper.decode(), scope)
    return scope


def kernels(width: str, weight: torch.Tensor) -> dict:
    """name -> (the product x -> y for this weight [out, in], the bytes it reads, x -> the exact product it
    stands for, in float64): the kernels of `width`, each as vLLM's CPU build would run it."""
    from vllm import _custom_ops as ops

    if width == "w8a8":
        scale = weight.float().abs().amax(1) / 127
        q = (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        from ..fork.cpu import INT8_HELPER

        split, kernel = _cpu_part(INT8_HELPER), _cpu_part(INT8_HELPER)
        split["_MINISTREAM_INT8_SPLIT"] = kernel["_MINISTREAM_INT8_SPLIT"] = True  # as on a CPU without VNNI
        split["_MINISTREAM_INT8_KERNEL"] = False
        handlers = {
            "onednn_scaled_mm (vLLM's own)": (ops.create_onednn_scaled_mm, ops.onednn_scaled_mm),
            "onednn_scaled_mm split in two (the CPU part without its kernel)": (
                split["_ministream_create_onednn_scaled_mm"],
                split["_ministream_onednn_scaled_mm"],
            ),
        }
        if kernel["_ministream_int8_kernels"]() is not None:
            handlers["the CPU part's int8 kernel"] = (
                kernel["_ministream_create_onednn_scaled_mm"],
                kernel["_ministream_onednn_scaled_mm"],
            )

        def int8_exact(x):  # vLLM's own activation quantization, then int8 arithmetic without overflow
            x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
            return (x_q.long() @ q.long().T).double() * x_s.double() * scale.double()

        out = {}
        for name, (create, run) in handlers.items():
            handler = create(q.t(), scale, torch.float32, True, False, 32)

            def int8_mm(x, handler=handler, run=run):
                x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
                return run(handler, x_q, torch.empty((x.shape[0], handler.n), dtype=x.dtype), x_s, None, None, None)

            reads = q.numel() * (2 if "split" in name else 1) + 4 * scale.numel()
            out[name] = (int8_mm, reads, int8_exact)
        return out
    w = weight.to(getattr(torch, width))
    nbytes = w.numel() * w.element_size()

    def exact(x):
        return x.double() @ w.double().T

    linear = (lambda x: torch.nn.functional.linear(x, w), nbytes, exact)
    try:  # as dispatch_cpu_unquantized_gemm: oneDNN where it makes the primitive, else torch's F.linear
        handler = ops.create_onednn_mm(w.t(), 32)
    except RuntimeError:  # oneDNN has no such matmul on this CPU (bfloat16 with AVX2 alone)
        from ..fork.cpu import GEMM_HELPER, GEMM_ROWS

        part = _cpu_part(GEMM_HELPER)["_ministream_bf16_linear"]
        return {
            "F.linear (vLLM's: oneDNN refused)": linear,
            f"the CPU part: its kernel, widened from {GEMM_ROWS} rows": (lambda x: part(x, w, None), nbytes, exact),
        }
    return {"onednn_mm (vLLM's)": (lambda x: ops.onednn_mm(handler, x, None), nbytes, exact), "F.linear": linear}


def measure(size: str, width: str, layers: int, batches=BATCHES) -> list[dict]:
    """Each shape's products over `layers` copies, per kernel and batch: seconds per product, GB/s of weights
    read, and the largest error against the exact product, relative to its largest value."""
    rows = []
    dtype = torch.bfloat16 if width == "bfloat16" else torch.float32
    for name, (n, k) in shapes(size).items():
        copies = 1 if name == "lm_head" else layers
        made = [kernels(width, torch.randn(n, k, dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        for batch in batches:
            x = torch.randn(batch, k, dtype=dtype)
            for kernel in made[0]:
                ops = [m[kernel][0] for m in made]
                nbytes, exact = made[0][kernel][1:]
                want = exact(x)
                error = float((ops[0](x).double() - want).abs().max() / want.abs().max())
                t = time.perf_counter()
                for op in ops:  # once: the first call builds oneDNN's primitive
                    op(x)
                slow = time.perf_counter() - t > SLOW_PASS_S  # one pass more is figure enough (a slow kernel)
                best = []
                for _ in range(1 if slow else ROUNDS):
                    got = []
                    for _ in range(1 if slow else STEPS):
                        t = time.perf_counter()
                        for op in ops:
                            op(x)
                        got.append((time.perf_counter() - t) / len(ops))
                    best.append(statistics.median(got))
                s = min(best)
                rows.append({"width": width, "shape": name, "out_in": [n, k], "kernel": kernel, "batch": batch,
                             "layers": copies, "us": s * 1e6, "bytes": nbytes, "gb_per_s": nbytes / s / 1e9,
                             "error": error})  # fmt: skip
        del made
    return rows


def step_rows(rows: list[dict], size: str) -> list[dict]:
    """Per width, kernel and batch: a whole step's products (every layer's and the head), their rate, and the
    largest error of any of them."""
    from .scale import train_config

    layers = train_config(size).n_layers
    out = []
    for key in dict.fromkeys((r["width"], r["kernel"], r["batch"]) for r in rows):
        per = {r["shape"]: r for r in rows if (r["width"], r["kernel"], r["batch"]) == key}
        seconds = sum(r["us"] / 1e6 * (1 if s == "lm_head" else layers) for s, r in per.items())
        nbytes = sum(r["bytes"] * (1 if s == "lm_head" else layers) for s, r in per.items())
        out.append({"width": key[0], "kernel": key[1], "batch": key[2], "step_ms": seconds * 1e3,
                    "weights_gb": nbytes / 1e9, "gb_per_s": nbytes / seconds / 1e9, "tok_s_bound": key[2] / seconds,
                    "error": max(r["error"] for r in per.values())})  # fmt: skip
    return out


def notes(widths) -> list[str]:
    """What the table does not show for this machine: where vLLM runs int8 weights through a kernel other than the
    oneDNN products timed here."""
    from ..run.kernels import installed_vllm_dir, int8_needs_16_bits

    if "w8a8" in widths and int8_needs_16_bits(installed_vllm_dir()):
        return [
            "w8a8: on this CPU (AMX) vLLM runs int8 weights through its AMX kernel (int8_scaled_mm_with_quant, 16-bit "
            "activations), not through the oneDNN products timed here."
        ]
    return []


def table(result: dict) -> str:
    bw = result["read_bandwidth"]["gb_per_s"]
    lines = [
        f"# bench-kernels: a decode step's products at {result['size']}; {machine_line(result['machine'])}",
        "",
        f"read bandwidth (a sum over 2 GiB, {result['read_bandwidth']['threads']} threads): {bw:.1f} GB/s. "
        "Error: the largest difference from the exact product, relative to its largest value.",
        *(f"\n{note}" for note in result.get("notes", [])),
        "",
        "| width | kernel | batch | step's products (ms) | weights read (GB) | GB/s | of bandwidth | tok/s at most "
        "| error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["steps"]:
        lines.append(
            f"| {r['width']} | {r['kernel']} | {r['batch']} | {r['step_ms']:.1f} | {r['weights_gb']:.2f} "
            f"| {r['gb_per_s']:.1f} | {r['gb_per_s'] / bw:.0%} | {r['tok_s_bound']:.1f} | {r['error']:.1e} |"
        )
    lines += [
        "",
        "| width | shape | [out, in] | kernel | batch | us | GB/s | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['width']} | {r['shape']} | {r['out_in']} | {r['kernel']} | {r['batch']} | {r['us']:.0f} "
            f"| {r['gb_per_s']:.1f} | {r['error']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def bench_kernels(out: Path, size: str = "1.2b", widths=WIDTHS, layers: int | None = None, batches=BATCHES) -> int:
    from .scale import SIZES, train_config

    if size not in SIZES:
        raise MiniStreamError(f"--size {size}: choose one of {', '.join(SIZES)}")
    if set(widths) - set(WIDTHS):
        raise MiniStreamError(f"--widths {','.join(widths)}: choose of {', '.join(WIDTHS)}")
    layers = layers or min(LAYERS, train_config(size).n_layers)
    started = time.time()
    result: dict = {"size": size, "machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result["read_bandwidth"] = read_bandwidth()
    rows = [r for w in widths for r in measure(size, w, layers, batches)]
    result |= {"rows": rows, "steps": step_rows(rows, size), "seconds": time.time() - started}
    result["notes"] = notes(widths)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"kernels-{size}.json", result)
    text = table(result)
    (out / f"kernels-{size}.md").write_text(text)
    print(text)
    return 0
