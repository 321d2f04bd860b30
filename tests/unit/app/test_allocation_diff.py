"""`bonsai show JOB --against OTHER`: which tensors' auto-allocated types moved between two jobs."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from sqlalchemy.orm import Session

from pipeline.app.allocation_diff import allocation_diff
from pipeline.app.cli import cli
from pipeline.core.settings import Settings
from pipeline.core.states import StageName, StageState
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.ternary.allocate import rung_rank


def _job(session: Session, source: str, types: dict[str, str] | None, attempts: int = 1) -> int:
    job = repo.create_job(session, source, "auto" if types else "tq2_0", {})
    for attempt in range(1, attempts + 1):
        stale = {name: "Q8_0" for name in types or {}} if attempt < attempts else types
        metrics = {"auto_types": stale} if types else {}
        session.add(StageRun(job_id=job.id, stage=StageName.DECOMPOSE, attempt=attempt,
                             status=StageState.SUCCEEDED, metrics=metrics))
    return job.id


def test_rungs_rank_by_bits_then_levels() -> None:
    order = ["Q2_0/3", "Q2_0/4", "Q4_0", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    assert sorted(order, key=rung_rank) == order


def test_the_diff_names_each_tensor_that_moved_and_which_way(tmp_path: Path) -> None:
    home = tmp_path / "home"
    rt = build_runtime(Settings(home=home))
    with session_scope(rt.sessions) as session:
        cheap = _job(session, "acme/m", {"blk.0.ffn_up.weight": "Q4_K", "blk.0.attn_q.weight": "Q2_0/4",
                                          "token_embd.weight": "Q4_0", "blk.1.ffn_up.weight": "Q6_K"})
        # Its newest decompose attempt counts, not the first.
        dear = _job(session, "acme/m", {"blk.0.ffn_up.weight": "Q6_K", "blk.0.attn_q.weight": "Q2_0/3",
                                         "token_embd.weight": "Q4_0", "output.weight": "Q8_0"}, attempts=2)
        plain = _job(session, "acme/other", None)
    with session_scope(rt.sessions) as session:
        diff = allocation_diff(repo.get_job(session, dear), repo.get_job(session, cheap))
        assert diff["against"] == cheap and diff["same_source"]
        assert diff["up"] == [{"tensor": "blk.0.ffn_up.weight", "from": "Q4_K", "to": "Q6_K"}]
        assert diff["down"] == [{"tensor": "blk.0.attn_q.weight", "from": "Q2_0/4", "to": "Q2_0/3"}]
        assert diff["unchanged"] == 1
        assert diff["only_here"] == ["output.weight"] and diff["only_there"] == ["blk.1.ffn_up.weight"]
        other = allocation_diff(repo.get_job(session, plain), repo.get_job(session, cheap))
        assert not other["same_source"] and f"job {plain} made no auto allocation" in other["error"]
    show = ["--home", str(home), "show", str(dear)]
    shown = CliRunner().invoke(cli, [*show, "--json", "--against", str(cheap)])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["allocation_diff"]["down"][0]["tensor"] == "blk.0.attn_q.weight"
    table = CliRunner().invoke(cli, [*show, "--against", str(cheap)])
    assert table.exit_code == 0 and "1 up, 1 down, 1 unchanged" in table.output, table.output
    missing = CliRunner().invoke(cli, [*show, "--against", "999"])
    assert missing.exit_code != 0 and "job 999 does not exist" in missing.output
    assert "Traceback" not in missing.output
