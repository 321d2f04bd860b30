"""Audit an artifact: re-hash it and its whole input chain, and check every provenance link.

For each artifact reached, the audit checks, in this order:

1. it has an Artifact row, its bytes are in the store, and they hash to the row's digest
   and size (a changed file is reported as "tampered", with both digests); bytes that
   `bonsai gc` removed are not a problem: the node says "bytes not retained";
2. it has at least one provenance statement, each of which names it as subject, was made
   by a run that recorded it as an output, and lists exactly the inputs that run recorded;
3. when a public key is given, each statement carries a valid DSSE signature by that key
   and the signed statement equals the stored one;

then it walks on to every input named in the statements' resolvedDependencies, down to
the downloaded source files (download outputs have no inputs). Each artifact is checked
once however many statements name it. Problems are listed in the order the walk met
them; the first one is the "first broken link" that `bonsai audit` names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.artifacts.store import ArtifactStore
from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.states import LinkDirection, StageName, StageState
from pipeline.db.models import Artifact, Provenance, StageRun
from pipeline.provenance.statements import PREDICATE_TYPE, STATEMENT_TYPE

__all__ = [
    "Problem",
    "AuditReport",
    "resolve_artifact",
    "job_gguf",
    "audit_artifact",
    "statement_name",
]

_MIN_PREFIX = 6


@dataclass(frozen=True)
class Problem:
    """One broken link: what kind, which artifact (logical name and digest), and a diagnosis."""

    kind: str
    name: str
    sha256: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "sha256": self.sha256, "message": self.message}


@dataclass
class AuditReport:
    """Every artifact the walk reached (as nodes) and every problem found, in walk order."""

    sha256: str
    name: str
    nodes: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    statements: int = 0
    rehashed_bytes: int = 0
    # Artifacts whose bytes `bonsai gc` removed: their records are checked, their bytes cannot be.
    not_retained: int = 0
    is_rehashed: bool = True
    signatures: dict[str, int] = field(default_factory=lambda: {"valid": 0, "unsigned": 0, "bad": 0})
    key_id: str | None = None
    elapsed_s: float = 0.0

    @property
    def is_ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.is_ok,
            "sha256": self.sha256,
            "name": self.name,
            "first_problem": self.problems[0].message if self.problems else None,
            "problems": [p.as_dict() for p in self.problems],
            "artifacts": len(self.nodes),
            "statements": self.statements,
            "rehashed": self.is_rehashed,
            "rehashed_bytes": self.rehashed_bytes,
            "not_retained": self.not_retained,
            "signatures": {**self.signatures, "key_id": self.key_id},
            "elapsed_s": round(self.elapsed_s, 3),
            "nodes": self.nodes,
        }


def resolve_artifact(session: Session, ref: str) -> Artifact:
    """The artifact whose sha256 is `ref` or starts with it (at least 6 hex characters).

    Raises InputError when nothing matches or the prefix is ambiguous.
    """
    ref = ref.strip().lower().removeprefix("sha256:")
    if len(ref) < _MIN_PREFIX or any(c not in "0123456789abcdef" for c in ref):
        raise InputError(
            f"{ref!r} is not a sha256 digest or a prefix of at least {_MIN_PREFIX} hex characters"
        )
    matches = session.scalars(select(Artifact).where(Artifact.sha256.startswith(ref)).limit(6)).all()
    if not matches:
        raise InputError(f"no artifact has a sha256 starting with {ref} (see `bonsai show JOB` for digests)")
    if len(matches) > 1:
        shown = ", ".join(m.sha256[:16] for m in matches[:5])
        raise InputError(f"prefix {ref} matches several artifacts ({shown}…); give more characters")
    return matches[0]


def job_gguf(session: Session, job_id: int) -> Artifact:
    """The GGUF written by the newest successful package attempt of `job_id`."""
    runs = session.scalars(
        select(StageRun)
        .where(
            StageRun.job_id == job_id,
            StageRun.stage == StageName.PACKAGE.value,
            StageRun.status.in_((StageState.SUCCEEDED, StageState.SKIPPED_CACHED)),
        )
        .order_by(StageRun.attempt.desc())
    ).all()
    for run in runs:
        for link in run.links:
            if link.direction == LinkDirection.OUT and link.artifact.kind == "gguf":
                return link.artifact
    raise InputError(f"job {job_id} has no packaged GGUF yet (see `bonsai show {job_id}`)")


def statement_name(statement: dict[str, Any]) -> str | None:
    """ "<stage>/<subject name>", the name the next stage's statements give this artifact."""
    try:
        stage = statement["predicate"]["buildDefinition"]["internalParameters"]["stage"]
        return f"{stage}/{statement['subject'][0]['name']}"
    except (KeyError, IndexError, TypeError):
        return None


