"""The gate of a nightly fine-tune: is tonight's model good enough to deliver?

A `GateRule` says what a model must do, for instance "held-out pass rate at
least the last delivered model's, no control regression"; `decide` applies it
to an evaluation and says pass or fail in one line. A model that fails is kept
and reported, not delivered.

The last delivered model of a deployment is remembered under the runs
directory, one small record per deployment:
`<runs dir>/.delivered/<deployment>-<hash>.json` (a dot directory, so it is never
taken for a run), written atomically when a model is delivered
(`remember_delivered`) and read by the next night (`last_delivered`). When the
evaluation measured the tuned model against that very GGUF (its SHA-256 is the
plan's `base`), the comparison is on the same items; otherwise the tuned model's
held-out pass rate is compared with the rate the delivered one had.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.evaluation.results import EvaluationResult
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import StoreError
from overbrainer_prefect.store.records import (
    DeploymentRecord,
    RecordChanged,
    RecordError,
    read_record,
    write_record,
)
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.export import NAME_CHARS

DELIVERED_DIR = ".delivered"
"""Under the runs directory: the last delivered model of each deployment."""


class GateError(Exception):
    """The delivered-model record cannot be read or written. The message is one line."""


class GateRule(BaseModel):
    """What a fine-tune must do to be delivered (a flow parameter)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    heldout_at_least_last: bool = Field(
        default=True,
        description="Held-out pass rate at least the last delivered model's (none yet: passes).",
    )
    max_control_regressions: int = Field(
        default=0, ge=0, description="Controls the tuned model may fail that the base passed."
    )
    min_heldout_rate: float | None = Field(
        default=None, ge=0, le=1, description="The lowest held-out pass rate delivered."
    )
    must_beat_base: bool = Field(
        default=False,
        description="The tuned model must beat the base significantly (McNemar p < alpha).",
    )

    def describe(self) -> str:
        """The rule in words, like `held-out pass rate at least the last delivered
        model's, no control regression`."""
        parts = []
        if self.heldout_at_least_last:
            parts.append("held-out pass rate at least the last delivered model's")
        if self.min_heldout_rate is not None:
            parts.append(f"held-out pass rate at least {self.min_heldout_rate:.0%}")
        if self.must_beat_base:
            parts.append("significantly better than base on held-out")
        n = self.max_control_regressions
        parts.append(
            "no control regression" if n == 0 else f"at most {n} control regression{'s' * (n > 1)}"
        )
        return ", ".join(parts)


class Delivered(DeploymentRecord):
    """The last model delivered for a deployment, and how it did on held-out."""

    run_id: str
    evaluation_id: str | None = None
    gguf_path: str = Field(description="The delivered GGUF, relative to the runs directory.")
    gguf_sha256: str
    heldout_passed: int = Field(ge=0)
    heldout_total: int = Field(ge=0)
    delivered: str = Field(description="When it was delivered, RFC 3339 UTC.")

    @property
    def heldout_rate(self) -> float:
        """Its held-out pass rate (0 with no item)."""
        return self.heldout_passed / self.heldout_total if self.heldout_total else 0.0

    @classmethod
    def of(cls, deployment: str, run_id: str, evaluated: EvaluationResult) -> Delivered:
        """The record of run `run_id` of `deployment`, delivered now after `evaluated`."""
        heldout = evaluated.heldout.tuned
        return cls(
            deployment=deployment,
            run_id=run_id,
            evaluation_id=evaluated.evaluation_id,
            gguf_path=evaluated.plan.tuned.path,
            gguf_sha256=evaluated.plan.tuned.sha256,
            heldout_passed=heldout.passed,
            heldout_total=heldout.total,
            delivered=rfc3339(),
        )


class GateDecision(BaseModel):
    """Whether a model passes the gate, and why, in one line. The reason says
    what was measured, never what became of the model: the gate decides before
    anything is delivered."""

    model_config = ConfigDict(extra="forbid")

    passed: bool
    reason: str = Field(
        description="The first criterion failed, or what was checked when all passed."
    )
    evaluation_id: str | None = Field(default=None, description="The evaluation it decided on.")

    @property
    def line(self) -> str:
        """`passed: <what was checked>` or `failed: <the criterion failed>`."""
        return f"{'passed' if self.passed else 'failed'}: {self.reason}"


def decide(rule: GateRule, result: EvaluationResult, last: Delivered | None) -> GateDecision:
    """Applies `rule` to `result`, `last` being the deployment's last delivered
    model (None before the first delivery). The reason names the first criterion
    failed, or what was checked when all pass; the decision names the
    evaluation (`result.evaluation_id`). Never fails."""
    decision = _decide(rule, result, last)
    return decision.model_copy(update={"evaluation_id": result.evaluation_id})


def _decide(rule: GateRule, result: EvaluationResult, last: Delivered | None) -> GateDecision:
    checked = []
    for passed, what in _criteria(rule, result, last):
        if not passed:
            return GateDecision(passed=False, reason=what)
        checked.append(what)
    return GateDecision(passed=True, reason="; ".join(checked))


