"""tools/draw_timeline.py draws a step of each process from --profile's traces: each phase of the
training thread and each collective where the trace puts it, on one axis from the step's start.
The picture on the 2 -> 3 page is its output (docs/diffs/ddp-timeline.png, test_guided_pages.py)."""
import importlib.util
import json

from PIL import Image

from conftest import ROOT

spec = importlib.util.spec_from_file_location("draw_timeline", ROOT / "tools" / "draw_timeline.py")
draw_timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draw_timeline)

FORWARD, BACKWARD, OPTIMIZER = (color for _, color, _ in draw_timeline.PHASES[1:])


def event(name, start_ms, end_ms, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3}


def trace(path, offset, allreduce):
    """Two profiled steps of 100 ms; the second one's phases (ms): forward 0-30, backward 30-80,
    an all-reduce at `allreduce`, the optimizer 85-95."""
    events = [event("ProfilerStep#3", offset - 100, offset, cat="user_annotation"),
              event("ProfilerStep#4", offset, offset + 100, cat="user_annotation"),
              event("DistributedDataParallel.forward", offset, offset + 30, cat="user_annotation"),
              event("autograd::engine::evaluate_function: ConvolutionBackward0", offset + 30, offset + 80),
              event("gloo:all_reduce", offset + allreduce[0], offset + allreduce[1], tid=2, cat="user_annotation"),
              event("Optimizer.step#SGD.step", offset + 85, offset + 95, cat="user_annotation")]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def hex_color(pixel):
    return "#" + "".join(f"{value:02x}" for value in pixel)


def test_each_phase_and_collective_is_drawn_where_the_trace_puts_it(tmp_path):
    # The processes' clocks differ: each is drawn from its own step's start.
    traces = [trace(tmp_path / "profile_rank0.json", 1000, (40, 60)),
              trace(tmp_path / "profile_rank1.json", 5000, (70, 90))]
    image = draw_timeline.draw(traces, tmp_path / "t.png", "test")
    assert Image.open(tmp_path / "t.png").size == image.size
    width, row, gap, top = image.size[0], draw_timeline.ROW, draw_timeline.GAP, draw_timeline.TOP

    def color_at(ms, y):
        return hex_color(image.getpixel((draw_timeline.LEFT + (width - draw_timeline.LEFT - draw_timeline.RIGHT)
                                         * ms / 100, y)))

    for rank, (start, end) in enumerate([(40, 60), (70, 90)]):
        training, collectives = top + rank * (2 * row + gap) + row // 2, top + rank * (2 * row + gap) + row + row // 2
        assert [color_at(ms, training) for ms in (15, 55, 90)] == [FORWARD, BACKWARD, OPTIMIZER]
        assert color_at(97, training) == "#ffffff"  # after the optimizer step: nothing
        assert color_at((start + end) / 2 + 2, collectives) == draw_timeline.COLLECTIVE
        assert color_at(start - 3, collectives) == color_at(end + 3, collectives) == "#ffffff"
