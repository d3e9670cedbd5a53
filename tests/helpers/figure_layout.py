"""What a reader sees of a matplotlib figure, measured from matplotlib's own bounding boxes.

`layout_problems(fig)` draws the figure once with its own renderer, records every text matplotlib actually
draws (tick labels outside the view are not drawn, and are not counted) and returns the defects a reader
would meet, one `LayoutProblem` each:

- `tick-overlap`: two tick labels of one axis overlap (their rotated boxes, not the axis-aligned hulls);
- `text-overlap`: two other drawn texts overlap (a colour-bar label over a title, a label over a label);
- `clipped`: a text reaches past the figure's edge, or past the clip box it is drawn in;
- `legend-over-data`: a legend's box covers a plotted point, line, bar, error bar or image of any panel;
- `text-over-data`: a text placed in a panel (a note, an annotation) covers its plotted data;
- `empty-panel`: a panel with axes and no visible finite data inside its view (a panel switched off with
  `ax.axis("off")` counts as a note and must carry a text instead);
- `blank-image`: an image whose colours are all but one (fewer than BLANK_SHARE of its cells differ from
  the typical colour by BLANK_STEP of the colour scale);
- `too-wide`: the figure is wider than `max_width_px` (the page would shrink its text).

It lives with the tests: the library lays its figures out by rules (styles, locators, sizes) and this
module checks the result on real data; nothing in the library needs to measure a drawn figure.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from matplotlib import cbook
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import Collection, PathCollection
from matplotlib.image import AxesImage
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.path import Path as MplPath
from matplotlib.text import Text
from matplotlib.transforms import Bbox

OVERLAP_PX = 1.0  # boxes are shrunk by this much on every side before two of them may overlap
EDGE_PX = 0.5  # a text may touch the figure's edge by this much
LEGEND_MARGIN_PX = 2.0  # a legend's box is shrunk by this much before data inside it counts as covered
BLANK_STEP = 0.02  # a cell differs visibly from the typical colour by this share of the colour scale
BLANK_SHARE = 0.05  # an image with fewer cells than this share differing visibly is blank


@dataclass(frozen=True)
class LayoutProblem:
    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} in {self.where}: {self.detail}"


def is_colorbar(ax: Axes) -> bool:
    return ax.get_label() == "<colorbar>"


def describe(ax: Axes, fig) -> str:
    """A panel by its title (or its place in the figure)."""
    title = ax.get_title() or ax.get_title("left") or ax.get_ylabel() or ax.get_xlabel()
    kind = "colour bar" if is_colorbar(ax) else "panel"
    return f"{kind} {fig.axes.index(ax)} {title[:50]!r}" if title else f"{kind} {fig.axes.index(ax)}"


@contextmanager
def recording_texts() -> Iterator[list[Text]]:
    """Every Text drawn while the block runs, in drawing order (the texts a reader sees)."""
    drawn: list[Text] = []
    draw = Text.draw

    def record(self, renderer):
        if self.get_visible() and self.get_text().strip():
            drawn.append(self)
        return draw(self, renderer)

    Text.draw = record
    try:
        yield drawn
    finally:
        Text.draw = draw


def text_extent(text: Text, renderer) -> Bbox:
    """The text's axis-aligned box in display pixels, wrapped as it is drawn."""
    if text.get_wrap():
        with text._cm_set(text=text._get_wrapped_text()):
            return text.get_window_extent(renderer)
    return text.get_window_extent(renderer)


def text_polygon(text: Text, renderer, shrink: float = 0.0) -> np.ndarray:
    """The four corners (display pixels) of the text's rotated box, each side pulled in by `shrink`.

    The axis-aligned box of a rotated rectangle is centred on it, so the centre comes from the drawn
    extent and the sides from the same text unrotated."""
    box = text_extent(text, renderer)
    angle = text.get_rotation()
    if angle % 180 == 0:
        w, h = box.width, box.height
    else:
        with text._cm_set(rotation=0):
            flat = text_extent(text, renderer)
        w, h = flat.width, flat.height
    w, h = max(w - 2 * shrink, 0.0), max(h - 2 * shrink, 0.0)
    cx, cy = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2
    c, s = np.cos(np.radians(angle)), np.sin(np.radians(angle))
    corners = np.array([[-w / 2, -h / 2], [w / 2, -h / 2], [w / 2, h / 2], [-w / 2, h / 2]])
    return corners @ np.array([[c, s], [-s, c]]) + [cx, cy]


