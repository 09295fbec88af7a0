"""The ratings store: comparisons, pairs, images, raters, tasks served and votes.

SQLAlchemy 2.0 over SQLite at `<root>/human_eval/ratings.db` by default (WAL mode), or any
SQLAlchemy URL (PostgreSQL for a shared server). Nothing here is read-then-write where a
constraint can do the work: a vote is one transaction, and the unique key on
(rater, pair, question) turns a repeated submission (double click, browser retry, a client
re-sending after a server crash) into a no-op instead of a second vote.

On SQLite every transaction starts with `BEGIN IMMEDIATE`: the write lock is taken up front,
so the assignment of the next task (count the pair's votes, then insert the task) cannot race
with another rater's, and a writer waits (`busy_timeout`) instead of failing on an upgrade. On
a server database (PostgreSQL, at READ COMMITTED) the assignment takes a row lock on its
comparison first (`SELECT ... FOR UPDATE`), so two page loads at once, of one rater or of
several, are assigned one after the other; a unique-key clash that still happens is retried.

A rater never sees an image under the same URL twice: each task's two images are served
under ids of that task (an HMAC of the task and the side, with the store's secret), so a URL
says nothing of which study an image belongs to, nor that two tasks show the same file. The
gold positions of a rater come from the same secret, not from its public sequential id.

Rater and admin tokens are stored as their SHA-256 only: a copy of the database (a backup, a
dump handed to an analyst) holds no working link. The SQLite file is its owner's alone (mode
600).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import hmac
import os
import random
import re
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import (
    Boolean,
    DateTime,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    case,
    create_engine,
    event,
    func,
    insert,
    select,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from kiln_config.errors import NotFound

__all__ = [
    "ANSWERS",
    "QUESTIONS",
    "Comparison",
    "Image",
    "Pair",
    "Rater",
    "RatingStore",
    "Task",
    "Vote",
    "sqlite_url",
    "token_hash",
]

QUESTIONS = ("quality", "alignment")
# A vote's answer names the study side (a, b) or a tie; the screen side is stored beside it.
ANSWERS = ("a", "b", "tie")
# A served task that is neither answered nor this old no longer holds a place on its pair.
TASK_LEASE = dt.timedelta(minutes=15)
# A running app reads a link it knows again after this long: a revoked one stops within it.
RATER_RECHECK_S = 5.0
# What a revoked rater's token column starts with: no SHA-256 in hex does.
REVOKED = "revoked:"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Comparison(Base):
    __tablename__ = "comparisons"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    study_a: Mapped[str] = mapped_column(String(200))
    study_b: Mapped[str] = mapped_column(String(200))
    model_a: Mapped[str] = mapped_column(String(500), default="")
    model_b: Mapped[str] = mapped_column(String(500), default="")
    raters_per_pair: Mapped[int] = mapped_column(Integer)
    gold_per_rater: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)


class Image(Base):
    """An image file known by an unguessable id: URLs carry the id, never a path."""

    __tablename__ = "images"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id"), index=True)
    path: Mapped[str] = mapped_column(Text)


class Pair(Base):
    """One (prompt, seed) with an image from each study, or a gold attention check."""

    __tablename__ = "pairs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id"), index=True)
    prompt_index: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    category: Mapped[str] = mapped_column(String(100))
    seed: Mapped[int] = mapped_column(Integer)
    image_a: Mapped[str] = mapped_column(ForeignKey("images.id"))
    image_b: Mapped[str] = mapped_column(ForeignKey("images.id"))
    # Gold: side b shows a different prompt's image, so the alignment answer is known (a).
    gold: Mapped[bool] = mapped_column(Boolean, default=False)


class Rater(Base):
    __tablename__ = "raters"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id"), index=True)
    pseudonym: Mapped[str] = mapped_column(String(32))
    token: Mapped[str] = mapped_column(String(64), unique=True)  # its SHA-256 (`token_hash`)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)


class Task(Base):
    """A pair served to a rater, with the side shown on the left (randomised per task)."""

    __tablename__ = "tasks_served"
    __table_args__ = (UniqueConstraint("rater_id", "pair_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rater_id: Mapped[int] = mapped_column(ForeignKey("raters.id"), index=True)
    pair_id: Mapped[int] = mapped_column(ForeignKey("pairs.id"), index=True)
    left: Mapped[str] = mapped_column(String(1))
    served_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    answered: Mapped[bool] = mapped_column(Boolean, default=False)


class Vote(Base):
    __tablename__ = "votes"
    __table_args__ = (UniqueConstraint("rater_id", "pair_id", "question"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rater_id: Mapped[int] = mapped_column(ForeignKey("raters.id"), index=True)
    pair_id: Mapped[int] = mapped_column(ForeignKey("pairs.id"), index=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks_served.id"))
    question: Mapped[str] = mapped_column(String(16))
    answer: Mapped[str] = mapped_column(String(3))
    left: Mapped[str] = mapped_column(String(1))
    served_at: Mapped[dt.datetime] = mapped_column(DateTime)
    voted_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)


class Meta(Base):
    """Store-wide settings, such as the admin token (kept across restarts)."""

    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


def sqlite_url(path: str | Path) -> str:
    """`sqlite:///<path>` for the SQLite file `path`: its folder created, the file created
    (or kept) readable by its owner alone; SQLite gives its journal files the same mode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _owner_only(path)
    return f"sqlite:///{path}"


