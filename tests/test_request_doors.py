"""The doors a request comes through show the same fields, ranges, names and defaults as before they were derived
from one description (`engine.request_fields`): the page's controls, `/generate`'s parameters, the A1111 and
OpenAI body schemas and MCP's tool schema are compared with a snapshot taken before that change.

To take a new snapshot after a deliberate change of a door: `JAX_SD_UPDATE_SNAPSHOTS=1 python -m pytest -n0
tests/test_request_doors.py`, and say why in the commit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import web
from tests._doors import doors
from tests.test_app_api import AdapterEngine, FakeEngine

SNAPSHOT = Path(__file__).with_name("snapshots") / "request_doors.json"
ENGINES = {"plain": FakeEngine, "adapters": AdapterEngine}


def current() -> dict:
    return {name: doors(web.build_app(make(), mcp=True)) for name, make in ENGINES.items()}


def test_every_door_shows_the_request_as_before():
    now = json.loads(json.dumps(current()))
    if os.environ.get("JAX_SD_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        pytest.skip("snapshot written")
    before = json.loads(SNAPSHOT.read_text())
    for engine_name, shown in before.items():
        for door, value in shown.items():
            assert now[engine_name][door] == value, f"{engine_name}: the {door} door changed"
