"""API keys over both protocols: the "keyed" application refuses missing and wrong keys and serves
either configured key; health stays open to probes."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from tests.serving.app import API_KEYS, GRPC, HTTP

KEYED = f"{HTTP}/keyed"


def get(path: str, key: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{KEYED}{path}", headers=headers), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_needs_a_configured_key(app):
    for key in (None, "wrong", "", API_KEYS[0] + "x"):
        status, body = get("/v1/models", key)
        assert status == 401, key
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == 401
    for key in API_KEYS:
        status, body = get("/v1/models", key)
        assert status == 200 and body["data"]
    assert urllib.request.urlopen(f"{KEYED}/health", timeout=30).status == 200  # probes need no key

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{KEYED}/v1", api_key="wrong", max_retries=0).completions.create(
            model="", prompt="hi", max_tokens=2)
    oai = openai.OpenAI(base_url=f"{KEYED}/v1", api_key=API_KEYS[1], max_retries=0)
    assert oai.completions.create(model="", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    assert "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)) is not None
    request = urllib.request.Request(f"{KEYED}/tokenize", data=json.dumps({"prompt": "hi"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 401


def test_grpc_needs_a_configured_key_and_the_sdk_sends_it(app, monkeypatch):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.client import Client, Unauthenticated

    for key in (None, "wrong"):
        with Client(GRPC, application="keyed", api_key=key, timeout=30) as c:
            with pytest.raises(Unauthenticated, match="API key"):
                c.generate("hi", max_tokens=2)
            with pytest.raises(Unauthenticated):
                c.model_info()
    for key in API_KEYS:
        with Client(GRPC, application="keyed", api_key=key, timeout=30) as c:
            assert len(c.generate("hi", max_tokens=2, ignore_eos=True).token_ids) == 2
            assert c.model_info()["model"]
    monkeypatch.setenv("PAGEDSERVE_API_KEY", API_KEYS[0])
    with Client(GRPC, application="keyed", timeout=30) as c:
        assert c.chat([{"role": "user", "content": "hi"}], max_tokens=2).finish_reason in ("stop", "length")
    with grpc.insecure_channel(GRPC) as channel:  # grpc's own health probe: no key needed
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          metadata=(("application", "keyed"),), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    cli = [sys.executable, "-m", "pagedserve.cli", "client", "info", "--target", GRPC, "--application", "keyed"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "PAGEDSERVE_API_KEY"}
    refused = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    served = subprocess.run(cli + ["--api-key", API_KEYS[1]], capture_output=True, text=True, env=env, timeout=120)
    assert served.returncode == 0 and json.loads(served.stdout)["model"]
