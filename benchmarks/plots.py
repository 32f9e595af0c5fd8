"""Plots of a kernel benchmark run, drawn from its CSV rows (``bench.csv``).

One row of panels per op:

* **speed-up** of liger at the op's reference shape (its target shape, else its largest
  measured one): HF eager's time / liger's and torch.compile's time / liger's, for the
  forward, the backward and forward + backward (bars above 1 are liger faster);
* **peak extra memory** at the same shape, per mode and provider (log scale);
* **time against size** over the op's size sweep, forward + backward, one line per provider,
  with the op's floor (minimum bytes / measured copy bandwidth, or FLOPs / matmul rate) dashed.

``python -m benchmarks`` calls :func:`plot_rows` after a run; to redraw a committed run, or
print the README's results rows from it::

    python -m benchmarks.plots benchmarks/results/nvidia-h100/bench.csv benchmarks/results/nvidia-h100/bench.png
    python -m benchmarks.plots benchmarks/results/nvidia-h100/bench.csv --table H100
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

MODES = ("forward", "backward", "full")
MODE_LABELS = {"forward": "forward", "backward": "backward", "full": "fwd + bwd"}
PROVIDERS = ("liger", "hf_eager", "torch_compile")
PROVIDER_LABELS = {"liger": "liger", "hf_eager": "HF eager", "torch_compile": "torch.compile"}
PROVIDER_COLORS = {"liger": "tab:blue", "hf_eager": "tab:orange", "torch_compile": "tab:green"}
# The x axis of the size sweep, per op (the CSV's ``size`` column).
SIZE_LABELS = {
    "rms_norm": "N*H elements", "layer_norm": "N*H elements", "swiglu": "N*H elements",
    "geglu": "N*H elements", "rope": "q+k elements", "cross_entropy": "N*V logits",
    "fused_linear_cross_entropy": "N*D*V multiply-adds",
}
# Ops whose liger forward already computes the input gradient (the backward only scales it):
# their forward and backward bars compare different work, fwd + bwd is the fair comparison.
GRADIENT_IN_FORWARD = ("cross_entropy", "fused_linear_cross_entropy")
OP_LABELS = {
    "rms_norm": "RMSNorm", "layer_norm": "LayerNorm", "rope": "RoPE", "swiglu": "SwiGLU", "geglu": "GeGLU",
    "cross_entropy": "cross entropy", "fused_linear_cross_entropy": "fused linear CE",
}


def _num(value: object) -> float:
    """A CSV cell (or a float) as a float; empty or unparsable cells are NaN."""
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value))
    except ValueError:
        return math.nan


def read_csv(path: Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def _ok(row: Mapping[str, object]) -> bool:
    return row.get("status") == "ok" and _num(row.get("median_ms")) > 0


def reference_shape(rows: Sequence[Mapping[str, object]]) -> str | None:
    """The op's target shape when it was measured, else the largest shape liger ran."""
    liger = [r for r in rows if r.get("provider") == "liger" and _ok(r)]
    targets = [r for r in liger if str(r.get("is_target_shape")) == "True"]
    pool = targets or liger
    if not pool:
        return None
    return str(max(pool, key=lambda r: (str(r.get("is_target_shape")) == "True", _num(r.get("size"))))["shape"])


def _cell(rows: Iterable[Mapping[str, object]], shape: str, mode: str, provider: str) -> Mapping[str, object] | None:
    for r in rows:
        if r.get("shape") == shape and r.get("mode") == mode and r.get("provider") == provider:
            return r
    return None


def speedups(rows: Sequence[Mapping[str, object]], shape: str) -> dict[tuple[str, str], float]:
    """(mode, baseline provider) -> baseline time / liger time at ``shape``; NaN where either is missing."""
    out = {}
    for mode in MODES:
        liger = _cell(rows, shape, mode, "liger")
        for base in PROVIDERS[1:]:
            other = _cell(rows, shape, mode, base)
            ok = liger is not None and other is not None and _ok(liger) and _ok(other)
            out[mode, base] = _num(other["median_ms"]) / _num(liger["median_ms"]) if ok else math.nan
    return out


