"""Commands about attempts: retry (and what the cache did), status (and what jobs wait on), logs."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from pipeline.app.cli.main import CliContext, cli, echo_json, guard, stage_names


@cli.command()
@click.argument("job_id", type=int)
@click.option("--from", "from_stage", type=click.Choice([s.value for s in stage_names()]), default=None,
              help="First stage to rerun (default: the first one not done).")
@click.option("--force", is_flag=True,
              help="Compute the rerun stages again even where an earlier attempt with the same inputs and "
                   "parameters could be reused from the cache.")
@click.pass_obj
@guard
def retry(obj: CliContext, job_id: int, from_stage: str | None, force: bool) -> None:
    """New attempts for STAGE and everything after it; earlier attempts are kept.

    An attempt equal to an earlier succeeded one (same stage version, parameters and input
    digests) is served from the cache and computes nothing, unless --force.
    """
    from pipeline.app.retrying import outcome_lines, planned_lines
    from pipeline.core.states import StageName
    from pipeline.db.models import StageRun
    from pipeline.db.session import session_scope
    from pipeline.orchestration.job_control import retry_job

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        run_ids = retry_job(session, job_id, StageName(from_stage) if from_stage else None, force,
                            requested_by="cli")
        stages = [session.get_one(StageRun, run_id).stage for run_id in run_ids]
    for line in planned_lines(job_id, stages, force):
        click.echo(line)
    if obj.settings.is_embedded:
        from pipeline.app.convert import run_and_report

        code = run_and_report(rt, job_id, as_json=False)
        for line in outcome_lines(rt, job_id, run_ids, from_stage):
            click.echo(line)
        sys.exit(code)
    rt.launcher.start(job_id)
    click.echo(f"  follow it: bonsai status {job_id} --watch 2; each attempt's lines: bonsai logs {job_id}")


@cli.command()
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--watch", "watch_s", type=click.FloatRange(min=0.1), default=None,
              help="Refresh every N seconds until every shown job has finished.")
@click.option("--status", "status", default=None, help="Only jobs in this state.")
@click.pass_obj
@guard
def status(obj: CliContext, job_ids: tuple[int, ...], watch_s: float | None, status: str | None) -> None:
    """Jobs (all, or JOB_IDS) with progress, attempts, retries and cache hits.

    With --watch it refreshes until every job shown has finished (exit 1 when one failed or was
    cancelled); into a pipe it prints a plain line per change. In distributed mode it warns when
    a job waits on a queue that no live worker serves.
    """
    from pipeline.app.watch import Snapshot, take_snapshot, watch_status

    rt = obj.runtime()
    timeout_s = None if obj.settings.is_embedded else obj.settings.heartbeat_timeout_s

    def look(ids: Sequence[int] | None) -> Snapshot:
        return take_snapshot(rt, ids or list(job_ids) or None, status, timeout_s)

    sys.exit(watch_status(look, watch_s, echo=click.echo))


@cli.command()
@click.argument("job_id", type=int)
@click.option("--stage", type=click.Choice([s.value for s in stage_names()]), default=None,
              help="Only this stage's attempts.")
@click.option("--attempt", type=click.IntRange(min=1), default=None, help="Only attempt number N.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def logs(obj: CliContext, job_id: int, stage: str | None, attempt: int | None, as_json: bool) -> None:
    """What each attempt of JOB_ID logged, with its warnings and error (kept when it ended)."""
    from pipeline.app.attempt_logs import attempt_logs, print_logs
    from pipeline.core.states import StageName

    entries = attempt_logs(obj.runtime(), job_id, StageName(stage) if stage else None, attempt)
    if as_json:
        echo_json(entries)
        return
    if not entries:
        click.echo(f"job {job_id} has no attempt{' of ' + stage if stage else ''}"
                   f"{f' numbered {attempt}' if attempt else ''}")
        return
    print_logs(entries, echo=click.echo)
