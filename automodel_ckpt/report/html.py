"""The page's markup: an element builder that escapes every text and attribute, inline SVG charts, the page shell.

Only what ``el`` made (``Markup``) passes unescaped; tag and attribute names are its callers' constants. The page
loads nothing (no script, link or image source) and its Content-Security-Policy forbids them all.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any, Iterable

TEXT_LIMIT = 400  # characters of one string from a run folder shown (a key, a name, a value)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
MARKS = {"checkpoint": "#888", "quarantined": "#d62728", "deleted": "#e0a800", "stage": "#6a3d9a"}
_CSS = """body{font:14px system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #ccc;margin-top:1.6em}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}
pre{background:#f6f6f6;padding:.6em;white-space:pre-wrap;font-size:12px}.none{color:#777;font-style:italic}
.key span{display:inline-block;margin-right:1em}.key i{display:inline-block;width:.9em;height:.9em;margin-right:.3em}
svg{background:#fff;border:1px solid #eee;width:100%;height:auto}figure{margin:1em 0}"""
_CSP = "default-src 'none'; style-src 'unsafe-inline'"


class Markup(str):
    """Markup that ``el`` made: its texts already escaped."""


def text(value: Any) -> str:
    """``value`` as at most ``TEXT_LIMIT`` characters of plain text, control characters written as ``\\xNN``."""
    s = "-" if value is None else value if isinstance(value, str) else str(value)
    s = s if len(s) <= TEXT_LIMIT else s[:TEXT_LIMIT] + "…"
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], s)


def el(tag: str, *children: Any, **attrs: Any) -> Markup:
    """``<tag attrs>children</tag>``: each child that is not ``Markup`` and each attribute value escaped
    (``class_`` is ``class``, ``stroke_width`` is ``stroke-width``; None leaves an attribute or child out). A value
    from a run folder is cut at ``TEXT_LIMIT``; a ``Markup`` value, which the page made (a chart's points), is whole."""
    attributes = "".join(f' {k.rstrip("_").replace("_", "-")}="{html.escape(v if isinstance(v, Markup) else text(v))}"'
                         for k, v in attrs.items() if v is not None)
    body = "".join(c if isinstance(c, Markup) else html.escape(text(c), quote=False) for c in _flat(children))
    return Markup(f"<{tag}{attributes}>" if tag == "meta" else f"<{tag}{attributes}>{body}</{tag}>")


def _flat(children: Iterable[Any]) -> Iterable[Any]:
    for c in children:
        if isinstance(c, (list, tuple)):
            yield from _flat(c)
        elif c is not None:
            yield c


def none(what: str) -> Markup:
    """The one line a panel without data shows."""
    return el("p", what, class_="none")


def lines(texts: list[str]) -> Markup:
    """A block of lines, each escaped and cut as ``text`` cuts it."""
    return el("pre", [(line, "\n") for line in texts[:1000]])


def table(head: list[str], rows: list[list[Any]]) -> Markup:
    return el("table", el("tr", [el("th", h) for h in head]), [el("tr", [el("td", c) for c in r]) for r in rows])


def finite(value: Any) -> float | None:
    """A number read from a log, as a finite float (None for anything else)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def chart(title: str, series: dict[str, list[tuple[float, float]]], marks: Iterable[tuple[float, str, str]] = (),
          width: int = 1000, height: int = 220) -> Markup:
    """A line chart of ``series`` (name -> (step, value) points) with vertical ``marks`` ((step, kind, label):
    ``MARKS``' kinds), its key below; the one ``none`` line when no series has a point."""
    series = {k: kept for k, v in series.items()
              if (kept := [(x, y) for x, y in v if math.isfinite(x) and math.isfinite(y)])}
    if not series:
        return none(f"{title}: no values logged")
    marks = list(marks)
    xs = [x for pts in series.values() for x, _ in pts] + [m[0] for m in marks]
    ys = [y for pts in series.values() for _, y in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + (abs(y0) * 0.1 or 1.0))
    left, top, w, h = 70, 22, width - 90, height - 50

    def px(x: float, y: float) -> str:
        return f"{left + (x - x0) / (x1 - x0) * w:.1f},{top + h - (y - y0) / (y1 - y0) * h:.1f}"

    parts = [el("text", title, x=left, y=14, font_size=13, font_weight="bold"),
             el("rect", x=left, y=top, width=w, height=h, fill="none", stroke="#ccc")]
    for i, y in enumerate((y0, (y0 + y1) / 2, y1)):
        parts.append(el("text", f"{y:.4g}", x=left - 4, y=top + h - i * h / 2 + 4, font_size=10, text_anchor="end"))
    for i, x in enumerate((x0, (x0 + x1) / 2, x1)):
        parts.append(el("text", f"{x:.6g}", x=left + i * w / 2, y=top + h + 14, font_size=10, text_anchor="middle"))
    parts.append(el("text", "step", x=left + w / 2, y=height - 4, font_size=10, text_anchor="middle"))
    for x, kind, label in marks:
        a, b = px(x, y0).split(","), px(x, y1).split(",")
        parts.append(el("line", el("title", label), x1=a[0], y1=a[1], x2=b[0], y2=b[1], stroke=MARKS[kind],
                        stroke_width=2 if kind == "stage" else 1, stroke_dasharray=None if kind == "stage" else "4 3"))
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        if len(pts) == 1:
            x, y = px(*pts[0]).split(",")
            parts.append(el("circle", el("title", name), cx=x, cy=y, r=3, fill=color))
        else:
            line = Markup(" ".join(px(x, y) for x, y in pts))  # numbers the page made: never cut
            parts.append(el("polyline", el("title", name), points=line, fill="none", stroke=color, stroke_width=1.5))
    key = [el("span", el("i", style=f"background:{PALETTE[i % len(PALETTE)]}"), name) for i, name in enumerate(series)]
    kinds = sorted({kind for _, kind, _ in marks})
    key += [el("span", el("i", style=f"background:{MARKS[k]}"), f"{k} (line)") for k in kinds]
    svg = el("svg", parts, xmlns="http://www.w3.org/2000/svg", viewBox=f"0 0 {width} {height}", role="img",
             aria_label=title)
    return Markup(el("figure", svg, el("div", key, class_="key")))


def page(title: str, sections: list[tuple[str, str, Markup]]) -> str:
    """The whole page: ``sections`` are (anchor, heading, body)."""
    nav = el("p", [(el("a", heading, href=f"#{anchor}"), " ") for anchor, heading, _ in sections], class_="nav")
    body = [el("h1", title), nav] + [el("section", el("h2", heading), content, id=anchor)
                                     for anchor, heading, content in sections]
    head = el("head", el("meta", charset="utf-8"), el("meta", http_equiv="Content-Security-Policy", content=_CSP),
              el("title", title), el("style", Markup(_CSS)))
    return "<!DOCTYPE html>\n" + el("html", head, el("body", body), lang="en") + "\n"
