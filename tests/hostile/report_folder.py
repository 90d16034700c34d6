"""A run folder crafted against ``ckpt-train report``: markup, event handlers, ``javascript:`` URLs and control
characters in every string the report reads (metric keys, checkpoint, source and stage names, recipe values, eval
tasks, quarantine reasons, events), and a checker of the page: no element or attribute that could run code."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

SCRIPT = "<script>alert(1)</script>"
ATTR = '" onerror="alert(1)'
IMG = "<img src=x onerror=alert(1)>"
JS_URL = "javascript:alert(1)"
CONTROL = "\x1b]0;pwned\x07\x00\u2028"
PAYLOADS = (SCRIPT, ATTR, IMG, JS_URL, CONTROL)
EVIL = "".join(PAYLOADS)
# the elements and attributes the page itself uses: anything else came from the folder
TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "a", "section", "figure", "svg",
        "text", "rect", "line", "polyline", "circle", "div", "span", "i", "table", "tbody", "tr", "th", "td", "ul", "li", "pre"}


def _json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value), encoding="utf-8")


def hostile_run(root: Path) -> Path:
    """``root/run``: two checkpoints (one named with every payload), a quarantined one, logs and events."""
    run = root / "run"
    name = f"epoch_0_step_2{SCRIPT}{ATTR}{JS_URL}".replace("/", "|")
    steps = {1: "epoch_0_step_1", 2: name}
    for step, folder in steps.items():
        ckpt = run / folder
        source = {"path": EVIL, "epoch": EVIL, "shard": 0, "shards": 1, "row": 3, "tokens": 7}
        _json(ckpt / "metadata.json", {
            "step": step, "epoch": 0, "val_loss": 1.0 / step, "train_loss": EVIL, "model_save_format": EVIL,
            "world_size": EVIL, "consumed_samples": EVIL,
            "extra": {"counters": {EVIL: EVIL}, "data_position": {"sequences": EVIL, "skipped_rows": EVIL,
                                                                  "sources": [source]}},
            "stages": [{"name": EVIL, "first_step": 1, "samples": 0, "changed": [EVIL]}]})
        (ckpt / "config.yaml").write_text(json.dumps({"checkpoint": {"monitor": EVIL, "save_top_k": 1,
                                                                     "max_recent_checkpoints": EVIL,
                                                                     "keep_steps": [EVIL, 2], "mode": EVIL}}))
        _json(ckpt / "eval" / "task.json", {"results": {EVIL: {f"{EVIL},none": 0.5, "alias": EVIL}}})
    odd = run / "epoch_0_step_9"  # every field of another type than the one written
    _json(odd / "metadata.json", {"step": 9, "epoch": EVIL, "extra": [EVIL], "mesh": EVIL, "world_size": 4,
                                  "model_save_format": [EVIL], "stages": EVIL, "val_loss": [EVIL]})
    (odd / "config.yaml").write_text("[1, 2]")
    (odd / "eval").mkdir()
    (odd / "eval" / "task.json").write_text('{"results": {"task": {"acc,none": NaN}}}')
    _json(run / "quarantine" / "odd.json", {"step": [EVIL], "reason": [EVIL], "quarantined_at": EVIL})
    (run / "quarantine" / "odd").mkdir(parents=True)
    (run / "LATEST").symlink_to(name)
    (run / "LOWEST_VAL.txt").write_text(EVIL)
    quarantined = run / "quarantine" / f"epoch_0_step_3{SCRIPT}".replace("/", "|")
    quarantined.mkdir(parents=True)
    _json(run / "quarantine" / f"{quarantined.name}.json", {"step": 3, "reason": EVIL, "quarantined_at": 1.0})
    train = [{"step": s, "epoch": 0, "loss": 2.0 / s, "lr": 1e-3, "grad_norm": 1.0, EVIL: 1.0,
              f"reward_{EVIL}": 0.5, "reward": 0.5, "kl": 0.1, "completion_length": 4.0, "reward_margin": 0.2,
              "reward_accuracy": 0.5, "source_tokens": [10 * s, EVIL], "skipped_rows": EVIL} for s in (1, 2, 3, 4)]
    (run / "training.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (run / "validation.jsonl").write_text(json.dumps({"step": 2, "val_loss": 0.5, EVIL: EVIL}) + "\n")
    events = [{"event": "start", "time": 1.0, "step": 0, "resumed_from": EVIL, "every_steps": "auto"},
              {"event": "checkpoint", "time": 2.0, "step": 1, "name": EVIL, "blocked_s": 0.1, "bytes": 10},
              {"event": "interval", "time": 2.5, "step": 1, "every_steps": 2, "was_every_steps": 1, "text": EVIL},
              {"event": "checkpoint", "time": 3.0, "step": 2, "name": EVIL, "blocked_s": EVIL},
              {"event": "side_failure", "time": 3.5, "kind": EVIL, "text": EVIL},
              {"event": "checkpoint", "time": 3.7, "step": 3, "name": EVIL},  # quarantined since
              {"event": "checkpoint", "time": 3.8, "step": 4, "name": EVIL},  # deleted by retention since
              {"event": "end", "time": 4.0, "step": 4, "status": EVIL}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


class Page(HTMLParser):
    """The elements, attributes and text of a page, as a browser's parser meets them."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def code_in(text: str) -> list[str]:
    """What in the page ``text`` could run code or load anything: a script or other foreign element, an ``on*``
    attribute, a ``javascript:`` (or any) URL, a raw control character."""
    page, found = Page(text), []
    for tag, attrs in page.tags:
        if tag not in TAGS:
            found.append(f"element <{tag}>")
        for key, value in attrs:
            if key.startswith("on") or key in ("src", "srcset", "formaction", "action", "xlink:href", "data"):
                found.append(f"attribute {key} on <{tag}>")
            if key == "href" and not (value or "").startswith("#"):
                found.append(f"href {value!r}")
            if "javascript:" in (value or "").replace(" ", "").lower() and key not in ("aria-label", "title"):
                found.append(f"{key}={value!r} on <{tag}>")
    found += [f"control character {c!r}" for c in set(text) if ord(c) < 32 and c not in "\n\t"]
    return found