def _owner_only(path: Path) -> None:
    """Create the SQLite file `path` readable by its owner alone, or make it so; a file of
    another user's is left as it is (its owner decides)."""
    if path.parent.is_dir():
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        with contextlib.suppress(PermissionError):
            os.chmod(path, 0o600)


def token_hash(token: str) -> str:
    """What the store keeps of a rater or admin token: its SHA-256, in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


# Meta keys: the admin token's hash, and the mark of a store whose tokens are hashes (a store
# written before it holds them in clear, and `_hash_tokens` converts it once).
_ADMIN = "admin_token_sha256"
_TOKENS_HASHED = "tokens_sha256"
# The store's secret: the ids images are served under, and the raters' gold positions.
_SECRET = "secret"


def _sqlite_engine(url: str, *, writer: bool = True) -> Engine:
    """SQLite in WAL mode, synchronous=FULL (a committed vote survives a power cut), and
    `BEGIN IMMEDIATE` transactions (SQLAlchemy's documented recipe for pysqlite). A reader
    (`writer=False`) begins none: each statement reads a snapshot and takes no write lock."""
    engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # pysqlite's own BEGIN handling off; see "begin"
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        # Freed pages are zeroed: a token replaced by its hash leaves no trace in the file.
        cur.execute("PRAGMA secure_delete=ON")
        cur.close()

    if writer:

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


@dataclass(frozen=True)
class ServedTask:
    """What a rater's page shows: ids only, never a study or model name."""

    task_id: int
    prompt: str
    category: str
    left_image: str
    right_image: str
    done: int
    total: int


class RatingStore:
    """All reads and writes of the ratings database; one session per call."""

    def __init__(self, url: str):
        self.url = url
        if url.startswith("sqlite:///"):  # a database_url naming a file: its owner's alone
            _owner_only(Path(url.removeprefix("sqlite:///")))
        sqlite = url.startswith("sqlite")
        self.engine = _sqlite_engine(url) if sqlite else create_engine(url)
        Base.metadata.create_all(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # Token checks read only: on SQLite through a second engine that takes no write lock,
        # so a flood of unknown links never queues the votes behind it.
        self._reader = _sqlite_engine(url, writer=False) if sqlite else self.engine
        self._read_sessions = sessionmaker(self._reader, expire_on_commit=False)
        self._totals: dict[str, int] = {}
        self._raters: dict[str, tuple[Rater, float]] = {}
        self._lock = threading.Lock() if self.engine.dialect.name == "sqlite" else nullcontext()
        self._hash_tokens()
        self._secret = self._store_secret()

    def _store_secret(self) -> bytes:
        """The store's secret, made once and kept across restarts (two servers starting on a
        new store at once: the second reads the first's)."""
        for attempt in range(2):
            try:
                with self.session() as s:
                    row = s.get(Meta, _SECRET)
                    if row is None:
                        row = Meta(key=_SECRET, value=secrets.token_hex(32))
                        s.add(row)
                    return bytes.fromhex(row.value)
            except IntegrityError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def keyed_random(self, label: str) -> random.Random:
        """A generator seeded by the store's secret and `label`: draws that the repository,
        the config and the studies do not give away."""
        return random.Random(int(self._keyed(label)[:16], 16))

    def _keyed(self, message: str) -> str:
        return hmac.new(self._secret, message.encode(), hashlib.sha256).hexdigest()

    def task_image_id(self, task_id: int, side: str) -> str:
        """The id a task's `left` or `right` image is served under: its own, in no other
        task, and the same at every reload of the task."""
        return self._keyed(f"image:{task_id}:{side}")[:32]

    def _hash_tokens(self) -> None:
        """Replace clear tokens with their hashes, once, in a store written before tokens
        were hashed: its links keep working, and the file stops holding them. Two servers
        starting at once: the second's transaction fails on the mark and finds it done."""
        with contextlib.suppress(IntegrityError), self.session() as s:
            if s.get(Meta, _TOKENS_HASHED) is not None:
                return
            for rater in s.scalars(select(Rater)):
                rater.token = token_hash(rater.token)
            clear = s.get(Meta, "admin_token")
            if clear is not None:
                s.add(Meta(key=_ADMIN, value=token_hash(clear.value)))
                s.delete(clear)
            s.add(Meta(key=_TOKENS_HASHED, value="1"))

    @classmethod
    def open(cls, path: str | Path, url: str | None = None) -> RatingStore:
        """The store at `url` (human_eval.database_url) when given, else the SQLite file
        `path` (the root's, `Layout.ratings_db`)."""
        return cls(url or sqlite_url(path))

    def close(self) -> None:
        """Close the connections: on SQLite, the last one folds the write-ahead log back into
        the database file, so that a copy of `ratings.db` alone holds every vote."""
        self._reader.dispose()
        self.engine.dispose()

    def __enter__(self) -> RatingStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: committed on success, rolled back on any error.

        On SQLite the transactions of this process also take a lock: they queue here in
        order, instead of in SQLite's busy handler, which sleeps in growing steps (a long
        tail of vote latency under load). Other processes still wait on `busy_timeout`.
        """
        with self._lock, self._sessions() as s, s.begin():
            yield s

    # --- comparisons -------------------------------------------------------------------

    def add_comparison(
        self,
        comparison_id: str,
        *,
        study_a: str,
        study_b: str,
        model_a: str,
        model_b: str,
        items: list[dict],
        gold: list[dict],
        raters_per_pair: int,
        gold_per_rater: int,
    ) -> bool:
        """Create a comparison with its pairs; False when it already exists (unchanged).

        Args:
            items: {prompt_index, prompt, category, seed, path_a, path_b} per pair.
            gold: the same keys for gold pairs (path_b: a different prompt's image).
        """
        with self.session() as s:
            if s.get(Comparison, comparison_id) is not None:
                return False
            s.add(
                Comparison(
                    id=comparison_id,
                    study_a=study_a,
                    study_b=study_b,
                    model_a=model_a,
                    model_b=model_b,
                    raters_per_pair=raters_per_pair,
                    gold_per_rater=gold_per_rater,
                )
            )
            s.flush()
            ids: dict[str, str] = {}

            def image_id(path: str) -> str:
                if path not in ids:
                    ids[path] = secrets.token_urlsafe(12)
                    s.add(Image(id=ids[path], comparison_id=comparison_id, path=path))
                return ids[path]

            for is_gold, rows in ((False, items), (True, gold)):
                for it in rows:
                    s.add(
                        Pair(
                            comparison_id=comparison_id,
                            prompt_index=it["prompt_index"],
                            prompt=it["prompt"],
                            category=it["category"],
                            seed=it["seed"],
                            image_a=image_id(it["path_a"]),
                            image_b=image_id(it["path_b"]),
                            gold=is_gold,
                        )
                    )
        return True

    def comparison(self, comparison_id: str) -> Comparison | None:
        with self.session() as s:
            return s.get(Comparison, comparison_id)

    def comparisons(self) -> list[Comparison]:
        with self.session() as s:
            return list(s.scalars(select(Comparison).order_by(Comparison.created_at)))

    # --- raters and tokens -------------------------------------------------------------

    def add_raters(self, comparison_id: str, n: int) -> list[tuple[str, str]]:
        """Invite `n` raters: [(pseudonym, token)]; tokens are unguessable (token_urlsafe),
        returned here once and kept only as their hashes."""
        if self.comparison(comparison_id) is None:
            raise NotFound(f"no comparison {comparison_id!r}; create it with `kiln compare`")
        out = []
        with self.session() as s:
            s.get(Comparison, comparison_id, with_for_update=True)  # one invite at a time
            start = s.scalar(select(func.count()).where(Rater.comparison_id == comparison_id))
            for i in range(n):
                pseudonym, token = f"r{start + i + 1:03d}", secrets.token_urlsafe(24)
                s.add(
                    Rater(comparison_id=comparison_id, pseudonym=pseudonym, token=token_hash(token))
                )
                out.append((pseudonym, token))
        return out

    def rater(self, token: str) -> Rater | None:
        """The rater of a token, read without the write lock. A found rater is memoised for
        `RATER_RECHECK_S`, so a revoked link (`revoke_rater`, from another process) stops
        working within that time."""
        key = token_hash(token)
        known = self._raters.get(key)
        if known is not None and time.monotonic() - known[1] < RATER_RECHECK_S:
            return known[0]
        with self._read_sessions() as s:
            rater = s.scalar(select(Rater).where(Rater.token == key))
        if rater is None:
            self._raters.pop(key, None)
            return None
        self._raters[key] = (rater, time.monotonic())
        return rater

    def revoke_rater(self, comparison_id: str, pseudonym: str) -> int | None:
        """Stop one rater's link from working (their votes are kept): the stored hash is
        replaced by a value no token hashes to. Returns the rater's vote count, or None when
        the comparison has no such rater (or its link is already revoked)."""
        with self.session() as s:
            rater = s.scalar(
                select(Rater).where(
                    Rater.comparison_id == comparison_id,
                    Rater.pseudonym == pseudonym,
                    Rater.token.not_like(f"{REVOKED}%"),
                )
            )
            if rater is None:
                return None
            rater.token = REVOKED + secrets.token_hex(27)
            return s.scalar(select(func.count()).select_from(Vote).where(Vote.rater_id == rater.id))

    def new_admin_token(self, *, rotate: bool = False) -> str | None:
        """A new admin token, when the store has none or `rotate` replaces the one it has (its
        link stops working); None when one exists and is kept. Only its hash is stored, so a
        link is shown once, when it is made."""
        with self.session() as s:
            row = s.get(Meta, _ADMIN)
            if row is not None and not rotate:
                return None
            token = secrets.token_urlsafe(24)
            if row is None:
                s.add(Meta(key=_ADMIN, value=token_hash(token)))
            else:
                row.value = token_hash(token)
            return token

    def is_admin(self, token: str) -> bool:
        """Whether `token` is the admin token (compared as hashes, in constant time; read
        without the write lock)."""
        with self._read_sessions() as s:
            row = s.get(Meta, _ADMIN)
        return row is not None and secrets.compare_digest(token_hash(token), row.value)

    def task_image_path(self, rater: Rater, image_id: str) -> str | None:
        """The file behind an image id of one of the rater's tasks; None for any other id
        (another rater's, a guess, a path)."""
        if not re.fullmatch(r"[0-9a-f]{32}", image_id):
            return None
        with self.session() as s:
            rows = s.execute(
                select(Task.id, Task.left, Pair.image_a, Pair.image_b)
                .join(Pair, Pair.id == Task.pair_id)
                .where(Task.rater_id == rater.id)
            ).all()
            for task_id, left, image_a, image_b in rows:
                for side in ("left", "right"):
                    if hmac.compare_digest(self.task_image_id(task_id, side), image_id):
                        shown = image_a if (side == "left") == (left == "a") else image_b
                        return s.get(Image, shown).path
        return None

    # --- assignment and votes ----------------------------------------------------------

    def next_task(self, rater: Rater, rng: random.Random | None = None) -> ServedTask | None:
        """The rater's open task, else a new one; None when nothing is left for them.

        A reload shows the same task (same left/right). A new task is a gold pair at the
        rater's gold positions (drawn from the store's secret), else a pair they have not seen
        among those with the fewest votes plus live tasks, while it has fewer than K.
        """
        rng = rng or random.Random()
        for attempt in range(3):
            try:
                return self._next_task(rater, rng)
            except IntegrityError:  # a (rater, pair) taken meanwhile: assign again
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _next_task(self, rater: Rater, rng: random.Random) -> ServedTask | None:
        with self.session() as s:
            # The comparison's row lock serialises its assignments (a no-op on SQLite, whose
            # transactions already hold the write lock).
            cmp = s.get(Comparison, rater.comparison_id, with_for_update=True)
            task = s.scalar(select(Task).where(Task.rater_id == rater.id, ~Task.answered))
            done = s.scalar(select(func.count()).where(Task.rater_id == rater.id, Task.answered))
            total = self._total(s, cmp)
            if task is None:
                pair = self._pick_pair(s, cmp, rater, done, rng)
                if pair is None:
                    return None
                task = Task(rater_id=rater.id, pair_id=pair.id, left=rng.choice("ab"))
                s.add(task)
                s.flush()
            pair = s.get(Pair, task.pair_id)
            left, right = self.task_image_id(task.id, "left"), self.task_image_id(task.id, "right")
            return ServedTask(task.id, pair.prompt, pair.category, left, right, done, total)

    def _total(self, s: Session, cmp: Comparison) -> int:
        """Tasks a rater can get at most: the pairs plus their gold checks (memoised: a
        comparison's pairs never change)."""
        if cmp.id not in self._totals:
            n = s.scalar(select(func.count()).where(Pair.comparison_id == cmp.id, ~Pair.gold))
            n_gold = s.scalar(select(func.count()).where(Pair.comparison_id == cmp.id, Pair.gold))
            self._totals[cmp.id] = n + min(cmp.gold_per_rater, n_gold)
        return self._totals[cmp.id]

    def _pick_pair(
        self, s: Session, cmp: Comparison, rater: Rater, done: int, rng: random.Random
    ) -> Pair | None:
        seen = select(Task.pair_id).where(Task.rater_id == rater.id)
        mine = (Pair.comparison_id == cmp.id) & Pair.id.not_in(seen)
        golds = list(s.scalars(select(Pair.id).where(mine, Pair.gold).order_by(Pair.id)))
        total = self._total(s, cmp)
        # The rater's gold positions: spread at random, the same at every visit, and drawn
        # from the store's secret (a rater id is sequential: public).
        k = min(cmp.gold_per_rater, total)
        seed = int(self._keyed(f"gold:{rater.id}")[:16], 16)
        positions = set(random.Random(seed).sample(range(total), k))
        if golds and done in positions:
            return s.get(Pair, rng.choice(golds))
        # A pair's load: its answered tasks plus those served recently and still open.
        live = Task.answered | (Task.served_at > _now() - TASK_LEASE)
        load = (
            select(Task.pair_id, func.count().label("n"))
            .where(live)
            .group_by(Task.pair_id)
            .subquery()
        )
        n = func.coalesce(load.c.n, 0)
        pick = s.scalar(
            select(Pair.id)
            .outerjoin(load, load.c.pair_id == Pair.id)
            .where(mine, ~Pair.gold, n < cmp.raters_per_pair)
            .order_by(n, func.random())  # fewest first, ties at random
            .limit(1)
        )
        if pick is None:
            return s.get(Pair, rng.choice(golds)) if golds else None
        return s.get(Pair, pick)

    def record_vote(self, rater: Rater, task_id: int, answers: dict[str, str]) -> bool:
        """Store one task's answers, given in screen sides (left/right/tie), in one transaction.

        Returns:
            True when stored, False for a repeat (the unique key makes it a no-op).

        Raises:
            KeyError: the task is not this rater's.
            ValueError: a missing question or an answer outside left/right/tie.
        """
        for q in QUESTIONS:
            if answers.get(q) not in ("left", "right", "tie"):
                raise ValueError(f"{q}: answer must be left, right or tie (got {answers.get(q)!r})")
        with self.session() as s:
            task = s.get(Task, task_id)
            if task is None or task.rater_id != rater.id:
                raise KeyError(f"task {task_id} is not served to this rater")
            other = "b" if task.left == "a" else "a"
            side = {"left": task.left, "right": other, "tie": "tie"}
            rows = [
                dict(
                    rater_id=rater.id,
                    pair_id=task.pair_id,
                    task_id=task.id,
                    question=q,
                    answer=side[answers[q]],
                    left=task.left,
                    served_at=task.served_at,
                    voted_at=_now(),
                )
                for q in QUESTIONS
            ]
            inserted = self._insert_votes(s, rows)
            task.answered = True
        return inserted

    def _insert_votes(self, s: Session, rows: list[dict]) -> bool:
        """INSERT ... ON CONFLICT DO NOTHING where the dialect has it (SQLite, PostgreSQL)."""
        name = self.engine.dialect.name
        if name in ("sqlite", "postgresql"):
            if name == "sqlite":
                from sqlalchemy.dialects.sqlite import insert as dialect_insert
            else:
                from sqlalchemy.dialects.postgresql import insert as dialect_insert
            stmt = dialect_insert(Vote).values(rows).on_conflict_do_nothing()
            return s.execute(stmt).rowcount > 0
        try:
            with s.begin_nested():
                s.execute(insert(Vote), rows)
            return True
        except IntegrityError:
            return False

    # --- reads for the admin page and the report ---------------------------------------

    def votes(self, comparison_id: str) -> list[dict]:
        """Every vote of a comparison with its pair and rater, as plain rows."""
        with self.session() as s:
            q = (
                select(Vote, Pair, Rater.pseudonym)
                .join(Pair, Pair.id == Vote.pair_id)
                .join(Rater, Rater.id == Vote.rater_id)
                .where(Pair.comparison_id == comparison_id)
                .order_by(Vote.id)
            )
            return [
                {
                    "vote_id": v.id,
                    "rater": who,
                    "pair_id": p.id,
                    "prompt_index": p.prompt_index,
                    "seed": p.seed,
                    "category": p.category,
                    "prompt": p.prompt,
                    "gold": p.gold,
                    "question": v.question,
                    "answer": v.answer,
                    "left": v.left,
                    "served_at": v.served_at.isoformat(),
                    "voted_at": v.voted_at.isoformat(),
                }
                for v, p, who in s.execute(q)
            ]

    def pairs(self, comparison_id: str) -> list[Pair]:
        with self.session() as s:
            return list(s.scalars(select(Pair).where(Pair.comparison_id == comparison_id)))

    def image_paths(self, comparison_id: str) -> dict[str, str]:
        """Image id -> file path, for every image of a comparison (the report's proxies)."""
        with self.session() as s:
            rows = s.execute(
                select(Image.id, Image.path).where(Image.comparison_id == comparison_id)
            )
            return dict(rows.all())

    def raters(self, comparison_id: str) -> list[Rater]:
        with self.session() as s:
            return list(s.scalars(select(Rater).where(Rater.comparison_id == comparison_id)))

    def progress(self, comparison_id: str) -> tuple[int, int]:
        """(tasks answered on regular pairs, the target: pairs x K) of a comparison."""
        with self.session() as s:
            cmp = s.get(Comparison, comparison_id)
            if cmp is None:
                raise NotFound(f"no comparison {comparison_id!r}")
            regular = (Pair.comparison_id == comparison_id) & ~Pair.gold
            pairs = s.scalar(select(func.count()).where(regular))
            k = cmp.raters_per_pair
            per_pair = (
                select(func.count().label("n"))
                .select_from(Vote)
                .join(Pair, Pair.id == Vote.pair_id)
                .where(regular, Vote.question == QUESTIONS[0])
                .group_by(Vote.pair_id)
                .subquery()
            )
            # A pair past K (a lapsed task taken again) must not make up for one short of K.
            capped = case((per_pair.c.n > k, k), else_=per_pair.c.n)  # LEAST(n, K), portable
            done = s.scalar(select(func.coalesce(func.sum(capped), 0)))
            return done, pairs * k

    def count_votes(self, comparison_id: str | None = None) -> int:
        with self.session() as s:
            q = select(func.count()).select_from(Vote)
            if comparison_id is not None:
                q = q.join(Pair, Pair.id == Vote.pair_id).where(Pair.comparison_id == comparison_id)
            return s.scalar(q)
