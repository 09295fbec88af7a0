"""The champion gate: move `champion` to a candidate only when people prefer it.

A consumer loads `models:/<name>@champion`. This module is the only code that moves that
alias (`kiln promote`, `kiln rollback`, `flows/promote.py`):

* `promote` reads the candidate's human-evaluation numbers from MLflow (the metrics
  `flows/human_evaluation.py` logs on its training run, and the `human_eval.against` tag on its
  version), checks them with `gate`, and on a pass moves `champion` to the candidate and the
  old champion to `previous-champion`. With no champion yet it needs `first=True`;
  `force=True` (with a reason) promotes past a refused gate.
* A version whose dataset holds a taken-down image (its `kiln.takedown.images` tag,
  tasks/registry/model_lineage.py) is refused whatever its numbers, unless `allow_takedown=True`
  with a reason, which is recorded on the version (`kiln.promotion.takedown_override`).
* `rollback` swaps `champion` and `previous-champion` back.

Every decision, passed or refused, is written as `kiln.promotion.*` tags on the candidate's
version, with the numbers it read, so the registry itself is the audit log.
"""

from __future__ import annotations

import getpass
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from kiln_config import GateConfig, KilnError
from tasks.registry.model_lineage import TAKEDOWN_TAG
from tasks.registry.tracking import ModelVersionNotFound, model_version

__all__ = [
    "CHAMPION",
    "PREVIOUS",
    "Decision",
    "PromotionRefused",
    "gate",
    "promote",
    "registered_version",
    "rollback",
]

CHAMPION = "champion"
PREVIOUS = "previous-champion"
QUESTIONS = ("quality", "alignment")
VAL_LOSS = "ema/val/loss"  # the training run's held-out loss, when both have it


class PromotionRefused(KilnError, RuntimeError):
    """The gate refused the candidate, or the request itself is invalid; the message says why."""


@dataclass
class Decision:
    passed: bool
    checks: list[dict] = field(default_factory=list)  # {check, ok, detail}

    def add(self, check: str, ok: bool, detail: str) -> None:
        self.checks.append({"check": check, "ok": bool(ok), "detail": detail})
        self.passed = self.passed and bool(ok)

    @property
    def failures(self) -> list[str]:
        return [f"{c['check']}: {c['detail']}" for c in self.checks if not c["ok"]]


def gate(
    metrics: dict[str, float],
    tags: dict[str, str],
    champion_ids: set[str],
    cfg: GateConfig,
    champion_metrics: dict[str, float] | None = None,
) -> Decision:
    """Check a candidate's human-evaluation numbers (and its validation loss) against `cfg`.

    Args:
        metrics: The candidate's training-run metrics (latest values).
        tags: The candidate version's tags (`human_eval.comparison`, `human_eval.against`).
        champion_ids: Names the champion goes by in a comparison (its run id, `name-vN`).
        cfg: `registry.gate`.
        champion_metrics: The champion's training-run metrics, for the validation-loss check.
    """
    d = Decision(passed=True)
    cid, against = tags.get("human_eval.comparison"), tags.get("human_eval.against")
    d.add(
        "comparison",
        bool(cid) and against in champion_ids,
        f"{cid or 'none'} against {against or 'nothing'} (champion is "
        f"{' or '.join(sorted(champion_ids))})",
    )
    for q in QUESTIONS:
        votes = metrics.get(f"human_eval/{q}_min_votes_per_pair")
        d.add(
            f"{q} votes",
            votes is not None and votes >= cfg.min_votes_per_pair,
            f"fewest votes on a pair {_fmt(votes)}, need {cfg.min_votes_per_pair}",
        )
        low = metrics.get(f"human_eval/{q}_pref_ci_low")
        d.add(
            f"{q} preference",
            low is not None and low >= cfg.min_pref_ci_low,
            f"95% CI low {_fmt(low)}, need >= {cfg.min_pref_ci_low}",
        )
        cats = {
            k.split("/", 2)[-1]: v
            for k, v in metrics.items()
            if k.startswith(f"human_eval/{q}_pref/")
        }
        worst = min(cats.items(), key=lambda kv: kv[1]) if cats else None
        d.add(
            f"{q} categories",
            worst is not None and worst[1] >= cfg.min_category_pref,
            (f"lowest {worst[0]} {_fmt(worst[1])}" if worst else "no per-category numbers")
            + f", need >= {cfg.min_category_pref}",
        )
    mine, theirs = metrics.get(VAL_LOSS), (champion_metrics or {}).get(VAL_LOSS)
    if mine is not None and theirs is not None:
        limit = theirs * (1 + cfg.max_val_loss_increase)
        d.add(
            "validation loss",
            mine <= limit,
            f"{mine:.5g} vs champion {theirs:.5g} (limit {limit:.5g})",
        )
    return d


def _fmt(x: float | None) -> str:
    return "missing" if x is None else f"{x:.4g}"


def registered_version(client: MlflowClient, ref: str):
    """The ModelVersion of models:/NAME@ALIAS or models:/NAME/VERSION.

    Raises:
        ValueError: `ref` is not such a URI.
        PromotionRefused: the alias or version does not exist.
    """
    try:
        return model_version(client, ref)
    except ModelVersionNotFound as e:
        raise PromotionRefused(str(e)) from e


