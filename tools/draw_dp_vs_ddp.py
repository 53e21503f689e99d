"""Draw docs/diffs/dp-vs-ddp.png, the picture on the 2 -> 3 page: why DDP beats nn.DataParallel.

    pip install matplotlib && python tools/draw_dp_vs_ddp.py

Left, DataParallel: one process drives every GPU from threads (one GIL); each forward copies the
model from GPU 0 to the others and scatters the batch, the outputs are gathered on GPU 0 for the
loss, and backward reduces the gradients there, one phase after another. Right, DDP: a process per
GPU with its own shard and its own copy of the model, and an all-reduce of the gradients in buckets,
each started as soon as backward has filled it, so communication overlaps the rest of backward.
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "diffs" / "dp-vs-ddp.png"
GPU0, GPU, PROC, COMM = "#f4b183", "#c9daf8", "#d9ead3", "#e06666"


def box(ax, x, y, w, h, text, color, size=9, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.3", fc=color, ec="#444", lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def arrow(ax, start, end, color="#444", style="-|>", rad=0.0, lw=1.3):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}"))


def timeline(ax, y, phases, label):
    """One training step as bars on a time axis: (start, length, text, colour, row offset)."""
    ax.text(2, y + 1.6, label, fontsize=9, weight="bold")
    for start, length, text, color, row in phases:
        ax.add_patch(FancyBboxPatch((start, y - row * 3.2 - 2), length, 2.4, boxstyle="square,pad=0", fc=color,
                                    ec="#444", lw=0.8))
        ax.text(start + length / 2, y - row * 3.2 - 0.8, text, ha="center", va="center", fontsize=7.5)


def data_parallel(ax):
    ax.text(25, 58, "nn.DataParallel: one process, a thread per GPU", ha="center", fontsize=11, weight="bold")
    box(ax, 3, 31, 44, 24, "", "#fafafa")
    ax.text(25, 53, "one Python process: its threads take turns holding the GIL", ha="center", fontsize=8.5,
            style="italic")
    box(ax, 16, 43, 18, 6, "GPU 0: the batch, the loss,\nthe gradients, the step", GPU0, size=8.5)
    for k, x in enumerate((6, 20, 34)):
        box(ax, x, 33, 9, 4.5, f"GPU {k + 1}", GPU, size=8.5)
        arrow(ax, (22 + 3 * k, 42.5), (x + 3, 38.2))
        arrow(ax, (x + 6.5, 38.2), (23.5 + 3 * k, 42.5), color=COMM)
    ax.text(25, 28.5, "black: every forward copies the model and scatters the batch from GPU 0\n"
            "red: outputs gathered on GPU 0 for the loss; gradients reduced onto GPU 0", ha="center",
            fontsize=8)
    timeline(ax, 20, [(2, 6, "copy\nmodel", GPU0, 0), (8, 5, "scatter", GPU0, 0), (13, 10, "forward", GPU, 0),
                      (23, 5, "gather", COMM, 0), (28, 10, "backward", GPU, 0), (38, 6, "reduce", COMM, 0),
                      (44, 4, "step", GPU0, 0)], "one step (not to scale): each phase waits for the one before")


def distributed(ax):
    ax.text(75, 58, "DDP: a process per GPU", ha="center", fontsize=11, weight="bold")
    places = [(55, 44), (81, 44), (81, 32), (55, 32)]
    for k, (x, y) in enumerate(places):
        box(ax, x, y, 14, 7.5, f"process {k} on GPU {k}\nits own shard, loader\nand copy of the model", PROC,
            size=8)
    for (x1, y1), (x2, y2) in zip(places, places[1:] + places[:1]):
        start = (x1 + 7 + (x2 - x1) * 0.45, y1 + 3.75 + (y2 - y1) * 0.45)
        end = (x1 + 7 + (x2 - x1) * 0.55, y1 + 3.75 + (y2 - y1) * 0.55)
        if x1 == x2:
            start, end = (x1 + 7, y1 - 0.5 if y2 < y1 else y1 + 8), (x2 + 7, y2 + 8 if y2 < y1 else y2 - 0.5)
        else:
            start, end = (x1 + 14.5 if x2 > x1 else x1 - 0.5, y1 + 3.75), (x2 - 0.5 if x2 > x1 else x2 + 14.5, y2 + 3.75)
        arrow(ax, start, end, color=COMM, lw=1.6)
    ax.text(75, 40, "all-reduce\nthe gradients", ha="center", va="center", fontsize=8.5, color=COMM)
    ax.text(75, 28.5, "no copy of the model, no scatter, no gather: only gradients move,\n"
            "and every process steps its own copy to the same weights", ha="center", fontsize=8)
    timeline(ax, 20, [(52, 10, "forward", GPU, 0), (62, 10, "backward", GPU, 0), (64.5, 3, "bucket", COMM, 1),
                      (68, 3, "bucket", COMM, 1), (71.5, 3, "bucket", COMM, 1), (75, 4, "step", PROC, 0)], "")
    ax.text(52, 21.6, "one step: each bucket is all-reduced while backward goes on", fontsize=9, weight="bold")


def main():
    fig, ax = plt.subplots(figsize=(12, 6.2))
    ax.set(xlim=(0, 100), ylim=(13, 60))
    ax.axis("off")
    data_parallel(ax)
    distributed(ax)
    ax.plot([50, 50], [14, 59], color="#bbb", lw=1)
    fig.tight_layout()
    fig.savefig(OUT, dpi=100)
    print(f"wrote {OUT.relative_to(OUT.parent.parent.parent)}")


if __name__ == "__main__":
    main()