def _polygons_overlap(a: np.ndarray, b: np.ndarray) -> bool:
    if (a[:, 0].max() <= b[:, 0].min() or b[:, 0].max() <= a[:, 0].min()
            or a[:, 1].max() <= b[:, 1].min() or b[:, 1].max() <= a[:, 1].min()):
        return False
    pa, pb = MplPath(np.vstack([a, a[:1]]), closed=True), MplPath(np.vstack([b, b[:1]]), closed=True)
    return bool(pa.intersects_path(pb, filled=True))


def _tick_owner(text: Text, fig) -> str | None:
    """'<panel> x' / '<panel> y' when the text is a tick label of that axis (major or minor), else None."""
    for ax in fig.axes:
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            for tick in itertools.chain(axis.majorTicks, axis.minorTicks):
                if text is tick.label1 or text is tick.label2:
                    return f"{describe(ax, fig)} {name} axis"
    return None


def _short(text: Text) -> str:
    s = " ".join(text.get_text().split())
    return repr(s if len(s) <= 40 else s[:37] + "...")


def _text_problems(fig, renderer, texts: list[Text]) -> list[LayoutProblem]:
    problems = []
    owners = [_tick_owner(t, fig) for t in texts]
    shapes = [text_polygon(t, renderer, OVERLAP_PX) for t in texts]
    for i, j in itertools.combinations(range(len(texts)), 2):
        if texts[i] is texts[j] or not _polygons_overlap(shapes[i], shapes[j]):
            continue
        if owners[i] is not None and owners[i] == owners[j]:
            problems.append(LayoutProblem("tick-overlap", owners[i],
                                          f"tick labels {_short(texts[i])} and {_short(texts[j])} overlap"))
        else:
            problems.append(LayoutProblem("text-overlap", owners[i] or owners[j] or "the figure",
                                          f"{_short(texts[i])} overlaps {_short(texts[j])}"))
    edge = fig.bbox
    for t in texts:
        corners = text_polygon(t, renderer)
        if (corners[:, 0].min() < edge.x0 - EDGE_PX or corners[:, 0].max() > edge.x1 + EDGE_PX
                or corners[:, 1].min() < edge.y0 - EDGE_PX or corners[:, 1].max() > edge.y1 + EDGE_PX):
            problems.append(LayoutProblem("clipped", "the figure's edge", f"{_short(t)} reaches past the edge"))
            continue
        clip = _clip_box(t)
        if clip is not None and (corners[:, 0].min() < clip.x0 - EDGE_PX or corners[:, 0].max() > clip.x1 + EDGE_PX
                                 or corners[:, 1].min() < clip.y0 - EDGE_PX
                                 or corners[:, 1].max() > clip.y1 + EDGE_PX):
            problems.append(LayoutProblem("clipped", "its clip box", f"{_short(t)} is cut by the box it is drawn in"))
    return problems


def _clip_box(artist) -> Bbox | None:
    if not artist.get_clip_on():
        return None
    boxes = []
    if artist.get_clip_box() is not None:
        boxes.append(artist.get_clip_box())
    path = artist.get_clip_path()
    if path is not None:
        boxes.append(path.get_fully_transformed_path().get_extents())
    return Bbox.intersection(*boxes) if len(boxes) == 2 else (boxes[0] if boxes else None)


# --- the data a panel shows, in display pixels ----------------------------------------------------------------


def _is_data(artist, ax: Axes) -> bool:
    """A visible artist placed in data coordinates (not a reference line across the axes like axhline)."""
    if not artist.get_visible() or (artist.get_alpha() is not None and artist.get_alpha() == 0):
        return False
    if isinstance(artist, PathCollection):  # markers placed at offsets (scatter)
        transform = artist.get_offset_transform()
    else:
        transform = artist.get_transform()
    return transform.contains_branch(ax.transData)


def _finite_rows(xy: np.ndarray) -> np.ndarray:
    xy = np.asarray(xy, dtype=float).reshape(-1, 2)
    return xy[np.isfinite(xy).all(axis=1)]


def _line_pieces(line: Line2D) -> tuple[list[np.ndarray], np.ndarray]:
    """(polylines drawn, marker positions) of a Line2D in display pixels; NaN breaks a polyline."""
    x, y = (np.asarray(a, dtype=float) for a in line.get_data(orig=False))
    xy = np.column_stack([x, y]) if x.size else np.zeros((0, 2))
    pts = line.get_transform().transform(xy) if len(xy) else xy
    markers = _finite_rows(pts) if line.get_marker() not in (None, "None", "", " ") else np.zeros((0, 2))
    if line.get_linestyle() in ("None", "", " ") or len(xy) < 2:
        return [], markers
    if line.get_drawstyle() in cbook.STEP_LOOKUP_MAP and line.get_drawstyle() != "default":
        sx, sy = cbook.STEP_LOOKUP_MAP[line.get_drawstyle()](x, y)
        pts = line.get_transform().transform(np.column_stack([sx, sy]))
    ok = np.isfinite(pts).all(axis=1)
    pieces, start = [], None
    for i, good in enumerate(np.append(ok, False)):
        if good and start is None:
            start = i
        elif not good and start is not None:
            pieces.append(pts[start:i])
            start = None
    return pieces, markers


