"""--api-keys: keys name tenants (stored as digests), a wrong or missing key is 401 in OpenAI's shape while
/health and /metrics stay open, tenants never share prefix-cache blocks, and a tenant at its limit gets 429
with Retry-After."""

from __future__ import annotations

import hashlib
import time

import httpx
import openai
import pytest

from helpers.server import MODEL_NAME
from poot_core import RequestError
from poot_core.server.tenants import KeyRing, Limiter, OverLimit, Tenant

# 40 tokens of prompt: two full KV blocks of 16 to find again in the prefix cache
SHARED = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def server(serve, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    beta = hashlib.sha256(b"key-beta").hexdigest()
    keys.write_text(f"# key tenant limits\nkey-alpha alpha\nsha256:{beta} beta\nkey-limited limited running=1\n"
                    "key-slow slow rpm=2\n")
    return serve("--api-keys", str(keys), "--max-running", "4")


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key=key, max_retries=0, timeout=120)


def test_wrong_or_missing_key_is_401_and_health_metrics_stay_open(server):
    with pytest.raises(openai.AuthenticationError) as e:
        _client(server, "key-gamma").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{server.base}/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{server.base}/completions", content=b"{bad json")  # the key is checked before the body
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_plain_and_digest_keys_both_work(server):
    for key in ("key-alpha", "key-beta"):
        r = _client(server, key).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, temperature=0)
        assert r.usage.completion_tokens == 1


def test_tenants_never_share_prefix_cache_blocks(server):
    def hits_after(key: str) -> float:
        _client(server, key).completions.create(model=MODEL_NAME, prompt=SHARED, max_tokens=1, temperature=0)
        return server.metric("poot:prefix_cache_hits_total")

    start = server.metric("poot:prefix_cache_hits_total")
    first = hits_after("key-alpha")
    again = hits_after("key-alpha")
    other = hits_after("key-beta")
    assert first == start  # a new prompt: nothing to find
    assert again - first >= 2  # the same tenant finds its full blocks
    assert other == again  # another tenant finds none of them
    assert server.metric("poot:prompt_tokens_total", tenant="alpha") > 0


def test_running_limit_gives_429_without_touching_others(server):
    body = {"model": MODEL_NAME, "prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    headers = {"Authorization": "Bearer key-limited"}
    with httpx.stream("POST", f"{server.base}/completions", json=body, headers=headers, timeout=120) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a closed line iterator would close the connection
        next(line for line in lines if line.startswith("data: "))
        second = httpx.post(f"{server.base}/completions", json={**body, "stream": False}, headers=headers)
        assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
        assert second.json()["error"]["code"] == "rate_limit_exceeded"
        other = _client(server, "key-alpha").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
        assert other.usage.completion_tokens == 1
    # the stream was closed: its slot comes back
    for _ in range(100):
        r = httpx.post(f"{server.base}/completions", json={**body, "stream": False, "max_tokens": 1},
                       headers=headers, timeout=120)
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200


def test_requests_per_minute(server):
    client = _client(server, "key-slow")
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 60


# --- the key file and the limiter, in this process ----------------------------------------------------


def test_key_file_keeps_digests_only(tmp_path):
    f = tmp_path / "keys"
    f.write_text("secret-one team-a rpm=5 running=2 priority=3\nsecret-two team-a\n")
    ring = KeyRing.load(f)
    assert ring.tenant("secret-one") == ring.tenant("secret-two") == Tenant("team-a", rpm=5, running=2, priority=3)
    assert ring.tenant("secret-on") is None and ring.tenant("") is None and ring.tenant(None) is None
    assert b"secret-one" not in repr(ring.__dict__).encode()


@pytest.mark.parametrize("text", ["onlykey\n", "k t rpm=0\n", "k t speed=3\n", "sha256:abc t\n", "# nothing\n"])
def test_bad_key_files_are_refused(tmp_path, text):
    f = tmp_path / "keys"
    f.write_text(text)
    with pytest.raises(RequestError):
        KeyRing.load(f)


def test_limiter_windows():
    now = [0.0]
    limiter = Limiter(clock=lambda: now[0])
    tenant = Tenant("t", rpm=2, running=3, tpm=100)
    limiter.admit(tenant, 1)
    limiter.admit(tenant, 1)
    with pytest.raises(OverLimit) as e:
        limiter.admit(tenant, 1)
    assert e.value.retry_after == 60
    now[0] = 30.0
    with pytest.raises(OverLimit) as e:
        limiter.admit(tenant, 1)
    assert e.value.retry_after == 30
    now[0] = 60.5
    limiter.admit(tenant, 1)  # the first two left the window; three running is the limit
    with pytest.raises(OverLimit):
        limiter.admit(Tenant("t", running=3), 1)
    limiter.release(tenant, 3)
    limiter.count_tokens(tenant, 100)
    with pytest.raises(OverLimit, match="tokens per minute"):
        limiter.admit(Tenant("t", tpm=100), 1)
    now[0] = 121.0
    limiter.admit(Tenant("t", tpm=100), 1)
