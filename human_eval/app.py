"""The blind A/B rating app: FastAPI with server-rendered Jinja2 pages, no front-end build.

    kiln rate serve --config C

Routers per concern: rating pages, images, admin; access checks are dependencies
(`rater_from_token`, `admin_from_token`), so no handler can forget one. A rater sees the
prompt, its category and two images labelled A (left) and B (right); which study made which
image is never on the page, and left/right is drawn per task and stored with the vote. Images
are served under ids of their own task (`RatingStore.task_image_id`), looked up in the
database, so no URL part ever reaches the file system and no URL repeats across tasks, and as
a PNG encoded afresh from the pixels: no file time (Last-Modified, ETag),
text, EXIF or time chunk tells two studies apart; each file is encoded once and kept (a
bounded cache). The form posts as application/x-www-form-urlencoded, parsed here (no
python-multipart needed) within a few KiB and fields (`MAX_FORM_BYTES`, `MAX_FORM_FIELDS`); a
page works without JavaScript, and `static/rate.js` adds the keyboard (1/2/3, Enter).
"""

from __future__ import annotations

import functools
import io
import logging
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from fastapi.templating import Jinja2Templates
from PIL import Image as PILImage

from human_eval.report import gold_accuracy, summarize_comparison
from human_eval.store import QUESTIONS, Rater, RatingStore

__all__ = ["BadTokenLimit", "blind_png", "create_app", "serve"]

log = logging.getLogger("kiln.human_eval")
HERE = Path(__file__).resolve().parent
QUESTION_TEXT = {
    "quality": "Which image is of higher quality?",
    "alignment": "Which image better represents the text caption?",
}
# Defence in depth beside autoescaping: no inline script runs, no page frames ours, and the
# token in the URL is never sent to another site as a referrer.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; img-src 'self'; script-src 'self'; "
    "style-src 'self' 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


# A vote is a task id and two answers: a body or a field count past these is no vote.
MAX_FORM_BYTES = 4096
MAX_FORM_FIELDS = 16


def blind_png(path: str | Path) -> bytes:
    """The image's pixels as a new RGB PNG (`_encoded`), encoded once per version of the file
    (its path, size and modification time), whichever task shows it."""
    st = Path(path).stat()
    return _encoded(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _encoded(path: str, size: int, mtime_ns: int) -> bytes:
    """The image's pixels as a new RGB PNG with the same encoder settings for every image.

    The pixels go through a bare array into a new image, so nothing of the file's `info`
    (text, EXIF, ICC profile, dpi) reaches the encoder: the bytes are IHDR, IDAT and IEND,
    a function of the pixels alone, whichever study, tool or day wrote the file.
    """
    import numpy as np

    with PILImage.open(path) as im:
        pixels = np.asarray(im.convert("RGB"))
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, format="PNG", compress_level=6)
    return out.getvalue()


def _store(request: Request) -> RatingStore:
    return request.app.state.store


class BadTokenLimit:
    """Unknown links per client address: after `limit` of them within `window_s`, every
    link from that address is refused (429, with Retry-After) until the window has passed,
    so guessing tokens is bounded and a flood of them costs the store nothing. At most
    `max_addresses` addresses are tracked (the oldest forgotten first)."""

    def __init__(self, limit: int = 20, window_s: float = 60.0, max_addresses: int = 10_000):
        self.limit, self.window_s, self.max_addresses = limit, window_s, max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def _recent(self, address: str, now: float) -> deque[float]:
        times = self._failures.get(address, deque())
        while times and now - times[0] > self.window_s:
            times.popleft()
        return times

    def check(self, address: str) -> None:
        """Raises a 429 while `address` is over its limit."""
        now = time.monotonic()
        with self._lock:
            times = self._recent(address, now)
            if len(times) >= self.limit:
                wait = int(self.window_s - (now - times[0])) + 1
                raise HTTPException(
                    status_code=429,
                    detail="too many unknown links from this address: wait, then try again",
                    headers={"Retry-After": str(wait)},
                )

    def failed(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            times = self._recent(address, now)
            times.append(now)
            self._failures[address] = times
            self._failures.move_to_end(address)
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)


