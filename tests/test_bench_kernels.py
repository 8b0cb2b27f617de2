"""bench-kernels (issue 56): each kernel it times computes the product vLLM's layer would, through vLLM's own CPU
ops (a handler built wrong would time something else), and a step's figures add up its shapes over the layers.
The figures themselves come from `make bench-kernels`, never from a test."""

import pytest
import torch

from ministream import MiniStreamError
from ministream.bench import kernels


@pytest.mark.parametrize("width", kernels.WIDTHS)
def test_each_kernel_computes_the_layers_product(width):
    torch.manual_seed(0)
    weight = torch.randn(256, 512, dtype=torch.bfloat16) * 0.02
    dtype = torch.bfloat16 if width == "bfloat16" else torch.float32
    x = torch.randn(4, 512, dtype=dtype)
    made = kernels.kernels(width, weight)
    assert made, width
    for name, (op, nbytes, exact) in made.items():
        got, want = op(x), exact(x)
        assert got.shape == (4, 256) and got.dtype == dtype, name
        # against the float64 product of the same weights (w8a8: of the same int8 values and activations); bfloat16
        # sums lose a few bits, a wrong handler far more
        assert (want - torch.nn.functional.linear(x.double(), weight.double())).abs().max() < 0.05, name
        err = float((got.double() - want).abs().max() / want.abs().max())
        if "vLLM's own" not in name:  # vLLM's own int8 product saturates on an x86 CPU without VNNI: measured
            assert err < 0.01, (name, err)
        per = {"bfloat16": 2, "float32": 4, "w8a8": 1}[width] * (2 if "split" in name else 1)
        assert nbytes == 256 * 512 * per + (4 * 256 if width == "w8a8" else 0), name


def test_a_steps_figures_are_its_shapes_over_the_layers():
    rows = [
        {"width": "bfloat16", "shape": s, "kernel": "k", "batch": 1, "us": us, "bytes": b, "error": e}
        for s, us, b, e in (
            ("qkv_proj", 100, 10**6, 0.0),
            ("o_proj", 50, 5 * 10**5, 0.2),
            ("lm_head", 1000, 10**7, 0.1),
        )
    ]
    (step,) = kernels.step_rows(rows, "reference")  # 8 layers
    assert step["error"] == 0.2 and step["batch"] == 1
    assert step["step_ms"] == pytest.approx((8 * 150 + 1000) / 1000)
    assert step["weights_gb"] == pytest.approx((8 * 1.5e6 + 1e7) / 1e9)
    assert step["gb_per_s"] == pytest.approx(step["weights_gb"] / step["step_ms"] * 1000)


def test_an_unknown_size_or_width_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(MiniStreamError, match="--size 2b"):
        kernels.bench_kernels(tmp_path, "2b")
    with pytest.raises(MiniStreamError, match="--widths int3"):
        kernels.bench_kernels(tmp_path, "1.2b", ["int3"])
    assert not list(tmp_path.iterdir())


def test_the_table_says_where_vllm_runs_int8_through_another_kernel_than_the_one_timed():
    from ministream.run.kernels import installed_vllm_dir, int8_needs_16_bits

    amx = int8_needs_16_bits(installed_vllm_dir())  # vLLM's AMX int8 kernel, not oneDNN's, runs w8a8 here
    assert bool(kernels.notes(["w8a8"])) == amx and kernels.notes(["bfloat16", "float32"]) == []
    result = {
        "size": "1.2b",
        "machine": {"cpu": "a CPU", "cores": 2, "memory_gib": 24},
        "read_bandwidth": {"gb_per_s": 20.0, "threads": 2},
        "steps": [],
        "rows": [],
        "notes": ["w8a8: planted note"],
    }
    assert "\nw8a8: planted note\n" in kernels.table(result)
