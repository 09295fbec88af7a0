"""The ratings store: idempotent votes, assignment to K raters per pair, gold checks."""

import random
import sqlite3
from pathlib import Path

import pytest

from human_eval.store import Image, RatingStore, sqlite_url
from human_eval.studies import StudyMismatch, create_comparison, load_study
from tasks.storage.layout import Layout

from .conftest import PROMPTS, write_study

K = {"raters_per_pair": 5, "gold": 10}


def _store(root):
    return RatingStore.open(Layout(root).ratings_db())


def test_database_is_sqlite_in_wal_mode_under_the_root(two_studies):
    root, _, _ = two_studies
    store = _store(root)
    store.new_admin_token()
    assert sqlite_url(Layout(root).ratings_db()).endswith("human_eval/ratings.db")
    con = sqlite3.connect(root / "human_eval" / "ratings.db")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"comparisons", "pairs", "raters", "tasks_served", "votes", "images"} <= tables


def test_comparison_is_created_once(two_studies):
    root, a, b = two_studies
    store = _store(root)
    sa, sb = load_study("run-a-1111", Layout(root).folder("eval")), load_study(b)
    cid, created = create_comparison(store, sa, sb, raters_per_pair=2, gold=2)
    assert created and cid.startswith("cmp-")
    assert create_comparison(store, sa, sb, raters_per_pair=2, gold=2) == (cid, False)
    pairs = store.pairs(cid)
    assert sum(not p.gold for p in pairs) == 8 and sum(p.gold for p in pairs) == 2
    with store.session() as s:
        for p in pairs:
            path_a, path_b = s.get(Image, p.image_a).path, s.get(Image, p.image_b).path
            assert path_a != path_b
            if p.gold:  # both sides from one study: its image of the prompt, and of another
                assert Path(path_a).parents[1] == Path(path_b).parents[1]
            else:
                assert path_a.startswith(str(a)) and path_b.startswith(str(b))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seeds": (0, 2)}, "seeds differ"),
        ({"prompts": PROMPTS[:3]}, "prompts differ"),
        ({"prompts": [("Another prompt.", "Colors"), *PROMPTS[1:]]}, "first difference"),
        ({"size": 48}, "image sizes differ"),
    ],
)
def test_mismatched_studies_are_refused(two_studies, kwargs, message):
    root, a, _ = two_studies
    other = write_study(root, "run-c-3333", **{"seeds": (0, 1), **kwargs})
    with pytest.raises(StudyMismatch, match=message):
        create_comparison(_store(root), load_study(a), load_study(other), **K)


def test_same_study_twice_and_missing_study_are_clear_errors(two_studies):
    root, a, _ = two_studies
    with pytest.raises(StudyMismatch, match="same study"):
        create_comparison(_store(root), load_study(a), load_study(a), **K)
    with pytest.raises(FileNotFoundError, match="run `kiln evaluate`"):
        load_study("nope", Layout(root).folder("eval"))


def _answer(store, rater, rng, answers=None):
    task = store.next_task(rater, rng)
    if task is None:
        return None
    answers = answers or {"quality": "left", "alignment": "tie"}
    return task, store.record_vote(rater, task.task_id, answers)


def test_repeated_vote_is_a_no_op(two_studies):
    root, a, b = two_studies
    store = _store(root)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=5, gold=0)
    ((_, token),) = store.add_raters(cid, 1)
    rater = store.rater(token)
    task = store.next_task(rater)
    assert store.next_task(rater) == task  # a reload shows the same task, same sides
    assert store.record_vote(rater, task.task_id, {"quality": "left", "alignment": "right"})
    assert not store.record_vote(rater, task.task_id, {"quality": "right", "alignment": "tie"})
    votes = store.votes(cid)
    assert len(votes) == 2
    by_q = {v["question"]: v for v in votes}
    left = by_q["quality"]["left"]
    assert by_q["quality"]["answer"] == left  # the left image's study
    assert by_q["alignment"]["answer"] == ("b" if left == "a" else "a")
    with pytest.raises(ValueError, match="left, right or tie"):
        store.record_vote(rater, task.task_id, {"quality": "A", "alignment": "tie"})
    ((_, other),) = store.add_raters(cid, 1)
    with pytest.raises(KeyError):
        store.record_vote(store.rater(other), task.task_id, {"quality": "left", "alignment": "tie"})