def _alias(client: MlflowClient, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _ids(mv) -> set[str]:
    """Names a version goes by in a human-evaluation comparison (see flows/human_evaluation.py)."""
    return {x for x in (mv.tags.get("run_id"), f"{mv.name}-v{mv.version}") if x}


def _run_metrics(client: MlflowClient, mv) -> dict[str, float]:
    return dict(client.get_run(mv.run_id).data.metrics) if mv.run_id else {}


def _record(client: MlflowClient, mv, outcome: str, decision: Decision | None, **extra) -> dict:
    record = {
        "outcome": outcome,
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "by": getpass.getuser(),
        **extra,
        "checks": decision.checks if decision else [],
    }
    tags = {
        "kiln.promotion.outcome": outcome,
        "kiln.promotion.at": record["at"],
        "kiln.promotion.by": record["by"],
        "kiln.promotion.checks": json.dumps(record["checks"])[:5000],
        **{f"kiln.promotion.{k}": str(v) for k, v in extra.items() if v is not None},
    }
    for k, v in tags.items():
        client.set_model_version_tag(mv.name, mv.version, k, v)
    return record


def promote(
    tracking_uri: str,
    candidate: str,
    cfg: GateConfig,
    *,
    first: bool = False,
    force: bool = False,
    reason: str | None = None,
    allow_takedown: bool = False,
) -> dict:
    """Move `champion` to `candidate` if the gate passes (or `first`/`force` allows it).

    A candidate whose dataset holds a taken-down image is refused unless `allow_takedown`,
    which needs a `reason` too.

    Returns:
        The decision record (also written as tags on the candidate's version): outcome
        (`promoted`, `first`, `forced`), the checks, the versions involved.

    Raises:
        PromotionRefused: the gate failed (the message lists each failed check and the
            override), or the request is invalid (already champion, `--first` with a
            champion, `--force` without a reason). A refusal is recorded on the version too.
    """
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    mv = registered_version(client, candidate)
    name = mv.name
    champ = _alias(client, name, CHAMPION)
    if force and not (reason or "").strip():
        raise PromotionRefused("--force needs --reason TEXT: say why the gate is overridden")
    _check_takedowns(client, mv, allow_takedown, reason)
    if champ is not None and champ.version == mv.version:
        raise PromotionRefused(f"{name} version {mv.version} is already {CHAMPION}")
    if champ is None and not first:
        raise PromotionRefused(
            f"{name} has no {CHAMPION} yet, so there is nothing to compare against: promote "
            "the first one with --first"
        )
    if champ is not None and first:
        raise PromotionRefused(
            f"--first is only for a registry with no {CHAMPION}; {name} has version {champ.version}"
        )
    decision = None
    if champ is None:
        outcome = "first"
    else:
        decision = gate(
            _run_metrics(client, mv), mv.tags, _ids(champ), cfg, _run_metrics(client, champ)
        )
        outcome = "promoted" if decision.passed else ("forced" if force else "refused")
    previous = champ.version if champ is not None else None
    if outcome == "refused":
        _record(client, mv, outcome, decision, champion=previous)
        raise PromotionRefused(
            f"{name} version {mv.version} not promoted over version {previous}:\n  "
            + "\n  ".join(decision.failures)
            + "\nCollect more votes or retrain; or override with --force --reason TEXT."
        )
    if champ is not None:
        client.set_registered_model_alias(name, PREVIOUS, champ.version)
    client.set_registered_model_alias(name, CHAMPION, mv.version)
    down = int(mv.tags.get(TAKEDOWN_TAG) or 0)
    record = _record(
        client,
        mv,
        outcome,
        decision,
        previous_champion=previous,
        reason=reason if force or first or down else None,
        takedown_override=reason if down else None,
    )
    return {
        "name": name,
        "version": mv.version,
        "previous_champion": previous,
        **record,
        "passed": decision.passed if decision else None,
    }


def _check_takedowns(client: MlflowClient, mv, allow: bool, reason: str | None) -> None:
    """Refuse a version whose dataset holds taken-down images, unless overridden with a
    reason (the refusal is recorded on the version too)."""
    down = int(mv.tags.get(TAKEDOWN_TAG) or 0)
    if not down:
        return
    if allow and (reason or "").strip():
        return
    _record(client, mv, "refused", None, takedown_images=down)
    raise PromotionRefused(
        f"{mv.name} version {mv.version} trained on a dataset holding {down} taken-down "
        f"images ({TAKEDOWN_TAG}={down}): retrain without them, or override with "
        "--allow-takedown --reason TEXT (recorded on the version)"
    )


def rollback(tracking_uri: str, model_name: str, reason: str | None = None) -> dict:
    """Swap `champion` and `previous-champion`; tag both versions with the rollback.

    Raises:
        PromotionRefused: there is no previous champion to go back to.
    """
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    champ, prev = _alias(client, model_name, CHAMPION), _alias(client, model_name, PREVIOUS)
    if champ is None or prev is None:
        raise PromotionRefused(
            f"{model_name} has no {PREVIOUS} to roll back to "
            f"({CHAMPION}: {champ.version if champ else 'none'})"
        )
    client.set_registered_model_alias(model_name, CHAMPION, prev.version)
    client.set_registered_model_alias(model_name, PREVIOUS, champ.version)
    at = datetime.now(UTC).isoformat(timespec="seconds")
    who = getpass.getuser()
    for mv, role in ((champ, "rolled back from"), (prev, "rolled back to")):
        note = f"{role} at {at} by {who}: {reason or 'no reason given'}"
        client.set_model_version_tag(model_name, mv.version, "kiln.rollback", note)
    return {"name": model_name, "champion": prev.version, PREVIOUS: champ.version, "at": at}
