"""Headless Chromium driven over the DevTools protocol (aiohttp's websocket client: no browser driver to install):
open a page with a cookie set, wait until its text holds what is expected, read the text, take a screenshot."""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

# The flags a machine without network needs: no background connections, no first-run, no sandbox (as root).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One tab of a headless Chromium, over its DevTools websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json(timeout=60)
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def text(self) -> str:
        result = await self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                                 returnByValue=True)
        return result["result"].get("value", "")


async def _open(url: str, cookie: tuple[str, str] | None, expect: list[str], screenshot: Path | None,
                port: int, timeout: float) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.put(f"http://127.0.0.1:{port}/json/new?about:blank") as response:
            target = await response.json(content_type=None)
        async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            page = Page(ws)
            await page.call("Emulation.setDeviceMetricsOverride", width=1600, height=1000, deviceScaleFactor=1,
                            mobile=False)
            if cookie is not None:
                await page.call("Network.setCookie", name=cookie[0], value=cookie[1], url=url)
            await page.call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout
            while True:  # the page fetches what it shows after it loads
                text = await page.text()
                if all(re.search(e, text) for e in expect) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            if screenshot is not None:
                await asyncio.sleep(1)  # what it has drawn, settled
                shot = await page.call("Page.captureScreenshot", format="png")
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            return text


def page_text(url: str, cookie: tuple[str, str] | None = None, expect: list[str] = (),
              screenshot: Path | None = None, timeout: float = 60) -> str:
    """`url`'s text as headless Chromium renders it, once every regular expression of `expect` is found in it (or
    after `timeout`), with `cookie` (name, value) set for it first; a PNG of it to `screenshot`."""
    binary = chromium()
    if binary is None:
        raise RuntimeError("no chromium on PATH")
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                 "--remote-debugging-address=127.0.0.1", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            port = None
            for line in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
                m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
                if m:
                    port = int(m.group(1))
                    break
            if port is None:
                raise RuntimeError(f"chromium exited without its DevTools address (exit {proc.wait()})")
            return asyncio.run(_open(url, cookie, list(expect), screenshot, port, timeout))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the browser and its renderer and GPU processes
            proc.wait()
