"""Screenshots of the documentation site as a reader's browser renders it.

Builds the site (``mkdocs build --strict``) into a temporary folder, serves it on 127.0.0.1 with
Python's ``http.server``, and saves a headless-Chromium screenshot of a few pages — the home
page, the attention concepts, the API pages of ``flowattn.flows`` and ``flowattn.lm``, and the
benchmarks — as PNG files in the given folder::

    pip install -e ".[docs]"                       # mkdocs and mkdocstrings
    apt-get install chromium                       # or any Chromium / Chrome build
    python docs/screenshots.py /tmp/flowattn-shots
    python docs/screenshots.py /tmp/shots cnf/ api/nn/ --height 4000

Pages are paths of the built site (``""`` is the home page). The browser may reach only the
local server (every other host name fails to resolve), so the screenshots show what the site
looks like without a network, and each run is bounded in time. Exits non-zero with a message
when Chromium is not found (set ``CHROMIUM`` to its path), when the site does not build, or
when a screenshot fails. This file is not part of the site (``exclude_docs`` in mkdocs.yml).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PAGES = ["", "attention/", "api/flows/", "api/lm/", "benchmarks/"]
BROWSERS = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"]


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


def find_chromium() -> str | None:
    """The Chromium to use: ``$CHROMIUM`` if set, else the first of BROWSERS on the PATH."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def build_site(site_dir: Path) -> None:
    # Not --quiet: it hides the warnings that --strict turns into a failure.
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit(f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}")


def screenshot(chromium: str, url: str, png: Path, width: int, height: int, profile: Path,
               timeout: float) -> None:
    command = [
        chromium,
        "--headless",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        # Loopback only: any other host (a CDN, say) fails at once instead of waiting on it.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",  # let scripts run before the picture is taken
        f"--window-size={width},{height}",
        f"--screenshot={png}",
        url,
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    png.unlink(missing_ok=True)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"Chromium took more than {timeout:.0f} s on {url}")
    if result.returncode != 0 or not png.is_file() or png.stat().st_size == 0:
        sys.exit(f"Chromium could not take a screenshot of {url} (exit {result.returncode}):\n"
                 f"{result.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the PNG files (created if needed)")
    parser.add_argument("pages", nargs="*", default=DEFAULT_PAGES,
                        help="paths of the built site (default: %(default)s)")
    parser.add_argument("--width", type=int, default=1280, help="window width in pixels")
    parser.add_argument("--height", type=int, default=2400, help="window height in pixels")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds allowed per screenshot")
    args = parser.parse_args(argv)

    chromium = find_chromium()
    if chromium is None:
        sys.exit("Chromium not found: install it (e.g. `apt-get install chromium`) or set "
                 "CHROMIUM to the path of a Chromium or Chrome executable.")
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="flowattn-docs-") as tmp:
        site_dir, profile = Path(tmp) / "site", Path(tmp) / "profile"
        build_site(site_dir)
        handler = functools.partial(_QuietHandler, directory=str(site_dir))
        with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            try:
                base = f"http://127.0.0.1:{server.server_address[1]}/"
                for page in args.pages:
                    page = page.lstrip("/")
                    name = page.strip("/").replace("/", "-") or "home"
                    png = args.out / f"{name}.png"
                    screenshot(chromium, base + page, png, args.width, args.height, profile,
                               args.timeout)
                    print(png)
            finally:
                server.shutdown()
                thread.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