class _Walker:
    """Depth-first walk over the chain; holds what has been checked and what broke."""

    def __init__(self, session: Session, store: ArtifactStore, report: AuditReport, public_key: Any) -> None:
        self.session, self.store, self.report, self.public_key = session, store, report, public_key
        self.seen: set[str] = set()

    def problem(self, kind: str, name: str, sha256: str, message: str) -> None:
        self.report.problems.append(Problem(kind, name, sha256, message))

    def visit(self, name: str, sha256: str) -> None:
        if sha256 in self.seen:
            return
        self.seen.add(sha256)
        before = len(self.report.problems)
        node: dict[str, Any] = {
            "name": name,
            "sha256": sha256,
            "kind": None,
            "size_bytes": None,
            "statements": [],
            "inputs": [],
            "signature": None,
        }
        self.report.nodes.append(node)
        artifact = self.session.get(Artifact, sha256)
        if artifact is None:
            self.problem(
                "unrecorded",
                name,
                sha256,
                f"unrecorded: {name} sha256 {sha256} is named as an input but has no artifact row",
            )
            node["ok"] = False
            return
        node.update(kind=artifact.kind, size_bytes=artifact.size_bytes, media_type=artifact.media_type)
        self._check_bytes(name, artifact, node)
        deps = self._check_statements(name, artifact, node)
        node["ok"] = len(self.report.problems) == before
        for dep_name, dep_sha in deps:
            self.visit(dep_name, dep_sha)

    def _check_bytes(self, name: str, artifact: Artifact, node: dict[str, Any]) -> None:
        sha256 = artifact.sha256
        is_stored = self.store.has(sha256)
        if artifact.released_at is not None and not is_stored:
            # Removed on purpose: the records (rows, digests, statements) are still checked.
            self.report.not_retained += 1
            node["retained"] = False
            node["note"] = (f"bytes not retained: `bonsai gc` removed them on "
                            f"{artifact.released_at:%Y-%m-%d %H:%M} UTC; the digest and statements remain")
            return
        if not is_stored:
            self.problem(
                "missing",
                name,
                sha256,
                f"missing: {name} sha256 {sha256} recorded, but the file is not in the artifact store",
            )
            return
        if not self.report.is_rehashed:
            return
        # The store's own copy (a bucket's object, not a worker's cached copy of it) is what is checked.
        actual, size = self.store.rehash(sha256)
        self.report.rehashed_bytes += size
        if actual != sha256:
            self.problem(
                "tampered", name, sha256, f"tampered: {name} sha256 {sha256} recorded, {actual} on disk"
            )
        elif size != artifact.size_bytes:
            self.problem(
                "tampered",
                name,
                sha256,
                f"tampered: {name} is {artifact.size_bytes} bytes recorded, {size} on disk",
            )

    def _check_statements(self, name: str, artifact: Artifact, node: dict[str, Any]) -> list[tuple[str, str]]:
        rows = self.session.scalars(
            select(Provenance).where(Provenance.artifact_sha256 == artifact.sha256).order_by(Provenance.id)
        ).all()
        if not rows:
            self.problem(
                "no-provenance",
                name,
                artifact.sha256,
                f"no provenance: {name} sha256 {artifact.sha256} has no statement; "
                "it was not written by a pipeline stage",
            )
            return []
        deps: dict[tuple[str, str], None] = {}
        for row in rows:
            self.report.statements += 1
            run = self.session.get_one(StageRun, row.stage_run_id)
            node["statements"].append(
                {
                    "id": row.id,
                    "stage": run.stage,
                    "stage_run_id": run.id,
                    "job_id": run.job_id,
                    "attempt": run.attempt,
                }
            )
            for dep in self._check_statement(name, artifact.sha256, row, run):
                deps[dep] = None
            if self.public_key is not None:
                node["signature"] = self._check_signature(name, row, run)
        node["inputs"] = [{"name": n, "sha256": s} for n, s in deps]
        return list(deps)

    def _check_statement(
        self, name: str, sha256: str, row: Provenance, run: StageRun
    ) -> list[tuple[str, str]]:
        statement = row.statement
        where = f"statement {row.id} ({run.stage} run {run.id}, job {run.job_id})"
        if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
            self.problem(
                "malformed",
                name,
                sha256,
                f"malformed: {where} for {name} is not an in-toto v1 statement with a SLSA v1 predicate",
            )
            return []
        subjects = [s.get("digest", {}).get("sha256") for s in statement.get("subject", [])]
        if sha256 not in subjects:
            self.problem(
                "subject-mismatch",
                name,
                sha256,
                f"statement mismatch: {where} is filed under {name} sha256 {sha256} but its "
                f"subject is {', '.join(map(str, subjects)) or 'empty'}",
            )
        outputs = {link.artifact_sha256 for link in run.links if link.direction == LinkDirection.OUT}
        if sha256 not in outputs:
            self.problem(
                "output-mismatch",
                name,
                sha256,
                f"output mismatch: {where} claims {name}, but that run recorded no such output",
            )
        try:
            claimed = {
                d["name"]: d["digest"]["sha256"]
                for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]
            }
        except (KeyError, TypeError):
            self.problem(
                "malformed",
                name,
                sha256,
                f"malformed: {where} for {name} has no readable resolvedDependencies",
            )
            return []
        recorded = {link.name: link.artifact_sha256 for link in run.links
                    if link.direction == LinkDirection.IN}
        if claimed != recorded:
            self.problem(
                "inputs-mismatch",
                name,
                sha256,
                f"inputs mismatch: {where} for {name}: {_first_difference(claimed, recorded)}",
            )
        return sorted(claimed.items())

    def _check_signature(self, name: str, row: Provenance, run: StageRun) -> str:
        from pipeline.provenance import signing

        where = f"statement {row.id} ({run.stage} run {run.id})"
        stored_all = signing.envelopes_for(self.session, self.store, row)
        key = self.report.key_id or ""
        envelopes = [e for e in stored_all if signing.is_signed_by(e.envelope, key)]
        if not envelopes:
            others = " (signed only by other keys)" if stored_all else ""
            self.report.signatures["unsigned"] += 1
            self.problem(
                "unsigned",
                name,
                row.artifact_sha256,
                f"unsigned: {where} for {name} has no signature by key {key[:16]}{others}; "
                "sign it with `bonsai sign`",
            )
            return "unsigned"
        errors = []
        for stored in envelopes:
            try:
                signed = signing.verify_envelope(stored.envelope, self.public_key)
            except IntegrityError as exc:
                errors.append(str(exc))
                continue
            if signed == row.statement:
                self.report.signatures["valid"] += 1
                return "valid"
            errors.append("the statement in the database differs from the signed one")
        self.report.signatures["bad"] += 1
        self.problem(
            "bad-signature", name, row.artifact_sha256, f"bad signature: {where} for {name}: {errors[0]}"
        )
        return "bad"