def _log_scale(ax, axis: str = "y") -> None:
    """Log scale with plain-number labels (0.1, 1, 10; also 2 and 5 within a span under two decades)."""
    from matplotlib.ticker import FuncFormatter

    getattr(ax, f"set_{axis}scale")("log")
    low, high = getattr(ax, f"get_{axis}lim")()
    narrow = high / max(low, 1e-30) < 100

    def minor(v: float, _pos) -> str:
        mantissa = v / 10 ** math.floor(math.log10(v) + 1e-9)
        return f"{v:g}" if narrow and round(mantissa) in (2, 5) else ""

    target = getattr(ax, f"{axis}axis")
    target.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    target.set_minor_formatter(FuncFormatter(minor))


def _mib_text(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.2g}"


def _bar_labels(ax, bars, values: Sequence[float], fmt) -> None:
    for bar, v in zip(bars, values):
        if not math.isnan(v):
            ax.annotate(fmt(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")


def _speedup_panel(ax, rows, shape: str) -> None:
    values = speedups(rows, shape)
    width = 0.38
    for i, base in enumerate(PROVIDERS[1:]):
        ys = [values[m, base] for m in MODES]
        xs = [k + (i - 0.5) * width for k in range(len(MODES))]
        bars = ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, color=PROVIDER_COLORS[base])
        _bar_labels(ax, bars, ys, lambda v: f"x{v:.2f}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(MODES)), [MODE_LABELS[m] for m in MODES], fontsize=8)
    finite = [v for v in values.values() if not math.isnan(v) and v > 0]
    if finite and max(finite) / min(finite) > 8:
        ax.set_ylim(min(0.5, min(finite) / 2), max(finite) * 4)
        _log_scale(ax)
    elif finite:
        ax.set_ylim(0, max(max(finite), 1.0) * 1.2)
    ax.set_ylabel("baseline time / liger time", fontsize=8)
    if not finite:
        ax.text(0.5, 0.5, "no baseline measured", ha="center", va="center", transform=ax.transAxes)


def _memory_panel(ax, rows, shape: str) -> None:
    width = 0.27
    plotted = False
    for i, provider in enumerate(PROVIDERS):
        ys = []
        for mode in MODES:
            cell = _cell(rows, shape, mode, provider)
            ys.append(_num(cell["peak_extra_mib"]) if cell is not None and _ok(cell) else math.nan)
        if all(math.isnan(y) for y in ys):
            continue
        xs = [k + (i - 1) * width for k in range(len(MODES))]
        bars = ax.bar(xs, [0 if math.isnan(y) else max(y, 1e-3) for y in ys], width, color=PROVIDER_COLORS[provider])
        _bar_labels(ax, bars, ys, _mib_text)
        plotted = True
    ax.set_xticks(range(len(MODES)), [MODE_LABELS[m] for m in MODES], fontsize=8)
    ax.set_ylabel("peak extra memory (MiB)", fontsize=8)
    if plotted:
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 6)
        _log_scale(ax)
    else:
        ax.text(0.5, 0.5, "memory not measured (CPU)", ha="center", va="center", transform=ax.transAxes)


def _sweep_panel(ax, rows, op: str) -> None:
    import matplotlib.ticker
    sizes = {_num(r.get("size")) for r in rows if _ok(r)}
    plotted = False
    for provider in PROVIDERS:
        pts = sorted((_num(r["size"]), _num(r["median_ms"])) for r in rows
                     if r.get("provider") == provider and r.get("mode") == "full" and _ok(r))
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "-o", ms=3, color=PROVIDER_COLORS[provider])
            plotted = True
    floor = sorted({(_num(r["size"]), _num(r.get("floor_ms"))) for r in rows
                    if r.get("provider") == "liger" and r.get("mode") == "full" and _ok(r)})
    floor = [(x, y) for x, y in floor if not math.isnan(y)]
    if floor:
        xs, ys = zip(*floor)
        ax.plot(xs, ys, "--", color="k", lw=1)
    if plotted:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        _log_scale(ax)
        ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel(SIZE_LABELS.get(op, "size"), fontsize=8)
    ax.set_ylabel("fwd + bwd time (ms)", fontsize=8)
    if len(sizes) < 2:
        ax.set_title("time against size: one size measured", fontsize=8)


