"""Teams: who shares one service, and each team's share of it and caps on it.

Every submitter belongs to a team: an API token's entry may name one, the CLI submits as
``BONSAI_TEAM``, and a submitter that names none is a team of its own. An operator sets each team's
policy in a TOML file (``BONSAI_TEAMS_FILE``); with no file every team gets the defaults below, which
change nothing for a service with one team::

    usage_half_life_hours = 24      # how fast past usage stops counting against a team

    [default]                       # every team not named below
    max_pending = 500

    [team.ml-infra]
    weight = 2                      # twice the slots of a weight-1 team when both have work
    max_running = 4                 # attempts in flight; more wait in the database
    max_pending = 100               # unfinished jobs; more submissions are refused (HTTP 429)
    max_priority = 10               # asking for more needs the admin scope
    storage_quota_gb = 200          # stored bytes its jobs first wrote
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError

__all__ = ["TeamPolicy", "Teams", "parse_teams", "load_teams", "NO_TEAMS", "UNKNOWN", "team_of"]

_GB = 1024**3
# Who did something nobody named (an old row, a test's call without an actor).
UNKNOWN = "unknown"


def team_of(actor: str | None, named: str | None = None) -> str:
    """The team an actor acts for: the one its token or configuration names, else a team of its own."""
    return (named or actor or UNKNOWN)[:256]


@dataclass(frozen=True)
class TeamPolicy:
    """One team's share and caps; None is no cap."""

    weight: float = 1.0
    max_running: int | None = None
    max_pending: int | None = None
    max_priority: int | None = None
    storage_quota_bytes: int | None = None

    def describe(self) -> dict[str, Any]:
        """The policy as plain values (None: no cap), for `bonsai teams` and the API."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Teams:
    """The configured policies, the policy of every other team, and the usage half-life."""

    policies: Mapping[str, TeamPolicy] = field(default_factory=dict)
    default: TeamPolicy = TeamPolicy()
    usage_half_life_s: float = 24 * 3600.0

    def policy(self, team: str) -> TeamPolicy:
        return self.policies.get(team, self.default)


NO_TEAMS = Teams()

# Keys of a policy table, as written in the file, and how each becomes a TeamPolicy field.
_INT_KEYS = ("max_running", "max_pending", "max_priority")
_POLICY_KEYS = ("weight", *_INT_KEYS, "storage_quota_gb")


def _policy(table: Any, where: str, base: TeamPolicy) -> TeamPolicy:
    if not isinstance(table, dict):
        raise InputError(f"{where} must be a table of settings ({', '.join(_POLICY_KEYS)})")
    unknown = sorted(set(table) - set(_POLICY_KEYS))
    if unknown:
        raise InputError(f"{where}: unknown setting {unknown[0]!r}; a team's settings are "
                         f"{', '.join(_POLICY_KEYS)}")
    values: dict[str, Any] = {}
    weight = table.get("weight", base.weight)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
        raise InputError(f"{where}: weight must be a positive number, got {weight!r}")
    values["weight"] = float(weight)
    for key in _INT_KEYS:
        value = table.get(key, getattr(base, key))
        low = None if key == "max_priority" else (1 if key == "max_running" else 0)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or (low is not None and value < low)):
            floor = "a whole number" if low is None else f"a whole number of at least {low}"
            raise InputError(f"{where}: {key} must be {floor}, got {value!r}")
        values[key] = value
    quota = table.get("storage_quota_gb")
    if quota is None:
        values["storage_quota_bytes"] = base.storage_quota_bytes
    elif isinstance(quota, bool) or not isinstance(quota, int | float) or not 0 <= quota < math.inf:
        raise InputError(f"{where}: storage_quota_gb must be a number of GB, 0 or more, got {quota!r}")
    else:
        values["storage_quota_bytes"] = int(quota * _GB)
    return TeamPolicy(**values)


def parse_teams(text: str, origin: str = "the teams file") -> Teams:
    """The policies of a teams file's text; InputError names the table and setting at fault."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{origin} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"usage_half_life_hours", "default", "team"})
    if unknown:
        raise InputError(f"{origin}: unknown key {unknown[0]!r}; expected usage_half_life_hours, [default] "
                         "and [team.NAME] tables")
    half_life = data.get("usage_half_life_hours", 24)
    if isinstance(half_life, bool) or not isinstance(half_life, int | float) or not 0 < half_life < math.inf:
        raise InputError(f"{origin}: usage_half_life_hours must be a positive number, got {half_life!r}")
    default = _policy(data.get("default", {}), f"{origin} [default]", TeamPolicy())
    teams = data.get("team", {})
    if not isinstance(teams, dict):
        raise InputError(f"{origin}: team must hold [team.NAME] tables")
    policies = {str(name): _policy(table, f"{origin} [team.{name}]", default)
                for name, table in teams.items()}
    return Teams(policies, default, float(half_life) * 3600.0)


def load_teams(path: Path | None) -> Teams:
    """The teams file's policies (BONSAI_TEAMS_FILE), or the defaults when none is set."""
    if path is None:
        return NO_TEAMS
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"BONSAI_TEAMS_FILE {path} cannot be read ({exc}); point it at a TOML file of "
                         "team policies, or unset it") from None
    return parse_teams(text, f"BONSAI_TEAMS_FILE {path}")
