"""Check a metrics plot as an image: a valid PNG, with one plotted line per metric.

`manualpar plot` (and the recsys example) draw one panel per numeric metric of metrics.jsonl,
stacked vertically, each with one line in matplotlib's first color. The rows of the image that
hold that color form one band per panel that has data, separated by the panels' margins.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LINE_COLOR = (0x1F, 0x77, 0xB4)  # matplotlib's "C0"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header; fails unless the file starts like a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG: starts with {head[:8]!r}"
    length, kind = struct.unpack(">I4s", head[8:16])
    assert (length, kind) == (13, b"IHDR"), f"{path}: first chunk {kind!r} of {length} bytes"
    return struct.unpack(">II", head[16:24])


def metric_names(metrics_jsonl: Path) -> set[str]:
    """The numeric metrics a metrics.jsonl records (every key but "step")."""
    names = set()
    for line in metrics_jsonl.read_text().splitlines():
        for name, value in json.loads(line).items():
            if name != "step" and isinstance(value, (int, float)):
                names.add(name)
    return names


def line_bands(path: Path, color: tuple[int, int, int] = LINE_COLOR, tolerance: int = 40) -> int:
    """How many separate horizontal bands of the image hold pixels of `color`."""
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(path)[..., :3] * 255
    near = (np.abs(pixels - np.array(color)) < tolerance).all(axis=-1)
    rows = near.any(axis=1).astype(np.int8)
    return int((np.diff(np.concatenate([[0], rows])) == 1).sum())


def assert_plots_every_metric(png: Path, metrics_jsonl: Path) -> None:
    """A valid, non-empty PNG with one line-holding band (panel) per metric of the run."""
    width, height = png_size(png)
    assert width > 0 and height > 0, (width, height)
    names = metric_names(metrics_jsonl)
    assert names, f"{metrics_jsonl} records no metric"
    assert line_bands(png) == len(names), (
        f"{png}: {line_bands(png)} plotted bands for {len(names)} metrics {sorted(names)}"
    )
