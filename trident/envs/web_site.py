"""The small web app the browser environment serves on loopback, and the browser's only proxy.

One ``Site`` per process: a ``ThreadingHTTPServer`` on ``127.0.0.1`` (a free port) with a state
per browser context, found by the ``sid`` cookie the environment sets on its context, so that
concurrent trajectories share one server and one Chromium without seeing each other's forms.

Texts on the pages hold no ``:`` (the snapshot would quote them). Pages (``Page``: a list of
elements) render two ways from one description: to HTML for Chromium,
and to the accessibility-tree text Chromium gives back for them (``Page.text``, the format of
playwright's ``aria_snapshot`` without its ``/url`` lines), so that the data generator writes
demonstrations whose tool outputs are what the browser shows without starting one
(``tests/test_env_browser.py`` replays them through Chromium and compares).

- ``/``: links to the other pages;
- ``/subscribe``: a Name field and a Send button; sending shows ``Subscribed as <name>``;
- ``/notes``: the session's notes as a list, a Note field and an Add button;
- ``/directory``: a link per person of the session's ``people``; ``/people/<name>`` their room;
- ``/answer``: an Answer field and a Submit button; submitting shows ``Recorded answer <x>``.

**The proxy.** Chromium runs with this server as its HTTP proxy for every URL, loopback included
(``--proxy-bypass-list=<-loopback>``), so every request it makes reaches this handler first: a
request for the site's own origin is served, anything else (another host, another port on
loopback, an HTTPS ``CONNECT``) gets ``403`` and is counted in ``Site.refused``. Chromium
resolves no names itself when it uses a proxy, so nothing leaves through DNS either.
"""

from __future__ import annotations

import html
import sys
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

HOME_LINKS = (("Subscribe", "/subscribe"), ("Notes", "/notes"), ("Directory", "/directory"))
HOME_LINKS += (("Answer", "/answer"),)


@dataclass
class Page:
    """A page as elements: ``("heading", text)``, ``("p", text)``, ``("links", [(text, href)])``,
    ``("list", [items])`` and a form ``("form", [(label, name, value)], button)``."""

    title: str
    elements: list[tuple[Any, ...]] = field(default_factory=list)

    def html(self) -> str:
        parts = [f"<!doctype html><html><head><title>{html.escape(self.title)}</title></head>"]
        parts.append("<body>")
        for kind, *args in self.elements:
            if kind == "heading":
                parts.append(f"<h1>{html.escape(args[0])}</h1>")
            elif kind == "p":
                parts.append(f"<p>{html.escape(args[0])}</p>")
            elif kind == "links":
                parts += [f'<a href="{html.escape(h)}">{html.escape(t)}</a>' for t, h in args[0]]
            elif kind == "list" and args[0]:
                items = "".join(f"<li>{html.escape(item)}</li>" for item in args[0])
                parts.append(f"<ul>{items}</ul>")
            elif kind == "form":
                fields = "".join(  # the placeholder names the field (no separate label line)
                    f'<input name="{name}" placeholder="{html.escape(label)}" '
                    f'value="{html.escape(value)}"> '
                    for label, name, value in args[0]
                )
                parts.append(f'<form method="post">{fields}<button>{html.escape(args[1])}</button>')
                parts.append("</form>")
        return "".join(parts) + "</body></html>"

    def text(self, typed: dict[str, str] | None = None) -> str:
        """What the browser shows of this page (``typed``: field label -> text typed since)."""
        typed = typed or {}
        lines: list[str] = []
        for kind, *args in self.elements:
            if kind == "heading":
                lines.append(f'- heading "{args[0]}" [level=1]')
            elif kind == "p":
                lines.append(f"- paragraph: {args[0]}")
            elif kind == "links":
                lines += [f'- link "{text}"' for text, _ in args[0]]
            elif kind == "list" and args[0]:
                lines.append("- list:")
                lines += [f"  - listitem: {item}" for item in args[0]]
            elif kind == "form":
                for label, _, value in args[0]:
                    value = str(typed.get(label, value))
                    shown = f'"{value}"' if value.isdigit() else value  # YAML quotes numbers
                    lines.append(f'- textbox "{label}"' + f": {shown}" * bool(value))
                lines.append(f'- button "{args[1]}"')
        return "\n".join(lines)


