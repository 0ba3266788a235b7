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
    "--allow-file-access-from-files",
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


class Browser:
    """One Chromium process and one page, driven by protocol commands.

    Args:
        binary: path of the Chromium executable.
        width, height: viewport in CSS pixels (the page width a reader sees).
    """

    def __init__(self, binary: str, width: int = 1280, height: int = 900) -> None:
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
            [binary, *FLAGS, f"--user-data-dir={self._profile}",
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

    def screenshot(self, path: Path, max_height: int = 40000, tile: int = 1500) -> None:
        """Save a PNG of the whole page (cut at ``max_height`` CSS pixels).

        One capture taller than the compositor's largest surface (about 16k pixels)
        comes back blank below it, so the page is captured in tiles and stitched.
        """
        from PIL import Image  # matplotlib's dependency: always there with the book

        width, height = self.evaluate(
            "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        height = min(height, max_height)
        page = Image.new("RGB", (width, height), "white")
        for top in range(0, height, tile):
            clip = {"x": 0, "y": top, "width": width,
                    "height": min(tile, height - top), "scale": 1}
            shot = self.send("Page.captureScreenshot", timeout=120, format="png",
                             captureBeyondViewport=True, clip=clip)
            part = Image.open(io.BytesIO(base64.b64decode(shot["data"])))
            page.paste(part.convert("RGB"), (0, top))
        page.save(path)

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
