"""Screenshots of each panel of a run's report page for docs/report.md, taken in headless Chromium.

    python tools/report_screenshots.py RUN_DIR [--out docs/report] [--panels curves,cost,...]

For each panel a copy of the page shows that panel alone (a style rule hides the others), Chromium draws it, and
the white margin below is trimmed when Pillow is importable. Writes OUT_<panel>.png.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel_ckpt.report import PANELS, render  # noqa: E402


def shoot(html: str, png: Path, work: Path, height: int) -> None:
    page = work / f"{png.stem}.html"
    page.write_text(html, encoding="utf-8")
    subprocess.run([shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--window-size=1100,{height}", f"--user-data-dir={work / 'profile'}",
                    f"--screenshot={png}", page.as_uri()], check=True, capture_output=True, timeout=120)


def trim(png: Path) -> None:
    """Cut the white rows below the content (Pillow, when it is installed)."""
    try:
        from PIL import Image, ImageChops
    except ImportError:
        return
    with Image.open(png) as image:
        rgb = image.convert("RGB")
    box = ImageChops.difference(rgb, Image.new("RGB", rgb.size, (255, 255, 255))).getbbox()
    if box:
        rgb.crop((0, 0, rgb.width, min(rgb.height, box[3] + 16))).save(png, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", default="docs/report", help="path prefix of the PNGs (default docs/report)")
    parser.add_argument("--panels", default=",".join(a for a, _, _ in PANELS))
    parser.add_argument("--height", type=int, default=1600, help="the window's height before trimming")
    args = parser.parse_args(argv)
    html = render(args.run_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for anchor in args.panels.split(","):
            alone = f"<style>body>section:not(#{anchor}),body>p.nav,body>h1{{display:none}}</style></head>"
            png = Path(f"{args.out}_{anchor}.png")
            shoot(html.replace("</head>", alone, 1), png, Path(tmp), args.height)
            trim(png)
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