def _criteria(
    rule: GateRule, result: EvaluationResult, last: Delivered | None
) -> Iterator[tuple[bool, str]]:
    """The rule's criteria in order, each as (passed, what was checked or why it failed)."""
    held = result.heldout
    tuned = f"{held.tuned.passed}/{held.tuned.total}"
    regressions = result.controls.pass_to_fail if result.controls is not None else []
    if len(regressions) > rule.max_control_regressions:
        allowed = rule.max_control_regressions or "none"
        yield (
            False,
            f"{len(regressions)} control regression{'s' * (len(regressions) > 1)} "
            f"({', '.join(regressions)}), the rule allows {allowed}",
        )
        return
    yield (
        True,
        f"{len(regressions)} control regression{'s' * (len(regressions) != 1)}"
        if regressions
        else "no control regression",
    )
    if rule.min_heldout_rate is not None:
        floor = held.tuned.rate >= rule.min_heldout_rate
        yield (
            floor,
            f"held-out {tuned} ≥ {rule.min_heldout_rate:.0%}"
            if floor
            else f"held-out {tuned} = {held.tuned.rate:.0%}, below the rule's "
            f"{rule.min_heldout_rate:.0%}",
        )
    if rule.must_beat_base:
        base = f"{held.base.passed}/{held.base.total}"
        beats = held.tuned.passed > held.base.passed and held.p_value < result.plan.alpha
        yield (
            beats,
            f"beats base {base}"
            if beats
            else f"held-out {tuned} vs base {base} (McNemar p = {held.p_value:.2g}) is not "
            "significantly better",
        )
    if rule.heldout_at_least_last:
        yield _against_last(tuned, result, last)


def _against_last(tuned: str, result: EvaluationResult, last: Delivered | None) -> tuple[bool, str]:
    """The criterion `heldout_at_least_last`: paired on the same items when the
    evaluation's base was the delivered GGUF itself, else by rate."""
    held = result.heldout
    if last is None:
        return True, "no model delivered before"
    run = f"(run {last.run_id})"
    if last.gguf_sha256 == result.plan.base.sha256:
        # measured against the delivered GGUF itself: the same items, paired
        was = f"{held.base.passed}/{held.base.total} on the same items {run}"
        if held.tuned.passed < held.base.passed:
            return False, f"held-out {tuned}, below the last delivered model's {was}"
        return True, f"held-out {tuned} ≥ the last delivered model's {was}"
    was = f"{last.heldout_passed}/{last.heldout_total}"
    if held.tuned.rate < last.heldout_rate:
        return False, (
            f"held-out {tuned} = {held.tuned.rate:.0%}, below the last delivered model's "
            f"{was} = {last.heldout_rate:.0%} {run}"
        )
    return True, f"held-out {tuned} ≥ the last delivered model's {was} {run}"


def deployment_stem(deployment: str) -> str:
    """A deployment's name in file-safe characters and a hash of the exact
    name, so two names never share a record."""
    stem = NAME_CHARS.sub("-", deployment).strip(".-")[:60] or "deployment"
    digest = hashlib.sha256(deployment.encode()).hexdigest()[:12]
    return f"{stem}-{digest}"


def delivered_key(deployment: str) -> str:
    """The key (under the runs directory) of `deployment`'s last delivered model."""
    return f"{DELIVERED_DIR}/{deployment_stem(deployment)}.json"


def last_delivered(runs: Runs, deployment: str) -> Delivered | None:
    """The last model delivered for `deployment`, or None before the first;
    it remembers the version it was read at (`remember_delivered`).

    Raises GateError with one line when the record is there but cannot be read."""
    key = runs.key(delivered_key(deployment))
    try:
        found = read_record(runs.store, key, Delivered, "delivered-model")
    except RecordError as error:
        raise GateError(f"{error}: remove it to gate the next model against none") from None
    if found is None:
        return None
    record, etag = found
    if record.deployment != deployment:
        raise GateError(
            f"{runs.store.where(key)} is the record of another deployment: remove it to gate "
            "the next model against none"
        )
    record._etag = etag
    return record


def remember_delivered(runs: Runs, record: Delivered, gated_against: Delivered | None) -> str:
    """Records `record` as its deployment's last delivered model, only if the
    last delivered model is still `gated_against` (the one the gate measured
    it against; None: there was none): of two flow runs of one deployment
    gated at once, exactly one takes the slot. Returns the record's version.

    Raises GateError with one line when another flow run took it first, or it
    cannot be written."""
    key = runs.key(delivered_key(record.deployment))
    etag = gated_against._etag if gated_against is not None else None
    try:
        return write_record(runs.store, key, record, etag)
    except RecordChanged:
        now = last_delivered(runs, record.deployment)
        raise GateError(
            f"another flow run of {record.deployment} delivered "
            f"{'run ' + now.run_id if now is not None else 'a model'} since run {record.run_id} "
            f"was gated: run {record.run_id} is not delivered; run the fine-tune again to gate "
            "it against the new one"
        ) from None
    except RecordError as error:
        raise GateError(str(error)) from None


def forget_delivered(runs: Runs, record: Delivered, etag: str, previous: Delivered | None) -> None:
    """Puts back `previous` as the last delivered model of `record`'s
    deployment when `record` (at `etag`) took its slot but was not delivered;
    nothing when another flow run changed it since. Raises GateError."""
    key = runs.key(delivered_key(record.deployment))
    try:
        if previous is None:
            found = runs.store.read(key)
            if found is not None and found.etag == etag:
                runs.store.delete(key)
            return
        write_record(runs.store, key, previous, etag)
    except RecordChanged:
        return
    except (RecordError, StoreError) as error:
        raise GateError(str(error)) from None
