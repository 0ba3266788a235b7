"""A headless Chromium driven over the DevTools protocol through a pipe.

`--remote-debugging-pipe` makes Chromium read protocol messages from file descriptor 3
and write its answers and events to descriptor 4, each JSON message ended by a NUL byte.
That needs no websocket client and no port, only the standard library.

Offline by construction: every host name resolves to nothing and every proxy lookup goes
to a closed port, so a page that needs a CDN shows it (the request is recorded and fails).
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

# Flags for a quiet, offline, reproducible browser (no sync, no updates, no first run).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--no-first-run",
    "--no-default-browser-check",
    "--mute-audio",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=http://127.0.0.1:9",
    "--remote-debugging-pipe",
]

EAGER_IMAGES_JS = """
(async () => {
  const imgs = [...document.images];
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.complete ? null :
      new Promise(r => { i.addEventListener("load", r); i.addEventListener("error", r); })));
  return imgs.length;
})()
"""

# Sticky and fixed boxes (the header, the sidebars, "back to top") would be painted
# into every viewport tile: pin them where a one-piece capture shows them (sticky in
# its place in the flow, fixed at the top of the page); no smooth scrolling.
PIN_JS = """
(() => {
  for (const e of document.querySelectorAll("*")) {
    const pos = getComputedStyle(e).position;
    if (pos === "sticky") {
      e.style.setProperty("position", "relative", "important");
      e.style.setProperty("top", "auto", "important");
      e.style.setProperty("bottom", "auto", "important");
    } else if (pos === "fixed") {
      e.style.setProperty("position", "absolute", "important");
    }
  }
  document.documentElement.style.setProperty("scroll-behavior", "auto", "important");
  return true;
})()
"""

# Scroll, then wait two animation frames: the next capture shows the new position.
SCROLL_JS = """
(async () => {
  window.scrollTo({top: %(y)d, left: 0, behavior: "instant"});
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  return window.scrollY;
})()
"""

# The text column's left and right edge in CSS pixels.
ARTICLE_JS = """
(() => {
  const e = document.querySelector("main article") || document.querySelector("main")
            || document.body;
  const r = e.getBoundingClientRect();
  return [Math.max(0, r.left), Math.min(window.innerWidth, r.right)];
})()
"""

INSTALL_HINT = ("install Chromium: `apt-get install -y chromium` (Debian/Ubuntu), "
                "or set CHROMIUM=/path/to/chrome")


def find_chromium() -> str | None:
    """The browser binary: $CHROMIUM, else the first of the usual names on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


# Two captures of the same rows, rasterised at two scroll offsets, agree except where an
# antialiased edge is cut by the viewport (a border's coverage is recomputed against the
# clip): there a pixel moves by a fraction of the edge's contrast against the background
# (measured: 1 level in the text, 8 on a code cell's grey border cut at the viewport's
# top). A row that shows other content (a band pasted twice, a gap) moves a glyph stroke
# between ink and paper, by well over 100 of 255 levels. A pixel differs when it moves
# by more than an eighth of the scale.
RASTER_LEVELS = 32


