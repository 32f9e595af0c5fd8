"""``benchmarks.plots`` draws a benchmark CSV on CPU: the speed-ups it plots are the CSV's time
ratios at the op's target shape, and the committed canonical runs redraw from their CSVs."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from benchmarks import harness, plots

REPO = Path(__file__).resolve().parents[2]
# (mode, provider) -> median ms at the target shape; the sweep shape is 4x smaller and 3x faster.
TIMES = {("forward", "liger"): 1.0, ("forward", "hf_eager"): 4.0, ("forward", "torch_compile"): 1.5,
         ("backward", "liger"): 2.0, ("backward", "hf_eager"): 5.0, ("backward", "torch_compile"): 3.0,
         ("full", "liger"): 3.0, ("full", "hf_eager"): 9.0, ("full", "torch_compile"): 4.5}


def _write_csv(path: Path, ops=("rms_norm", "cross_entropy")) -> None:
    columns = harness.csv_columns()
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for op in ops:
            for (mode, provider), ms in TIMES.items():
                for target, scale, shape in ((True, 1.0, "N=64 H=96"), (False, 1 / 3, "N=16 H=96")):
                    if provider == "torch_compile" and not target:
                        continue  # compile runs at the target shape only, as in a real run
                    row = dict.fromkeys(columns, "")
                    row.update(op=op, mode=mode, provider=provider, shape=shape, dtype="bfloat16",
                               is_target_shape=str(target), status="ok", median_ms=f"{ms * scale:.6g}",
                               peak_extra_mib="" if provider == "liger" and mode == "backward" else "12.5",
                               floor_ms=f"{0.5 * scale:.6g}", size=str(64 * 96 if target else 16 * 96),
                               gpu_name="test GPU", torch="2.x", triton="3.x", date="today")
                    writer.writerow(row)
        # an op whose liger rows all failed has nothing to draw and is left out
        row = dict.fromkeys(columns, "")
        row.update(op="rope", mode="full", provider="liger", shape="B=1", status="error: boom")
        writer.writerow(row)


def test_speedups_are_time_ratios_at_the_target_shape(tmp_path):
    path = tmp_path / "bench.csv"
    _write_csv(path)
    rows = [r for r in plots.read_csv(path) if r["op"] == "rms_norm"]
    shape = plots.reference_shape(rows)
    assert shape == "N=64 H=96"
    values = plots.speedups(rows, shape)
    for mode in plots.MODES:
        for base in ("hf_eager", "torch_compile"):
            assert values[mode, base] == pytest.approx(TIMES[mode, base] / TIMES[mode, "liger"])
    # without the target shape the largest measured shape is the reference; compile is missing there
    sweep = [r for r in rows if r["is_target_shape"] == "False"]
    assert plots.reference_shape(sweep) == "N=16 H=96"
    assert math.isnan(plots.speedups(sweep, "N=16 H=96")["full", "torch_compile"])
    assert plots.reference_shape([r for r in plots.read_csv(path) if r["op"] == "rope"]) is None


def test_cli_draws_a_png(tmp_path, capsys):
    path = tmp_path / "bench.csv"
    _write_csv(path)
    png = tmp_path / "bench.png"
    assert plots.main([str(path), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "plot:" in capsys.readouterr().out
    empty = tmp_path / "empty.csv"
    _write_csv(empty, ops=())
    assert plots.main([str(empty), str(tmp_path / "empty.png")]) == 1
    assert not (tmp_path / "empty.png").exists()


def test_table_rows_carry_the_full_mode_ratios(tmp_path, capsys):
    path = tmp_path / "bench.csv"
    _write_csv(path)
    assert plots.main([str(path), "--table", "GPU-X"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2  # rms_norm and cross_entropy; rope has no measured liger row
    assert lines[0].startswith("| RMSNorm | GPU-X | N=64 H=96 | 3 | x3.00 | x1.50 | ")
    assert lines[0].endswith("| 12 / 12 / 12 |")


@pytest.mark.parametrize("kind", ["nvidia-h100", "nvidia-h200"])
def test_committed_runs_have_every_op_and_redraw(kind, tmp_path):
    folder = REPO / "benchmarks" / "results" / kind
    rows = plots.read_csv(folder / "bench.csv")
    kernels = {"rms_norm", "layer_norm", "rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy"}
    assert kernels <= {r["op"] for r in rows}
    for op in kernels:
        op_rows = [r for r in rows if r["op"] == op]
        values = plots.speedups(op_rows, plots.reference_shape(op_rows))
        assert not math.isnan(values["full", "hf_eager"]) and not math.isnan(values["full", "torch_compile"])
    for name in ("bench.png", "e2e.csv", "e2e.png", "env.txt"):
        assert (folder / name).exists(), name
    assert plots.plot_rows(rows, tmp_path / "bench.png") is not None