def test_assignment_gives_every_pair_k_votes_fewest_first(two_studies):
    root, a, b = two_studies
    store = _store(root)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=3, gold=0)
    raters = [store.rater(t) for _, t in store.add_raters(cid, 5)]
    rng = random.Random(0)
    counts = {p.id: 0 for p in store.pairs(cid)}
    seen: dict[int, set] = {r.id: set() for r in raters}
    for _ in range(8):  # round-robin, as raters arrive
        for r in raters:
            eligible = [c for p, c in counts.items() if p not in seen[r.id] and c < 3]
            got = _answer(store, r, rng)
            assert (got is None) == (not eligible)
            if got is not None:
                pair = store.votes(cid)[-1]["pair_id"]
                # fewest first: among the pairs this rater has not rated
                assert counts[pair] == min(eligible)
                counts[pair] += 1
                seen[r.id].add(pair)
    assert set(counts.values()) == {3}  # every pair has K votes, none more
    assert all(store.next_task(r) is None for r in raters)
    assert store.count_votes(cid) == 8 * 3 * 2


def test_gold_pairs_are_served_to_every_rater(two_studies):
    root, a, b = two_studies
    store = _store(root)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=1, gold=3)
    raters = [store.rater(t) for _, t in store.add_raters(cid, 2)]
    rng = random.Random(1)
    progress = []
    for r in raters:
        while (task := store.next_task(r, rng)) is not None:
            progress.append((task.done, task.total))
            store.record_vote(r, task.task_id, {"quality": "tie", "alignment": "left"})
    votes = store.votes(cid)
    gold = {(v["rater"], v["pair_id"]) for v in votes if v["gold"]}
    assert len(gold) == 6  # 3 per rater
    regular = [v for v in votes if not v["gold"] and v["question"] == "quality"]
    assert len(regular) == 8  # K = 1: each pair once over both raters
    assert progress[0] == (0, 11)  # 8 pairs + 3 gold


def test_progress_counts_at_most_k_votes_a_pair(two_studies):
    """A pair over K (a lapsed task taken again by another rater) does not make up for a pair
    short of K: the flow would otherwise report before every pair had its votes."""
    import datetime as dt

    from human_eval.store import Task, Vote

    root, a, b = two_studies
    store = _store(root)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=1, gold=0)
    first, second = (store.rater(t) for _, t in store.add_raters(cid, 2))
    task = store.next_task(first)
    store.record_vote(first, task.task_id, {"quality": "left", "alignment": "left"})
    pair = store.votes(cid)[-1]["pair_id"]
    with store.session() as s:  # the second rater answers the same pair: over K
        served = Task(rater_id=second.id, pair_id=pair, left="a")
        s.add(served)
        s.flush()
        for q in ("quality", "alignment"):
            s.add(
                Vote(
                    rater_id=second.id,
                    pair_id=pair,
                    task_id=served.id,
                    question=q,
                    answer="a",
                    left="a",
                    served_at=dt.datetime.now(dt.UTC),
                )
            )
    done, target = store.progress(cid)
    assert (done, target) == (1, len(store.pairs(cid)))


def test_a_store_with_clear_tokens_keeps_its_links_and_drops_the_tokens(tmp_path):
    """A ratings database written before tokens were hashed: opened once, its rater and
    admin links keep working and the file no longer holds them."""
    db = tmp_path / "ratings.db"
    con = sqlite3.connect(db)
    con.executescript(
        """
        CREATE TABLE comparisons (id VARCHAR(64) PRIMARY KEY, study_a VARCHAR(200),
            study_b VARCHAR(200), model_a VARCHAR(500), model_b VARCHAR(500),
            raters_per_pair INTEGER, gold_per_rater INTEGER, created_at DATETIME);
        CREATE TABLE raters (id INTEGER PRIMARY KEY, comparison_id VARCHAR(64),
            pseudonym VARCHAR(32), token VARCHAR(64) UNIQUE, created_at DATETIME);
        CREATE TABLE meta (key VARCHAR(64) PRIMARY KEY, value TEXT);
        INSERT INTO comparisons VALUES ('cmp-1', 'a', 'b', '', '', 3, 0, '2026-01-01');
        INSERT INTO raters VALUES (1, 'cmp-1', 'r001', 'clear-rater-token', '2026-01-01');
        INSERT INTO meta VALUES ('admin_token', 'clear-admin-token');
        """
    )
    con.commit()
    con.close()
    store = RatingStore.open(db)
    assert store.rater("clear-rater-token").pseudonym == "r001"
    assert store.is_admin("clear-admin-token") and not store.is_admin("clear-rater-token")
    store.close()
    again = RatingStore.open(db)  # converted once: a second open changes nothing
    assert again.rater("clear-rater-token").pseudonym == "r001"
    assert again.is_admin("clear-admin-token")
    again.close()
    assert b"clear-rater-token" not in db.read_bytes()
    assert b"clear-admin-token" not in db.read_bytes()
