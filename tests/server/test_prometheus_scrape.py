"""The fleet exporter as a real Prometheus sees it: with its Redis stopped, the scrape
still succeeds (HTTP 200), `vlmq_up` reads 0, and the shipped alert rule on it fires.

The Redis here is a private redis-server on a free port, started and stopped by this test
alone (never the shared one); the rules are docs/prometheus-alerts.yml, as shipped, with
each `for` shortened so the test need not wait minutes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import helpers
from tests.support import prometheus as prom
from vlmq.worker.redis_server import free_port, start_private

RULES = Path(__file__).resolve().parents[2] / "docs" / "prometheus-alerts.yml"
ALERT = "VlmqRedisDown"


def _quick_rules(tmp: Path) -> Path:
    """The shipped rules with every `for` at 0 s: an alert fires at its first evaluation."""
    doc: dict[str, Any] = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("for", None)
    out = tmp / "rules.yml"
    out.write_text(yaml.safe_dump(doc))
    return out


def test_the_shipped_rules_are_valid_and_alert_on_vlmq_up_0() -> None:
    rc, out = prom.check_rules(RULES)
    assert rc == 0, out
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"]
             for r in g["rules"]}
    assert rules[ALERT]["expr"].strip() == "vlmq_up == 0", rules[ALERT]


def test_prometheus_fires_the_alert_while_redis_is_down(tmp_path: Path,
                                                        procs: list[subprocess.Popen[str]]
                                                        ) -> None:
    prom.require(prom.PROMETHEUS)
    try:
        redis = start_private()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        port = free_port()
        with (tmp_path / "exporter.log").open("w") as log:
            procs.append(subprocess.Popen(
                [helpers.VLMQ, "--redis-url", redis.url, "metrics", "--port", str(port)],
                stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True))
        rules = _quick_rules(tmp_path)
        rc, out = prom.check_rules(rules)
        assert rc == 0, out
        p = prom.start(tmp_path, {"vlmq-fleet": port}, interval="1s", rules=rules)
        procs.append(p.proc)
        p.ready()
        helpers.wait_for(lambda: p.scalar('vlmq_up{job="vlmq-fleet"}') == 1, 300,
                         "Prometheus to store a scrape that read Redis")
        assert ALERT not in p.alert_states()
        redis.stop()
        helpers.wait_for(lambda: p.alert_states().get(ALERT) == "firing", 300,
                         f"{ALERT} to fire; exporter log:\n"
                         + (tmp_path / "exporter.log").read_text())
        # The scrapes that said so succeeded (a scrape that timed out on a busy machine
        # would read as down until the next one): the target is up, its vlmq_up is 0.
        seen: list[object] = []

        def scraped_down() -> bool:
            target = p.api("targets")["activeTargets"][0]
            seen[:] = [p.scalar('up{job="vlmq-fleet"}'), p.scalar('vlmq_up{job="vlmq-fleet"}'),
                       target["health"], target["lastError"]]
            return seen == [1.0, 0.0, "up", ""]

        try:
            helpers.wait_for(scraped_down, 300, "a successful scrape saying vlmq_up 0")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last read {seen}") from None
    finally:
        redis.stop()