def _collection_shapes(coll: Collection) -> tuple[list[np.ndarray], np.ndarray]:
    """(paths as display polylines, point positions) of a collection."""
    if isinstance(coll, PathCollection):
        pts = coll.get_offset_transform().transform(np.asarray(coll.get_offsets(), dtype=float))
        return [], _finite_rows(pts)
    transform = coll.get_transform()
    paths = [transform.transform(np.asarray(p.vertices, dtype=float)) for p in coll.get_paths() if len(p.vertices)]
    return [_finite_rows(p) for p in paths if len(_finite_rows(p))], np.zeros((0, 2))


def _patch_box(patch: Patch, renderer) -> Bbox | None:
    box = patch.get_window_extent(renderer)
    if not np.isfinite([box.x0, box.y0, box.x1, box.y1]).all():
        return None
    return box


def _image_box(image: AxesImage, renderer) -> Bbox | None:
    values = np.ma.masked_invalid(np.ma.asarray(image.get_array(), dtype=float))
    if values.count() == 0:
        return None
    return image.get_window_extent(renderer)


def _hits_box(box: Bbox, polylines, points, boxes, marker_px: float = 0.0) -> bool:
    grown = Bbox.from_extents(box.x0 - marker_px, box.y0 - marker_px, box.x1 + marker_px, box.y1 + marker_px)
    if len(points) and ((points[:, 0] >= grown.x0) & (points[:, 0] <= grown.x1) & (points[:, 1] >= grown.y0)
                        & (points[:, 1] <= grown.y1)).any():
        return True
    for poly in polylines:
        if len(poly) == 1:
            if box.contains(*poly[0]):
                return True
        elif MplPath(poly).intersects_bbox(box, filled=False):
            return True
    for b in boxes:
        inter = Bbox.intersection(b, box)
        if inter is not None and inter.width > 0 and inter.height > 0:
            return True
    return False


def _data_shapes(ax: Axes, renderer):
    """(polylines, points, boxes, largest marker in px) of every visible data artist of the panel."""
    polylines, points, boxes, marker = [], [], [], 0.0
    for line in ax.lines:
        if _is_data(line, ax):
            pieces, markers = _line_pieces(line)
            polylines += pieces
            points.append(markers)
            if len(markers):
                marker = max(marker, line.get_markersize() * fig_dpi(ax) / 72 / 2)
    for coll in ax.collections:
        if _is_data(coll, ax):
            pieces, pts = _collection_shapes(coll)
            polylines += pieces
            points.append(pts)
            if len(pts) and isinstance(coll, PathCollection) and len(coll.get_sizes()):
                marker = max(marker, float(np.sqrt(np.max(coll.get_sizes()))) * fig_dpi(ax) / 72 / 2)
    for patch in ax.patches:
        if _is_data(patch, ax):
            box = _patch_box(patch, renderer)
            if box is not None and box.width > 0 and box.height > 0:
                boxes.append(box)
    for image in ax.images:
        if image.get_visible():
            box = _image_box(image, renderer)
            if box is not None:
                boxes.append(box)
    pts = np.vstack([p for p in points if len(p)]) if any(len(p) for p in points) else np.zeros((0, 2))
    return polylines, pts, boxes, marker


def fig_dpi(ax: Axes) -> float:
    return ax.figure.dpi


def _legends(fig) -> list:
    legends = list(fig.legends)
    for ax in fig.axes:
        if ax.get_legend() is not None and ax.get_legend().get_visible():
            legends.append(ax.get_legend())
    return legends