def _first_difference(claimed: dict[str, str], recorded: dict[str, str]) -> str:
    for key in sorted(set(claimed) | set(recorded)):
        if key not in recorded:
            return f"the statement lists {key} sha256 {claimed[key]}, the run recorded no such input"
        if key not in claimed:
            return f"the run recorded input {key} sha256 {recorded[key]}, the statement omits it"
        if claimed[key] != recorded[key]:
            return f"{key} is sha256 {claimed[key]} in the statement, {recorded[key]} in the run's inputs"
    return "no difference"


def audit_artifact(
    session: Session, store: ArtifactStore, sha256: str, *, rehash: bool = True, public_key: Any = None
) -> AuditReport:
    """Walk and check the chain behind `sha256` (see the module docstring).

    `rehash=False` checks only the records (fast: for browsing); `public_key` (Ed25519)
    turns on signature checks. Never raises for a broken chain: read `report.problems`.
    """
    started = time.perf_counter()
    first = session.scalar(
        select(Provenance).where(Provenance.artifact_sha256 == sha256).order_by(Provenance.id).limit(1)
    )
    name = (statement_name(first.statement) if first is not None else None) or sha256[:12]
    report = AuditReport(sha256=sha256, name=name, is_rehashed=rehash)
    if public_key is not None:
        from pipeline.provenance.signing import key_id

        report.key_id = key_id(public_key)
    _Walker(session, store, report, public_key).visit(name, sha256)
    report.elapsed_s = time.perf_counter() - started
    return report