@dataclass
class SiteState:
    """One browser context's view of the site."""

    people: dict[str, int] = field(default_factory=dict)
    subscribed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)


def render(path: str, state: SiteState, form: dict[str, str] | None = None) -> Page | None:
    """The page at ``path`` (after posting ``form`` to it, if given), or None if there is none;
    a post changes ``state``."""
    home = ("links", [("Home", "/")])
    if path == "/":
        return Page("Home", [("heading", "Home"), ("links", list(HOME_LINKS))])
    if path == "/subscribe":
        if form is not None:
            name = form.get("name", "")
            state.subscribed.append(name)
            return Page(
                "Subscribed", [("heading", "Subscribed"), ("p", f"Subscribed as {name}"), home]
            )
        return Page(
            "Subscribe", [("heading", "Subscribe"), ("form", [("Name", "name", "")], "Send"), home]
        )
    if path == "/notes":
        if form is not None:
            state.notes.append(form.get("note", ""))
        return Page(
            "Notes",
            [
                ("heading", "Notes"),
                ("list", list(state.notes)),
                ("form", [("Note", "note", "")], "Add"),
                home,
            ],
        )
    if path == "/directory":
        links = [(name, f"/people/{quote(name)}") for name in state.people]
        return Page("Directory", [("heading", "Directory"), ("links", [*links, ("Home", "/")])])
    if path.startswith("/people/"):
        name = unquote(path.removeprefix("/people/"))
        if name not in state.people:
            return None
        links = ("links", [("Answer", "/answer"), ("Directory", "/directory")])
        return Page(name, [("heading", name), ("p", f"Room {state.people[name]}"), links])
    if path == "/answer":
        if form is not None:
            answer = form.get("answer", "")
            state.answers.append(answer)
            return Page("Answer", [("heading", "Answer"), ("p", f"Recorded answer {answer}"), home])
        return Page(
            "Answer", [("heading", "Answer"), ("form", [("Answer", "answer", "")], "Submit"), home]
        )
    return None


class Site:
    """The web app on ``127.0.0.1`` (a free port), which is also the browser's proxy."""

    def __init__(self) -> None:
        self.sessions: dict[str, SiteState] = {}
        self.refused: list[str] = []  # requests for anything but the site, as "METHOD target"
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="trident-web-site", daemon=True
        )
        self.thread.start()

    def open_session(self, people: dict[str, int] | None = None) -> str:
        """A new session id (the ``sid`` cookie) with its own state."""
        sid = uuid.uuid4().hex
        with self.lock:
            self.sessions[sid] = SiteState(people=dict(people or {}))
        return sid

    def close_session(self, sid: str) -> None:
        with self.lock:
            self.sessions.pop(sid, None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a browser that hung up: no news
            super().handle_error(request, client_address)


def _handler(site: Site) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            """No line on stderr per request (the base class writes one)."""

        def do_GET(self) -> None:
            self._serve(None)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode("utf-8", "replace")
            self._serve({k: v[0] for k, v in parse_qs(body).items()})

        def do_CONNECT(self) -> None:  # HTTPS (or a WebSocket over TLS) through the proxy
            self._refuse()

        def _serve(self, form: dict[str, str] | None) -> None:
            url = urlsplit(self.path)
            if (
                url.netloc and url.netloc != urlsplit(site.origin).netloc
            ):  # the browser asks its proxy for another host
                return self._refuse()
            cookies = dict(
                c.strip().split("=", 1)
                for c in self.headers.get("Cookie", "").split(";")
                if "=" in c
            )
            with site.lock:
                state = site.sessions.get(cookies.get("sid", ""))
                page = render(url.path or "/", state, form) if state is not None else None
            if page is None:
                body, status = b"<!doctype html><title>Not found</title><h1>Not found</h1>", 404
            else:
                body, status = page.html().encode(), 200
            self._reply(status, body)

        def _refuse(self) -> None:
            with site.lock:
                site.refused.append(f"{self.command} {self.path}")
            self._reply(403, b"only the environment's site is served")

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

    return Handler