def rows_differing(page: Any, row: int, part: Any,
                   columns: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """First and last row of ``page`` (from ``row`` on) that differ from ``part``.

    Args:
        page: the stitched image.
        row: the row of ``page`` where ``part`` (a capture of the page) begins.
        part: an image as wide as ``page``.
        columns: the pixel columns ``[left, right)`` compared (default: all).

    Returns:
        ``(first, last)`` rows of ``page`` that differ by more than RASTER_LEVELS in
        some channel, or None when all agree.
    """
    from PIL import ImageChops

    left, right = columns or (0, part.width)
    rows = min(part.height, page.height - row)
    here = page.crop((left, row, right, row + rows))
    diff = ImageChops.difference(here, part.crop((left, 0, right, rows)))
    box = diff.point(lambda v: 255 if v > RASTER_LEVELS else 0).getbbox()
    return None if box is None else (row + box[1], row + box[3] - 1)


def repeated_band(image: Any, seam: int, min_rows: int = 12,
                  max_rows: int = 400) -> int:
    """Height of a band that repeats right across ``seam`` (0 when none does).

    A band of k rows repeats when rows [seam, seam + k) equal rows [seam - k, seam)
    and the band holds more than one distinct row (so that blank margins and
    uniform backgrounds, which repeat on any page, do not count).

    Args:
        image: the stitched screenshot.
        seam: the row where one tile ends and the next begins.
        min_rows, max_rows: the band heights looked for.

    Returns:
        The first repeated band height in ``[min_rows, max_rows]``, or 0.
    """
    first = max(0, seam - max_rows)
    window = image.crop((0, first, image.width, min(image.height, seam + max_rows)))
    data, stride = window.tobytes(), window.width * len(window.getbands())
    rows = [hash(data[y * stride:(y + 1) * stride]) for y in range(window.height)]
    mid = seam - first
    for k in range(min_rows, max_rows + 1):
        if mid - k < 0 or mid + k > len(rows):
            break
        above, below = rows[mid - k:mid], rows[mid:mid + k]
        if above == below and len(set(below)) > 1:
            return k
    return 0


class Browser:
    """One Chromium process and one page, driven by protocol commands.

    Args:
        binary: path of the Chromium executable.
        width, height: viewport in CSS pixels (the page width a reader sees).
    """

    def __init__(self, binary: str, width: int = 1280, height: int = 900,
                 loopback: bool = False) -> None:
        self.width, self.height = width, height
        flags = list(FLAGS)
        if loopback:  # a local server (JupyterLab on 127.0.0.1); still no other host
            flags = [f + ", EXCLUDE 127.0.0.1" if f.startswith("--host-resolver-rules")
                     else f for f in flags]
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire_fds() -> None:
            # Child side: put the pipe ends on 3 and 4 (moved high first so that dup2
            # never closes one end while placing the other).
            r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 20)
            w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 20)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [binary, *flags, f"--user-data-dir={self._profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, preexec_fn=wire_fds, pass_fds=(3, 4))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None
        targets = self.send("Target.getTargets", browser_level=True)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", browser_level=True,
                                 targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    # -- protocol plumbing ---------------------------------------------------------
    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message from Chromium before the deadline")
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed its protocol pipe (crashed?)")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, timeout: float = 30.0, browser_level: bool = False,
             **params: Any) -> dict[str, Any]:
        """Send one command and return its result; events seen meanwhile are kept."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session and not browser_level:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the next event named ``method`` (earlier ones are consumed)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev["method"] == method:
                    return self.events.pop(i)
            self.events.append(self._read_message(deadline))

    # -- what the tests use --------------------------------------------------------
    def load(self, url: str, timeout: float = 60.0) -> list[str]:
        """Open ``url``, wait for its load event; return every URL the page requested."""
        self.events.clear()
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        # A load event may still be the previous page's: wait until the new document
        # is the one in the frame and has finished loading.
        while True:
            self.wait_event("Page.loadEventFired", deadline - time.monotonic())
            here = self.evaluate("[location.href, document.readyState, !!document.body]")
            if here == [url, "complete", True]:
                break
        # Images below the fold are lazy: load them all now, so that sizes are known
        # and the layout does not move while it is measured or photographed.
        self.evaluate(EAGER_IMAGES_JS, timeout)
        return [ev["params"]["request"]["url"] for ev in self.events
                if ev["method"] == "Network.requestWillBeSent"]

    def evaluate(self, expression: str, timeout: float = 60.0) -> Any:
        """Evaluate JavaScript in the page (promises awaited); return its JSON value."""
        result = self.send("Runtime.evaluate", timeout=timeout, expression=expression,
                           awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def capture(self, timeout: float = 30.0, tries: int = 2) -> Any:
        """One PNG of the viewport as a PIL image, each try under its own deadline.

        A capture costs one viewport's pixels however tall the page is, so a deadline
        fits every page; a try that times out (a cold compositor) is retried.
        """
        from PIL import Image  # matplotlib's dependency: always there with the book

        for attempt in range(tries):
            try:
                shot = self.send("Page.captureScreenshot", timeout=timeout,
                                 format="png", captureBeyondViewport=False,
                                 optimizeForSpeed=True)
                return Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert(
                    "RGB")
            except TimeoutError:
                if attempt == tries - 1:
                    raise
        raise AssertionError("unreachable")

    def warm_up(self, timeout: float = 120.0) -> None:
        """Start the renderer and compositor on a tiny page before the real ones.

        The first capture of a freshly installed Chromium also creates its GPU
        process, caches and fonts; that happens here, under a generous deadline, and
        not inside a tall chapter's capture.
        """
        url = "data:text/html,<p style='font:16px serif'>warm&nbsp;<b>up</b></p>"
        self.events.clear()
        self.send("Page.navigate", url=url, timeout=timeout)
        self.wait_event("Page.loadEventFired", timeout)
        self.capture(timeout=timeout)

    @classmethod
    def warm(cls, binary: str, loopback: bool = False) -> "Browser":
        """A started browser, already :meth:`warm_up`-ed (closed again if that fails)."""
        browser = cls(binary, loopback=loopback)
        try:
            browser.warm_up()
        except BaseException:
            browser.close()
            raise
        return browser

    def scroll_to(self, y: int) -> float:
        """Scroll the page to ``y`` CSS pixels, wait for a painted frame there, and
        return where the page really is (the browser clamps at the bottom)."""
        return self.evaluate(SCROLL_JS % {"y": int(y)})

    def screenshot(self, path: Path, max_height: int = 40000, tile: int = 1800,
                   overlap: int = 120) -> tuple[list[int], list[str]]:
        """Save a PNG of the whole page (cut at ``max_height`` CSS pixels).

        The page is photographed one viewport at a time (the viewport made ``tile``
        CSS pixels tall meanwhile): scroll, capture the viewport, paste it at the row
        where the browser says it scrolled to (times the device pixel ratio), so a
        tile can never land twice or leave a gap. Sticky and fixed boxes are pinned
        in the flow first (else each tile would repeat them). Each tile begins
        ``overlap`` pixels above where the previous one ended, and those rows, seen
        twice, must agree: a tile placed at the wrong row fails there.

        Returns:
            The seams (rows of the saved image where a tile after the first begins)
            and one line per seam whose overlap disagrees (none: []).
        """
        from PIL import Image

        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=tile,
                  deviceScaleFactor=1, mobile=False)
        try:
            self.evaluate(PIN_JS)
            width, height, ratio = self.evaluate(
                "[window.innerWidth, document.documentElement.scrollHeight,"
                " window.devicePixelRatio]")
            height = min(height, max_height)
            # The seams are compared in the text column: the sidebars' "on this page"
            # highlight follows the scroll position by design.
            left, right = self.evaluate(ARTICLE_JS)
            columns = (round(left * ratio), round(right * ratio))
            page = Image.new("RGB", (round(width * ratio), round(height * ratio)),
                             "white")
            seams: list[int] = []
            bad: list[str] = []
            top, done = 0.0, 0.0  # CSS pixels: next scroll target, rows pasted so far
            while True:
                at = self.scroll_to(top)
                part = self.capture()
                row = round(at * ratio)
                if seams or row:
                    seams.append(row)
                    seen = round(done * ratio) - row
                    wrong = rows_differing(page, row, part.crop(
                        (0, 0, part.width, seen)), columns) if seen > 0 else None
                    if seen <= 0 or wrong is not None:
                        bad.append(f"seam at {row} px: the overlap with the tile above"
                                   + (f" differs in rows {wrong[0]}..{wrong[1]}"
                                      if wrong else " is missing"))
                page.paste(part, (0, row))
                end = at + part.height / ratio
                if end >= height:
                    break
                if end <= done:
                    raise RuntimeError(f"the page did not scroll to {top} (at {at})")
                done, top = end, end - overlap
        finally:
            self.send("Emulation.setDeviceMetricsOverride", width=self.width,
                      height=self.height, deviceScaleFactor=1, mobile=False)
        self.scroll_to(0)
        page.save(path)
        return seams, bad

    def close(self) -> None:
        """End the browser process and remove its throw-away profile."""
        try:
            self.send("Browser.close", browser_level=True, timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self._profile, ignore_errors=True)
