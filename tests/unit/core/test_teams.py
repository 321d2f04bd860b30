"""The teams file: policies, their defaults, and a clear error for each bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.errors import InputError
from pipeline.core.teams import NO_TEAMS, TeamPolicy, load_teams, parse_teams, team_of

_FILE = """
usage_half_life_hours = 2
[default]
max_pending = 50
[team.ml-infra]
weight = 2
max_running = 4
max_priority = 10
storage_quota_gb = 0.5
"""


def test_a_named_team_takes_its_settings_over_the_defaults() -> None:
    teams = parse_teams(_FILE)
    assert teams.usage_half_life_s == 7200.0
    assert teams.policy("ml-infra") == TeamPolicy(weight=2.0, max_running=4, max_pending=50, max_priority=10,
                                                  storage_quota_bytes=512 * 1024**2)
    assert teams.policy("anyone") == TeamPolicy(max_pending=50)


def test_no_file_caps_nothing(tmp_path: Path) -> None:
    assert load_teams(None) is NO_TEAMS
    assert NO_TEAMS.policy("x") == TeamPolicy()
    (tmp_path / "teams.toml").write_text(_FILE)
    assert load_teams(tmp_path / "teams.toml").policy("ml-infra").max_running == 4


def test_a_submitter_without_a_team_is_a_team_of_its_own() -> None:
    assert team_of("api:ci") == "api:ci"
    assert team_of("api:ci", "ml-infra") == "ml-infra"
    assert team_of(None) == "unknown"


@pytest.mark.parametrize(("text", "named"), [
    ("[team.a]\nweight = 0", "weight must be a positive number"),
    ("[team.a]\nmax_running = 0", "max_running must be a whole number of at least 1"),
    ("[team.a]\nmax_pending = 1.5", "max_pending must be a whole number"),
    ("[team.a]\nmax_jobs = 3", "unknown setting 'max_jobs'"),
    ("[team.a]\nstorage_quota_gb = -1", "storage_quota_gb must be a number of GB"),
    ("usage_half_life_hours = 0", "usage_half_life_hours must be a positive number"),
    ("[teams.a]", "unknown key 'teams'"),
    ("team = 3", "team must hold [team.NAME] tables"),
    ("[team.a\n", "is not valid TOML"),
])
def test_each_bad_value_is_named(text: str, named: str) -> None:
    with pytest.raises(InputError, match="teams file") as caught:
        parse_teams(text)
    assert named in str(caught.value)


def test_an_unreadable_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="BONSAI_TEAMS_FILE .* cannot be read"):
        load_teams(tmp_path / "missing.toml")
