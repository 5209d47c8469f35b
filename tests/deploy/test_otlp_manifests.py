"""Deploy tier, tracing: every overlay sends OTLP over a transport the services export, to the
collector port that takes it (a grpc exporter aimed at 4318, or an http one at 4317, loses
every span). Reuses test_manifests.py's rendering and its check_env_wiring."""
from __future__ import annotations

import copy

import pytest
from test_manifests import OTLP_PORTS, OVERLAYS, check_env_wiring, render

from tandem.telemetry import OTLP_PROTOCOLS

pytestmark = pytest.mark.deploy


def with_protocol(docs, protocol: str):
    """The render with every OTEL_EXPORTER_OTLP_PROTOCOL set to `protocol`."""
    docs = copy.deepcopy(docs)
    found = 0
    for doc in docs:
        if doc.get("kind") == "ConfigMap" and "OTEL_EXPORTER_OTLP_PROTOCOL" in doc.get("data", {}):
            doc["data"]["OTEL_EXPORTER_OTLP_PROTOCOL"] = protocol
            found += 1
    assert found, "no ConfigMap sets OTEL_EXPORTER_OTLP_PROTOCOL"
    return docs


def test_every_exported_protocol_has_a_collector_port():
    assert set(OTLP_PORTS) == set(OTLP_PROTOCOLS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_export_over_the_protocol_their_collector_port_takes(overlay):
    assert check_env_wiring(render(overlay)) == []


@pytest.mark.parametrize("protocol,words", [("http/protobuf", "collector takes http/protobuf"),
                                            ("http/json", "not one the services export")])
def test_a_protocol_that_does_not_match_the_port_is_caught(protocol, words):
    problems = check_env_wiring(with_protocol(render("dev"), protocol))
    assert problems and all(words in p for p in problems), problems