def _legend_problems(fig, renderer) -> list[LayoutProblem]:
    problems = []
    panels = [ax for ax in fig.axes if ax.get_visible() and not is_colorbar(ax)]
    for legend in _legends(fig):
        box = legend.get_window_extent(renderer)
        inner = Bbox.from_extents(box.x0 + LEGEND_MARGIN_PX, box.y0 + LEGEND_MARGIN_PX, box.x1 - LEGEND_MARGIN_PX,
                                  box.y1 - LEGEND_MARGIN_PX)
        for ax in panels:
            polylines, points, boxes, marker = _data_shapes(ax, renderer)
            clip = ax.bbox  # data is drawn only inside its panel
            inside = Bbox.intersection(inner, clip)
            if inside is None or inside.width <= 0 or inside.height <= 0:
                continue
            if _hits_box(inside, polylines, points, boxes, marker):
                owner = legend.axes if legend.axes is not None else None
                where = describe(owner, fig) if owner is not None else "the figure's legend"
                problems.append(LayoutProblem("legend-over-data", where,
                                              f"the legend covers data of {describe(ax, fig)}"))
    return problems


def _panel_text_problems(fig, renderer, texts: list[Text]) -> list[LayoutProblem]:
    """Texts placed in a panel (notes, annotations) that cover its data."""
    problems = []
    panels = [ax for ax in fig.axes if ax.get_visible() and not is_colorbar(ax)]
    in_panels = {id(t) for ax in panels for t in ax.texts}
    for t in texts:
        if id(t) not in in_panels:
            continue
        box = text_extent(t, renderer)
        inner = Bbox.from_extents(box.x0 + OVERLAP_PX, box.y0 + OVERLAP_PX, box.x1 - OVERLAP_PX, box.y1 - OVERLAP_PX)
        for ax in panels:
            inside = Bbox.intersection(inner, ax.bbox)
            if inside is None or inside.width <= 0 or inside.height <= 0:
                continue
            polylines, points, boxes, marker = _data_shapes(ax, renderer)
            if _hits_box(inside, polylines, points, boxes, marker):
                problems.append(LayoutProblem("text-over-data", describe(ax, fig), f"{_short(t)} covers its data"))
    return problems


def _empty_problems(fig, renderer, texts: list[Text]) -> list[LayoutProblem]:
    problems = []
    for ax in fig.axes:
        if not ax.get_visible() or is_colorbar(ax):
            continue
        if not ax.axison:
            box = ax.bbox
            if not any(box.overlaps(text_extent(t, renderer)) for t in texts):
                problems.append(LayoutProblem("empty-panel", describe(ax, fig), "a panel switched off with no note"))
            continue
        if any(ax.bbox.overlaps(other.bbox) and _has_data(other, renderer) for other in fig.axes
               if other is not ax and not is_colorbar(other) and other.get_visible() and _shares_place(ax, other)):
            continue  # a twin's data is drawn in this panel
        if not _has_data(ax, renderer):
            problems.append(LayoutProblem("empty-panel", describe(ax, fig), "no visible finite data in its view"))
    return problems


def _shares_place(a: Axes, b: Axes) -> bool:
    return np.allclose(a.get_position().bounds, b.get_position().bounds)


def _has_data(ax: Axes, renderer) -> bool:
    polylines, points, boxes, _ = _data_shapes(ax, renderer)
    return _hits_box(ax.bbox, polylines, points, boxes)


def _blank_problems(fig) -> list[LayoutProblem]:
    problems = []
    for ax in fig.axes:
        if is_colorbar(ax):
            continue
        for image in ax.images:
            values = np.ma.masked_invalid(np.ma.asarray(image.get_array(), dtype=float))
            if values.count() < 2:
                continue
            shade = np.ma.asarray(image.norm(values)).compressed()
            shade = np.clip(shade[np.isfinite(shade)], 0, 1)
            differ = np.abs(shade - np.median(shade)) > BLANK_STEP
            if differ.mean() < BLANK_SHARE:
                problems.append(LayoutProblem(
                    "blank-image", describe(ax, fig),
                    f"only {differ.mean():.1%} of its {shade.size} cells differ visibly from the typical colour"))
    return problems


def layout_problems(fig, *, max_width_px: float | None = None) -> list[LayoutProblem]:
    """Every defect a reader would meet in `fig`, as drawn by its own canvas (see the module's docstring)."""
    if not hasattr(fig.canvas, "get_renderer"):  # a figure pyplot has closed keeps a bare canvas
        FigureCanvasAgg(fig)
    with recording_texts() as texts:
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    unique = list({id(t): t for t in texts}.values())
    problems = _text_problems(fig, renderer, unique)
    problems += _legend_problems(fig, renderer)
    problems += _panel_text_problems(fig, renderer, unique)
    problems += _empty_problems(fig, renderer, unique)
    problems += _blank_problems(fig)
    if max_width_px is not None and fig.bbox.width > max_width_px + 0.5:
        problems.append(LayoutProblem("too-wide", "the figure",
                                      f"{fig.bbox.width:.0f} px wide, more than the {max_width_px:.0f} px shown"))
    return problems