def _address(request: Request) -> str:
    return request.client.host if request.client else ""


def rater_from_token(token: str, request: Request, store: RatingStore = Depends(_store)) -> Rater:
    """The rater a link belongs to; an unknown or revoked token is 403 (never says whether it
    exists), and counts against its address (`BadTokenLimit`)."""
    limit: BadTokenLimit = request.app.state.bad_tokens
    limit.check(_address(request))
    rater = store.rater(token)
    if rater is None:
        limit.failed(_address(request))
        raise HTTPException(status_code=403, detail="unknown rating link")
    return rater


def admin_from_token(token: str, request: Request, store: RatingStore = Depends(_store)) -> None:
    """The admin token only: a rater token is 403 here (compared in constant time), and
    counts against its address as an unknown one does."""
    limit: BadTokenLimit = request.app.state.bad_tokens
    limit.check(_address(request))
    if not store.is_admin(token):
        limit.failed(_address(request))
        raise HTTPException(status_code=403, detail="admin token required")


async def form_fields(request: Request) -> dict[str, str]:
    """An urlencoded form body as {field: last value}, read no further than `MAX_FORM_BYTES`
    (413 past it, whatever Content-Length says) and parsed into `MAX_FORM_FIELDS` fields at
    most (400 past them)."""
    too_big = HTTPException(status_code=413, detail=f"a vote is at most {MAX_FORM_BYTES} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_FORM_BYTES:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise too_big
    try:
        fields = parse_qs(
            body.decode("utf-8", errors="replace"),
            keep_blank_values=True,
            max_num_fields=MAX_FORM_FIELDS,
        )
    except ValueError as e:  # more fields than a vote has
        raise HTTPException(status_code=400, detail=f"not a vote: {e}") from e
    return {k: v[-1] for k, v in fields.items()}


def _rating_router(templates: Jinja2Templates) -> APIRouter:
    router = APIRouter(prefix="/rate/{token}")

    @router.get("", response_class=HTMLResponse)
    def task_page(
        request: Request,
        token: str,
        rater: Rater = Depends(rater_from_token),
        store: RatingStore = Depends(_store),
    ):
        task = store.next_task(rater)
        if task is None:
            return templates.TemplateResponse(request, "done.html", {})
        ctx = {"token": token, "task": task, "questions": QUESTION_TEXT}
        return templates.TemplateResponse(request, "task.html", ctx)

    @router.post("/vote")
    def vote(
        token: str,
        rater: Rater = Depends(rater_from_token),
        store: RatingStore = Depends(_store),
        form: dict = Depends(form_fields),
    ):
        try:
            task_id = int(form.get("task_id", ""))
            if not 0 < task_id < 2**63:  # beyond SQL's INTEGER: a 400, not a 500
                raise ValueError(f"task_id out of range ({task_id})")
            store.record_vote(rater, task_id, {q: form.get(q, "") for q in QUESTIONS})
        except ValueError as e:
            raise HTTPException(status_code=400, detail=f"answer both questions: {e}") from e
        except KeyError as e:
            raise HTTPException(status_code=404, detail="no such task") from e
        # Post/redirect/get: a reload never re-posts, and the next page is the next task.
        return RedirectResponse(f"/rate/{token}", status_code=303)

    @router.get("/image/{image_id}")
    def image(
        image_id: str, rater: Rater = Depends(rater_from_token), store=Depends(_store)
    ) -> Response:
        path = store.task_image_path(rater, image_id)
        if path is None:
            raise HTTPException(status_code=404, detail="no such image")
        # Not a FileResponse: its Last-Modified and ETag come from the file's time and size.
        body = blind_png(path)
        return Response(body, media_type="image/png", headers={"Cache-Control": "private"})

    return router


def _admin_router(templates: Jinja2Templates) -> APIRouter:
    router = APIRouter(prefix="/admin/{token}", dependencies=[Depends(admin_from_token)])

    @router.get("", response_class=HTMLResponse)
    def admin_page(request: Request, store: RatingStore = Depends(_store)):
        settings = request.app.state.report_settings
        rows = [_progress(store, c, settings) for c in store.comparisons()]
        ctx = {"comparisons": rows, "settings": settings}
        return templates.TemplateResponse(request, "admin.html", ctx)

    return router


def _progress(store: RatingStore, cmp, settings: dict) -> dict:
    """A comparison's progress per category and per rater, and its result so far (the
    report's own statistics, with the report's settings), for the admin page."""
    pairs = [p for p in store.pairs(cmp.id) if not p.gold]
    all_votes = store.votes(cmp.id)
    result = summarize_comparison(store, cmp.id, votes=all_votes, **settings)
    votes = [v for v in all_votes if v["question"] == "quality"]
    cats: dict[str, dict] = {}
    for p in pairs:
        cats.setdefault(p.category or "-", {"pairs": 0, "votes": 0})["pairs"] += 1
    for v in votes:
        if not v["gold"]:
            cats[v["category"] or "-"]["votes"] += 1
    for c in cats.values():
        c["target"] = c["pairs"] * cmp.raters_per_pair
    gold = gold_accuracy(all_votes)
    raters = []
    for r in store.raters(cmp.id):
        done = sum(v["rater"] == r.pseudonym for v in votes)
        correct, n = gold.get(r.pseudonym, (0, 0))
        raters.append({"rater": r.pseudonym, "done": done, "gold": f"{correct}/{n}"})
    return {
        "comparison": cmp,
        "categories": dict(sorted(cats.items())),
        "raters": raters,
        "votes": sum(c["votes"] for c in cats.values()),
        "target": sum(c["target"] for c in cats.values()),
        "result": result,
        "questions": {
            q: {"alpha": r["alpha"], "groups": {"overall": r["overall"], **r["categories"]}}
            for q, r in result["questions"].items()
        },
    }


def _fmt(x: float | None) -> str:
    """A rate on the admin page: three decimals, "-" where undefined (NaN or None)."""
    return "-" if x is None or x != x else f"{x:.3f}"


def create_app(
    store: RatingStore,
    *,
    min_gold_accuracy: float,
    n_resamples: int,
    seed: int,
    bad_links_per_minute: int = 60,
) -> FastAPI:
    """The rating app over `store` (every route reads it from `app.state`).

    The admin page's running result uses the report's settings: give it those of
    `kiln rate report` (human_eval.min_gold_accuracy, bootstrap_resamples, seed), and it
    shows the numbers the report would write now. An address that sends more than
    `bad_links_per_minute` unknown links is refused for the rest of the minute.
    """
    templates = Jinja2Templates(directory=str(HERE / "templates"))  # autoescape on for .html
    templates.env.globals["fmt"] = _fmt
    app = FastAPI(title="Kiln human evaluation", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store = store
    app.state.bad_tokens = BadTokenLimit(limit=bad_links_per_minute)
    app.state.report_settings = {
        "min_gold_accuracy": min_gold_accuracy,
        "n_resamples": n_resamples,
        "seed": seed,
    }
    app.include_router(_rating_router(templates))
    app.include_router(_admin_router(templates))

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        for k, v in SECURITY_HEADERS.items():
            response.headers.setdefault(k, v)
        return response

    @app.api_route("/rate", methods=["GET", "POST"], include_in_schema=False)
    @app.api_route("/rate/", methods=["GET", "POST"], include_in_schema=False)
    @app.api_route("/admin", methods=["GET"], include_in_schema=False)
    @app.api_route("/admin/", methods=["GET"], include_in_schema=False)
    def missing_token():
        raise HTTPException(status_code=403, detail="a token is required")

    @app.get("/static/rate.js")
    def script() -> FileResponse:
        return FileResponse(HERE / "static" / "rate.js", media_type="text/javascript")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/healthz", response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok"

    return app


def serve(store: RatingStore, host: str, port: int, **report_settings) -> None:
    """Run the app with uvicorn until SIGINT or SIGTERM (`kiln rate serve` starts it).

    `report_settings`: `create_app`'s min_gold_accuracy, n_resamples, seed and
    bad_links_per_minute.
    """
    import uvicorn

    uvicorn.run(create_app(store, **report_settings), host=host, port=port, log_level="warning")
