"""Draw one profiled training step of each process, from the traces --profile writes.

    torchrun --standalone --nproc_per_node=2 ddp_basic.py --model resnet18 --profile --out-dir runs/timeline
    python tools/draw_timeline.py runs/timeline/profile_rank*.json --out docs/diffs/ddp-timeline.png

Two rows a process on one time axis (milliseconds from the start of that process's step): its
training thread (loading the batch, forward, backward, the optimizer step) and its collectives
(each bucket's all-reduce; on a CPU gloo's threads run them, on a GPU nccl's kernels). Where a red
bar lies under the orange one, the all-reduce hides behind backward: DDP's overlap, measured.
Pillow only (torchvision brings it).
"""
import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

# (label, colour, whether an event of the training thread belongs to it)
PHASES = [("batch", "#b7b7b7", lambda name: name.startswith("enumerate(DataLoader)")),
          ("forward", "#6fa8dc", lambda name: name.endswith(".forward") or name.startswith("## forward")),
          ("backward", "#f6b26b", lambda name: name.startswith("autograd::engine::evaluate_function")),
          ("optimizer step", "#93c47d", lambda name: name.startswith("Optimizer.step#"))]
COLLECTIVE = "#cc0000"
LEFT, RIGHT, ROW, GAP, TOP = 150, 30, 26, 18, 40


def step_of(path, step):
    """The events of one ProfilerStep of a trace, times in ms from its start: (phase bars, collective bars)."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    chosen = steps[min(step, len(steps) - 1)]
    start, end = chosen["ts"], chosen["ts"] + chosen["dur"]
    gpu = any(e.get("cat") == "kernel" for e in events)

    def inside(e):
        return start <= e["ts"] < end

    def bar(e):
        return (e["ts"] - start) / 1e3, min(e["ts"] + e["dur"], end) / 1e3 - start / 1e3

    phases = [(label, color, bar(e)) for e in events if inside(e) and e["tid"] == chosen["tid"]
              for label, color, belongs in PHASES if belongs(e["name"])]
    collectives = [(e["name"].split(":")[-1].split("_Sum")[0], bar(e)) for e in events if inside(e) and (
        "nccl" in e["name"].lower() and e.get("cat") == "kernel" if gpu else e["name"].startswith("gloo:"))]
    return chosen["dur"] / 1e3, phases, collectives


def draw(traces, out, title, step=1, width=1200):
    steps = [step_of(path, step) for path in traces]
    names = [Path(path).stem.replace("profile_", "").replace("rank", "rank ") for path in traces]
    span = max(duration for duration, _, _ in steps)
    height = TOP + len(steps) * (2 * ROW + GAP) + 60
    image = Image.new("RGB", (width, height), "white")
    pen, font = ImageDraw.Draw(image), ImageFont.load_default()

    def x(ms):
        return LEFT + (width - LEFT - RIGHT) * ms / span

    pen.text((10, 10), title, fill="black", font=font)
    for number, (duration, phases, collectives) in enumerate(steps):
        y = TOP + number * (2 * ROW + GAP)
        pen.text((10, y + 6), f"{names[number]}: training", fill="black", font=font)
        pen.text((10, y + ROW + 6), f"{names[number]}: collectives", fill="black", font=font)
        for _, color, (start, end) in phases:
            pen.rectangle([x(start), y + 2, max(x(end), x(start) + 1), y + ROW - 2], fill=color)
        for name, (start, end) in collectives:
            pen.rectangle([x(start), y + ROW + 2, max(x(end), x(start) + 1), y + 2 * ROW - 2], fill=COLLECTIVE,
                          outline="white")
            if x(end) - x(start) > 6 * len(name):
                pen.text((x(start) + 3, y + ROW + 7), name, fill="white", font=font)
        pen.line([x(duration), y, x(duration), y + 2 * ROW], fill="black")  # this process's step ends
    axis = TOP + len(steps) * (2 * ROW + GAP)
    pen.line([x(0), axis, x(span), axis], fill="black")
    tick = next(t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if span / t <= 12)
    for ms in range(0, int(span) + 1, tick):
        pen.line([x(ms), axis, x(ms), axis + 4], fill="black")
        pen.text((x(ms) - 8, axis + 6), f"{ms}", fill="black", font=font)
    pen.text((x(span) - 20, axis + 20), "ms", fill="black", font=font)
    legend = [(label, color) for label, color, _ in PHASES] + [("collective", COLLECTIVE)]
    for number, (label, color) in enumerate(legend):
        left = LEFT + number * 140
        pen.rectangle([left, axis + 36, left + 14, axis + 50], fill=color)
        pen.text((left + 20, axis + 38), label, fill="black", font=font)
    image.save(out)
    return image


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="profile_rank<N>.json files, rank 0 first")
    parser.add_argument("--out", default="timeline.png", help="the PNG to write (default: timeline.png)")
    parser.add_argument("--step", type=int, default=1, help="which profiled step, from 0 (default: 1)")
    parser.add_argument("--title", default="One training step of each process, from --profile's traces",
                        help="the line above the picture")
    args = parser.parse_args(argv)
    draw(args.traces, args.out, args.title, args.step)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