def plot_rows(rows: Sequence[Mapping[str, object]], path: Path) -> Path | None:
    """Draw ``rows`` (CSV dicts of one run) into ``path``; returns it, or None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(str(r["op"]) for r in rows))
    shapes = {op: reference_shape([r for r in rows if r["op"] == op]) for op in ops}
    ops = [op for op in ops if shapes[op] is not None]
    if not ops:
        return None
    fig, axes = plt.subplots(len(ops), 3, figsize=(15, 3.1 * len(ops) + 1.0), squeeze=False)
    for i, op in enumerate(ops):
        op_rows = [r for r in rows if r["op"] == op]
        name = OP_LABELS.get(op, op)
        _speedup_panel(axes[i][0], op_rows, shapes[op])
        note = "\n(gradient computed in liger's forward: compare fwd + bwd)" if op in GRADIENT_IN_FORWARD else ""
        axes[i][0].set_title(f"{name}, {shapes[op]}: speed-up{note}", fontsize=9)
        _memory_panel(axes[i][1], op_rows, shapes[op])
        axes[i][1].set_title(f"{name}, {shapes[op]}: peak extra memory", fontsize=9)
        _sweep_panel(axes[i][2], op_rows, op)
        if not axes[i][2].get_title():
            axes[i][2].set_title(f"{name}: time against size", fontsize=9)
        for ax in axes[i]:
            ax.tick_params(which="both", labelsize=7)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=PROVIDER_COLORS[p], label=PROVIDER_LABELS[p]) for p in PROVIDERS]
    handles.append(Line2D([], [], color="k", ls="--", label="floor (bytes / copy rate, FLOPs / matmul rate)"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=9,
               bbox_to_anchor=(0.5, 1 - 0.5 / (3.1 * len(ops) + 1.0)), frameon=False)
    first = rows[0]
    fig.suptitle(f"liger kernels against HF eager and torch.compile - {first.get('gpu_name') or first.get('device')}, "
                 f"{first.get('dtype')}, torch {first.get('torch')}, triton {first.get('triton')}, {first.get('date')}",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / (3.1 * len(ops) + 1.0)))
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_table(rows: Sequence[Mapping[str, object]], label: str = "") -> list[str]:
    """Markdown rows, one per op at its reference shape, forward + backward: liger's time, its
    speed-up against HF eager and torch.compile, and the three providers' peak extra memory."""
    lines = []
    for op in dict.fromkeys(str(r["op"]) for r in rows):
        op_rows = [r for r in rows if r["op"] == op]
        shape = reference_shape(op_rows)
        if shape is None:
            continue
        values = speedups(op_rows, shape)
        cells = {p: _cell(op_rows, shape, "full", p) for p in PROVIDERS}
        mib = ["" if c is None or not _ok(c) or math.isnan(_num(c["peak_extra_mib"]))
               else _mib_text(_num(c["peak_extra_mib"])) for c in cells.values()]
        liger = cells["liger"]
        ratio = ["" if math.isnan(values["full", b]) else f"x{values['full', b]:.2f}" for b in PROVIDERS[1:]]
        lines.append(f"| {OP_LABELS.get(op, op)} | {label} | {shape} | {_num(liger['median_ms']):.3g} | "
                     f"{ratio[0]} | {ratio[1]} | {' / '.join(mib)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw a kernel benchmark CSV (bench.csv) as a PNG, or print "
                                                 "its summary table (the README's results table).")
    parser.add_argument("csv", type=Path)
    parser.add_argument("png", type=Path, nargs="?", help="where to draw the plot")
    parser.add_argument("--table", metavar="GPU", help="print the markdown summary rows, labelled GPU")
    args = parser.parse_args(argv)
    if args.png is None and args.table is None:
        parser.error("give a PNG path, --table, or both")
    rows = read_csv(args.csv)
    if args.table is not None:
        print("\n".join(summary_table(rows, args.table)))
    if args.png is not None:
        if plot_rows(rows, args.png) is None:
            print(f"{args.csv}: no measured liger rows, nothing drawn", file=sys.stderr)
            return 1
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
