"""A browser environment: a headless Chromium on a small web app served on loopback.

Each trajectory gets a fresh browser context (its own cookies and storage) and one page on the
environment's site (``trident.envs.web_site``). The model acts with four tools, each returning
the page as accessibility-tree text afterwards (playwright's ``aria_snapshot`` of the body,
without its ``/url`` lines, capped at ``max_output_chars``):

- ``goto(url)``: open a page of the site (a path such as ``/notes``);
- ``click(text)``: click the link or button with that text;
- ``type(field, text)``: type into the text field with that label;
- ``read()``: the page as it is.

The first message is the row's ``prompt`` followed by the start page (the row's ``start``, ``/``
by default). The episode ends with a turn without tool calls; the reward is 1.0 if the final
page's text contains the row's ``check`` (a string, or a list of strings that must all appear),
else 0.0. A row's ``people`` fill the site's directory.

**Confinement.** One Chromium per process (``BrowserPool``) on a private event-loop thread, so
environments on any event loop share it. Its only proxy is the site's server, for every URL
(loopback included): it serves its own origin and refuses anything else (``web_site``); ``goto``
refuses URLs outside the site before the browser sees them. Chromium runs without a GPU,
extensions or background networking, in its own process group, with ``PR_SET_PDEATHSIG`` so it
dies with the process that started it.

**Bounds.** At most ``max_contexts`` trajectories hold a context at once (8; the others wait
for one: on few cores, dozens of renderers at once time out). Every action has ``timeout_s``; a
context lives at most ``ttl_s`` (then it is closed, and the next action is an infrastructure
error); the Chromium process tree is killed if its memory (PSS) passes ``memory_mb`` (checked
twice a second), and restarted for the next trajectory (measured here: ~320 MiB for Chromium
itself, ~26 MiB more per open context). ``close()`` closes the context on every exit path. A
browser that died, hung or disconnected, or a playwright error on the site's own pages, is the
infrastructure's failure (``infra_error``); a missing link is the model's (an error result it
reads).

``make_rows`` writes rows of three kinds (``kinds=``): ``subscribe`` as a given name (click,
type, click; 192 prompts), ``note``: add a word on the Notes page (the same actions; 20 prompts),
and ``lookup``: find a person's room in the directory, then submit it on the Answer page (five
actions; 24 prompts, each row with its own directory). ``start_on_form=True`` starts ``subscribe`` and ``note`` on
their form (type, click: what a tiny model learns in a few hundred SFT steps). Each has a ``messages`` demonstration whose
tool outputs are the pages' text (``web_site.Page.text``).

Needs ``pip install 'trident[browser]'`` (playwright, psutil) and a Chromium binary (Debian's
``chromium``; ``chromium=`` names another); playwright downloads nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

from trident.cluster.process import die_with_parent
from trident.data.tasks import generate_split
from trident.envs import Message, StepResult
from trident.envs.terminal import WORDS
from trident.envs.web_site import Site, SiteState, render
from trident.models.load import prompt_messages
from trident.sandbox import InfraError
from trident.tools.parsers import AssistantTurn
from trident.tools.toolset import Tool, ToolError, ToolInfraError, ToolResult, ToolSet, tool

_T = TypeVar("_T")

NAMES = (
    "Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena",
    "Milo", "Nia", "Otto", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Yara",
)  # fmt: skip
SURNAMES = ("Park", "Lee", "Moss", "Gray", "Hill", "Fox", "Reed", "Stone")
KINDS = ("subscribe", "note", "lookup")


def find_chromium(path: str | None = None) -> str:
    """The Chromium binary to run, or a clear error naming how to get one."""
    for candidate in (path,) if path else ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(candidate)
        if found:
            return found
    raise FileNotFoundError(
        f"env.name=browser needs Chromium: {path or 'no chromium on PATH'}; install it "
        "(Debian: apt-get install chromium) or set env.kwargs.chromium=<path>"
    )


def page_text(snapshot: str) -> str:
    """The model's view of a page: the aria snapshot without its ``/url`` lines (a link left
    with no children loses its trailing ``:``)."""
    lines = [line for line in snapshot.splitlines() if not line.lstrip().startswith("- /url:")]
    kept = []
    for line, after in zip(lines, [*lines[1:], ""], strict=True):
        indent = len(line) - len(line.lstrip())
        if line.endswith(":") and len(after) - len(after.lstrip()) <= indent:
            line = line[:-1]
        kept.append(line)
    return "\n".join(kept)


class BrowserPool:
    """One Chromium (and the site it may reach) for the process; a context per trajectory.

    Everything playwright touches lives on the pool's own event loop (a daemon thread); callers on
    any loop ``await pool.call(coro)``.
    """

    def __init__(
        self, chromium: str | None = None, memory_mb: int = 2048, max_contexts: int = 8
    ) -> None:
        try:
            from playwright.async_api import async_playwright
        except ImportError as e:
            raise ImportError("env.name=browser needs pip install 'trident[browser]'") from e
        self._async_playwright = async_playwright
        self.executable = find_chromium(chromium)
        self.memory_mb = memory_mb
        self.site = Site()
        self.kills = 0  # Chromiums killed for memory
        self._pw: Any = None
        self._browser: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._profile: str | None = None
        self._starting: asyncio.Lock | None = None
        self.slots = asyncio.Semaphore(max_contexts)  # used on the pool's loop only
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="trident-browser", daemon=True
        )
        self._thread.start()
        self._watchdog = self._submit(self._watch_memory())

    # -- callers' side ---------------------------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` (playwright work) on the pool's loop."""
        return await asyncio.wrap_future(self._submit(coro))

    def close(self) -> None:
        """Stop Chromium, playwright and the site. Idempotent."""
        if self._loop.is_closed():
            return
        self._watchdog.cancel()
        with_timeout = self._submit(self._shutdown())
        try:
            with_timeout.result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self._loop.close()  # what makes a second close() return at once
            self._kill()
            self.site.close()

    # -- on the pool's loop ------------------------------------------------------------------------

    async def new_context(self, sid: str, ttl_s: float, timeout_s: float) -> Any:
        """A fresh context holding the session's cookie, one page open; closed after ``ttl_s``."""
        browser = await self._ensure_browser()
        context = await browser.new_context()
        context.set_default_timeout(timeout_s * 1000)
        await context.add_cookies([{"name": "sid", "value": sid, "url": self.site.origin}])
        await context.new_page()
        self._loop.call_later(ttl_s, lambda: asyncio.ensure_future(_close_quietly(context)))
        return context

    async def _ensure_browser(self) -> Any:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._browser is not None and self._browser.is_connected():
                return self._browser
            self._kill()
            if self._pw is None:
                self._pw = await self._async_playwright().start()
            endpoint = await self._launch()
            self._browser = await self._pw.chromium.connect_over_cdp(endpoint, timeout=30_000)
            return self._browser

    async def _launch(self) -> str:
        """Start Chromium with the site as its only proxy; its DevTools endpoint. Started from the
        pool's thread, which lives as long as the process: PDEATHSIG fires when the thread that
        started the child ends."""
        self._profile = tempfile.mkdtemp(prefix="trident-chromium-")
        args = [
            self.executable,
            "--headless=new",
            "--remote-debugging-port=0",
            f"--user-data-dir={self._profile}",
            f"--proxy-server={self.site.origin}",
            "--proxy-bypass-list=<-loopback>",  # loopback goes through the proxy too
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--mute-audio",
            *(["--no-sandbox"] if os.geteuid() == 0 else []),  # Chromium's own sandbox refuses root
            "about:blank",
        ]
        log = open(Path(self._profile) / "chromium.log", "wb")  # noqa: SIM115 (the child holds it)
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGKILL),
        )
        log.close()
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = (Path(self._profile) / "chromium.log").read_text(errors="replace")[-2000:]
                raise InfraError(f"Chromium exited with {self._proc.returncode}: {tail}")
            lines = port_file.read_text().split("\n") if port_file.exists() else []
            if len(lines) >= 2 and lines[1]:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
            await asyncio.sleep(0.05)
        self._kill()
        raise InfraError("Chromium did not open its DevTools port within 30 s")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None
        self._browser = None

    def memory_used_mb(self) -> float:
        """Memory of the Chromium process tree, MiB: the sum of its processes' PSS (shared pages
        split among their sharers; a sum of RSS counts them once per process, ~2x more), 0 when
        none runs."""
        import psutil

        proc = self._proc
        if proc is None or proc.poll() is not None:
            return 0.0
        total = 0
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(proc.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    total += p.memory_full_info().pss
        return total / 2**20

    async def _watch_memory(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if await asyncio.to_thread(self.memory_used_mb) > self.memory_mb:
                self.kills += 1
                self._kill()  # its contexts' next actions fail: an infra_error each

    async def _shutdown(self) -> None:
        if self._browser is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._browser.close(), 10)
        self._kill()
        if self._pw is not None:
            await self._pw.stop()
            self._pw = None


async def _close_quietly(context: Any) -> None:
    with contextlib.suppress(Exception):
        await context.close()


@functools.cache
def shared_browser(
    chromium: str | None = None, memory_mb: int = 2048, max_contexts: int = 8
) -> BrowserPool:
    """The process's ``BrowserPool`` for these settings (started on first use)."""
    return BrowserPool(chromium, memory_mb, max_contexts)


class BrowserEnv:
    """Reach a page state on the environment's site with goto/click/type/read."""

    def __init__(
        self,
        chromium: str | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        ttl_s: float = 300.0,
        max_output_chars: int = 2000,
        max_contexts: int = 8,
    ) -> None:
        self.pool = shared_browser(chromium, memory_mb, max_contexts)
        self.timeout_s, self.ttl_s, self.max_output_chars = timeout_s, ttl_s, max_output_chars
        self.tools = ToolSet()
        self.context: Any = None
        self.sid = ""
        self.check: list[str] = []
        self.slot = False

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        site = self.pool.site
        self.sid = site.open_session(row.get("people"))
        check = row["check"]
        self.check = [check] if isinstance(check, str) else list(check)
        await self.pool.call(self.pool.slots.acquire())  # at most max_contexts at once: queue
        self.slot = True
        self.context = await self._act(self.pool.new_context(self.sid, self.ttl_s, self.timeout_s))
        self.tools = ToolSet(browser_tools(self), self.max_output_chars)
        try:
            start = await self._act(self._goto(urljoin(site.origin, row.get("start", "/"))))
        except ToolError as e:
            raise InfraError(f"the row's start page: {e}") from e
        return prompt_messages(f"{row['prompt']}\n\n{start}")

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        if turn.tool_calls:
            return StepResult()
        final = await self._act(self._read())
        return StepResult(reward=float(all(c in final for c in self.check)), done=True)

    async def close(self) -> None:
        context, self.context = self.context, None
        if context is not None and not self.pool._loop.is_closed():
            await self.pool.call(_close_quietly(context))
        if self.slot:
            self.slot = False
            self.pool._loop.call_soon_threadsafe(self.pool.slots.release)
        self.pool.site.close_session(self.sid)

    # -- tools -------------------------------------------------------------------------------------

    async def _act(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run playwright work on the pool; a dead, stuck or closed browser is the infrastructure's."""
        from playwright.async_api import Error as PlaywrightError

        try:
            return await asyncio.wait_for(self.pool.call(coro), 2 * self.timeout_s + 5)
        except ToolError:
            raise
        except TimeoutError as e:  # past playwright's own timeout: the browser is stuck
            raise ToolInfraError(
                f"the browser did not answer within {2 * self.timeout_s + 5:g} s"
            ) from e
        except PlaywrightError as e:  # on the site's own pages: Chromium's failure, not the model's
            raise ToolInfraError(f"the browser failed: {str(e).splitlines()[0]}") from e

    # Coroutines below run on the pool's loop.

    def _page(self) -> Any:
        if self.context is None or not self.context.pages:
            raise ToolInfraError(
                "the browser context is closed (its ttl_s passed, or Chromium died)"
            )
        return self.context.pages[0]

    async def _read(self) -> str:
        return page_text(await self._page().locator("body").aria_snapshot())

    async def _goto(self, url: str) -> str:
        response = await self._page().goto(url)
        if response is not None and response.status >= 400:
            raise ToolError(f"{urlsplit(url).path or '/'}: HTTP {response.status} (no such page)")
        return await self._read()

    async def _click(self, text: str) -> str:
        page = self._page()
        for role in ("link", "button"):
            target = page.get_by_role(role, name=text, exact=True)
            if await target.count():
                await target.first.click()
                await page.wait_for_load_state()
                return await self._read()
        raise ToolError(f"no link or button named {text!r} on this page")

    async def _type(self, field: str, text: str) -> str:
        page = self._page()
        target = page.get_by_role("textbox", name=field, exact=True)
        if not await target.count():
            raise ToolError(f"no text field labelled {field!r} on this page")
        await target.first.fill(text)
        return await self._read()


def browser_tools(env: BrowserEnv | None) -> list[Tool]:
    """The ``goto``/``click``/``type``/``read`` tools of one episode (``env=None``: for their
    schemas only). A turn's calls run one after another, in call order."""
    lock = asyncio.Lock()

    def live() -> BrowserEnv:
        if env is None:
            raise ToolInfraError("these browser tools only describe themselves (no env)")
        return env

    async def act(work: Coroutine[Any, Any, str]) -> str:
        async with lock:
            return await live()._act(work)

    async def goto(url: str) -> str:
        """Open a page of the site, e.g. /notes.

        Args:
            url: a path on the site (or a full URL of it)
        """
        origin = live().pool.site.origin
        target = urljoin(origin + "/", url)
        if urlsplit(target).netloc != urlsplit(origin).netloc:
            raise ToolError(
                f"only this site's pages can be opened (paths such as /notes), not {url}"
            )
        return await act(live()._goto(target))

    async def click(text: str) -> str:
        """Click the link or button with this text."""
        return await act(live()._click(text))

    async def type_text(field: str, text: str) -> str:
        """Type text into the text field with this label.

        Args:
            field: the field's label
            text: what to type (replaces what the field holds)
        """
        return await act(live()._type(field, text))

    async def read() -> str:
        """Read the page."""
        return await act(live()._read())

    timeout = 2 * (env.timeout_s if env else 5.0) + 10  # past _act's own bound
    return [
        tool(goto, timeout_s=timeout),
        tool(click, timeout_s=timeout),
        tool(type_text, name="type", timeout_s=timeout),
        tool(read, timeout_s=timeout),
    ]


# -- rows -----------------------------------------------------------------------------------------


def _call(name: str, **arguments: str) -> Message:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


class BrowserTask:
    """Rows for ``generate_split`` (a ``trident.data.tasks.RowMaker``); the env scores them."""

    name = "browser"

    def __init__(self, kinds: Sequence[str] = KINDS, start_on_form: bool = False) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise ValueError(f"browser kinds are {', '.join(KINDS)}; got {list(kinds)}")
        self.kinds = tuple(kinds)
        self.start_on_form = start_on_form

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        kind = rng.choice(self.kinds)
        people: dict[str, int] = dict(
            zip(rng.sample(NAMES, 3), rng.sample(range(10, 100), 3), strict=True)
        )
        state = SiteState(people=people)
        if kind == "subscribe":
            name = f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"
            prompt = f"Subscribe to the newsletter as {name}."
            actions = [("click", "/subscribe", {"text": "Subscribe"}), ("type", "Name", name)]
            actions += [("submit", {"name": name}, {"text": "Send"})]
            check = f"Subscribed as {name}"
        elif kind == "note":
            word = rng.choice(WORDS)
            prompt = f"Add the note {word} on the Notes page."
            actions = [("click", "/notes", {"text": "Notes"}), ("type", "Note", word)]
            actions += [("submit", {"note": word}, {"text": "Add"})]
            check = f"listitem: {word}"
        else:
            name = rng.choice(list(people))
            room = str(people[name])
            prompt = f"Find the room of {name} in the directory and submit it as the answer."
            actions = [
                ("click", "/directory", {"text": "Directory"}),
                ("click", f"/people/{name}", {"text": name}),
                ("click", "/answer", {"text": "Answer"}),
                ("type", "Answer", room),
                ("submit", {"answer": room}, {"text": "Submit"}),
            ]
            check = f"Recorded answer {room}"
        path = "/"
        if self.start_on_form and kind != "lookup":  # skip the click that opens the form
            path, actions = actions[0][1], actions[1:]
        start = path
        page = render(path, state)
        assert page is not None and isinstance(path, str)
        messages = prompt_messages(f"{prompt}\n\n{page.text()}")
        typed: dict[str, str] = {}
        for action, target, arguments in actions:
            if action == "type":
                typed[target] = arguments
                messages.append(_call("type", field=target, text=arguments))
            elif action == "click":
                path, typed = target, {}
                page = render(path, state)
                messages.append(_call("click", **arguments))
            else:  # a form's button: the form posts to the page it is on
                page, typed = render(path, state, target), {}
                messages.append(_call("click", **arguments))
            assert page is not None
            name = "type" if action == "type" else "click"
            messages.append({"role": "tool", "name": name, "content": page.text(typed)})
        row: dict[str, Any] = {"prompt": prompt, "start": start}
        row |= {"people": people, "check": check, "kind": kind}
        row["tools"] = ToolSet(browser_tools(None)).schemas()
        row["messages"] = [*messages, {"role": "assistant", "content": "Done."}]
        return row


def make_rows(
    n: int,
    split: str = "train",
    seed: int = 0,
    kinds: Sequence[str] = KINDS,
    start_on_form: bool = False,
) -> list[dict[str, Any]]:
    """``n`` rows (prompt, start, people, check, messages) of one split; train/test prompts
    disjoint. ``start_on_form``: ``subscribe`` and ``note`` start on their form (type, click)."""
    return generate_split(BrowserTask(kinds, start_on_form), split, n, seed)
