"""The Prefect server the CLI starts for itself: started before the heavy imports, waited for after them."""

import time

import httpx

from grpoflow.flows.embedded_server import serving, start_server


def test_start_returns_at_once_and_serving_waits_then_stops(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))
    t = time.perf_counter()
    server = start_server()
    started = time.perf_counter() - t
    assert server is not None and server.proc.poll() is None
    assert started < 2.0, f"start_server blocked {started:.1f} s: it must not wait for the server"
    with serving(server) as url:
        assert url == server.url
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert server.proc.poll() is not None  # stopped on the way out
    assert (tmp_path / ".prefect").exists()  # the child read PREFECT_HOME from the environment


def test_a_failure_before_serving_answers_stops_the_server(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))
    server = start_server()
    try:
        with serving(server):
            raise RuntimeError("the flow failed")
    except RuntimeError:
        pass
    assert server.proc.poll() is not None


def test_a_users_server_starts_nothing(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert start_server() is None
    with serving(None) as url:
        assert url is None
