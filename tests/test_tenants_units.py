"""Tenants without a daemon: the keys file's format and its errors, the fair queue's order (classes, then
deficit round robin by weight, a tenant at its share passed over), the limit counters' windows, and the
gateway's mapping of service_tier / priority and of the limit state to headers (issue 45)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from llamapool import keys
from llamapool.config import ConfigError, from_dict
from llamapool.gateway.errors import ApiError
from llamapool.gateway.parsing import priority_class, ratelimit_headers
from llamapool.protocol import codec
from llamapool.protocol.messages import ErrorCode, Generate
from llamapool.router.tables import Job
from llamapool.router.tenants import FairQueue, Tenancy


def test_plain_keys_stay_valid_and_settings_follow_the_key() -> None:
    assert keys.parse("c2VjcmV0LWtleQ==\n").keys == {b"c2VjcmV0LWtleQ==": keys.key_name(b"c2VjcmV0LWtleQ==")}
    kf = keys.parse("# comment\nplain-key\n\nsk-a name=batch weight=2 priority=flex concurrency=4 rpm=60 tpm=900 "
                    "queue_share=0.5\nsk-b name=batch\n*  rpm=10\n")
    plain = keys.key_name(b"plain-key")
    assert kf.keys == {b"plain-key": plain, b"sk-a": "batch", b"sk-b": "batch"}
    assert "plain-key" not in plain and plain.startswith("key-")  # a name, never the key
    b = kf.settings("batch")
    assert (b.weight, b.priority, b.concurrency, b.rpm, b.tpm, b.queue_share) == (2.0, "flex", 4, 60, 900, 0.5)
    assert kf.settings("someone").rpm == 10 and kf.settings("someone").name == "someone"  # the '*' defaults
    assert kf.settings(plain).rpm == 0


@pytest.mark.parametrize("text, line, what", [
    ("good\nsk rpm=ten\n", 2, "rpm must be a number"),
    ("sk weight=0\n", 1, "weight must be a number from 0.01"),
    ("sk priority=urgent\n", 1, "priority must be one of priority, default, flex"),
    ("sk colour=red\n", 1, "unknown setting 'colour'"),
    ("a\nb\nsk name=x y\n", 3, "'y' is not a setting"),
    ("sk\nsk\n", 2, "on an earlier line"),
    ("k1 name=a rpm=1\nk2 name=a rpm=2\n", 2, "settings on an earlier line"),
    ("rpm=5\n", 1, "must start with the key"),
    ("sk name=bad/name\n", 1, "name must be 1 to 64"),
])
def test_a_bad_line_is_named(text: str, line: int, what: str) -> None:
    with pytest.raises(keys.KeysFileError, match=f"line {line}: .*{what}"):
        keys.parse(text, "keys.txt")


def test_a_bad_keys_file_fails_the_config(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("sk-1 name=a\nsk-2 name=b tpm=-3\n")
    with pytest.raises(ConfigError, match=r"http\.api_keys_file: .*line 2: tpm must be a whole number"):
        from_dict({"model": {"path": "m"}, "http": {"api_keys_file": str(f)}})
    with pytest.raises(ConfigError, match=r"http\.tenant_header"):
        from_dict({"model": {"path": "m"}, "http": {"tenant_header": "x tenant"}})
    cfg = from_dict({"model": {"path": "m"}, "server": {"rate_window": "10s"}})
    assert cfg.server.rate_window == 10.0


def job(rid: int, tenant: str, rank: int = 1) -> Job:
    return Job(rid, b"c", str(rid), 0, "x", None, False, 0.0, None, tenant=tenant, rank=rank)  # type: ignore[arg-type]


def drain(q: FairQueue, eligible=lambda t: True) -> list[Job]:  # type: ignore[no-untyped-def]
    out = []
    while (j := q.peek(eligible)) is not None:
        q.take(j)
        out.append(j)
    return out


def test_the_fair_queue_takes_classes_first_then_tenants_by_weight() -> None:
    weights = {"a": 1.0, "b": 3.0}
    q = FairQueue(lambda t: weights.get(t, 1.0))
    for i in range(40):  # a floods first, b comes after
        q.append(job(i, "a"))
    for i in range(40, 80):
        q.append(job(i, "b"))
    q.append(job(99, "a", rank=2))  # flex: after every default
    q.append(job(98, "c", rank=0))  # priority: first
    assert len(q) == 82 and q.waiting("a") == 41
    order = drain(q)
    assert order[0].rid == 98 and order[-1].rid == 99
    first = Counter(j.tenant for j in order[1:41])  # while both wait: b gets 3 turns for a's 1
    assert first == {"a": 10, "b": 30}, first
    assert [j.rid for j in order if j.tenant == "a"][:3] == [0, 1, 2]  # FIFO within a tenant
    assert not q and q.oldest() is None


def test_a_tenant_at_its_share_is_passed_over_not_blocking() -> None:
    q = FairQueue(lambda t: 1.0)
    for i in range(5):
        q.append(job(i, "a", rank=0))  # a's priority prompts, but a holds its share
    q.append(job(10, "b"))
    assert [j.rid for j in drain(q, lambda t: t != "a")] == [10]
    assert len(q) == 5 and q.peek().rid == 0  # type: ignore[union-attr]
    j = q.peek()
    assert j is not None
    q.remove(j)
    q.appendleft(job(7, "a", rank=0))
    assert [x.rid for x in drain(q)] == [7, 1, 2, 3, 4]


def test_the_token_window_reserves_counts_and_carries_over() -> None:
    table = keys.parse("sk name=t tpm=600 rpm=120\n")  # a 10 s window: 100 tokens, 20 requests
    ten = Tenancy(table, window=10.0)
    q = FairQueue(ten.weight)
    prompt = [1, 2, 3, 4, 5]  # token ids: their count is exact
    jobs = []
    for i in range(6):  # 5 prompt + 10 max_tokens = 15 each: 6 fit in 100 (90), the 7th does not
        assert ten.refusal("t", 1, "m", [prompt], 1, 10, q, 100, now=1.0) is None
        j = job(i, "t")
        j.prompt = prompt
        ten.admitted("t", "m", [j], 10, now=1.0)
        jobs.append(j)
    why = ten.refusal("t", 1, "m", [prompt], 1, 10, q, 100, now=1.0)
    assert why is not None and why[0] == ErrorCode.RATE_LIMITED and why[3] == "tokens"
    ten.refused("t", why[3], now=2.0)
    state = ten.limits("t", now=2.0, retry=True)
    assert state == {"limit_requests": 20, "remaining_requests": 14, "reset_requests": 9.0, "limit_tokens": 100,
                     "remaining_tokens": 10, "reset_tokens": 9.0, "retry_after": 9}
    for j in jobs:  # each generated 20: 6 x 25 = 150, over the window's 100
        ten.ended(j, "ok", 5, 20)
    assert ten.limits("t", now=3.0)["remaining_tokens"] == 0  # type: ignore[index]
    assert ten.limits("t", now=11.5)["remaining_tokens"] == 50  # type: ignore[index]  # the 50 over carried
    assert ten.limits("t", now=31.5)["remaining_tokens"] == 100  # type: ignore[index]
    assert ten.state("t").outcomes["ok"] == 6 and ten.state("t").generated_tokens == 120


def test_a_key_capped_below_the_class_asked_is_forbidden() -> None:
    ten = Tenancy(keys.parse("sk name=t priority=default\n"))
    q = FairQueue(ten.weight)
    why = ten.refusal("t", 0, "m", ["x"], 1, 4, q, 100, now=1.0)
    assert why is not None and why[0] == ErrorCode.FORBIDDEN and why[2] == "priority"
    assert ten.refusal("t", 2, "m", ["x"], 1, 4, q, 100, now=1.0) is None


def test_the_wire_carries_tenant_and_class_and_checks_them() -> None:
    frame = codec.encode_generate("r1", ["hi"], False, False, None, {}, None, "team-a", "flex")
    msg = codec.decode([frame], codec.CLIENT_TYPES)
    assert isinstance(msg, Generate) and (msg.tenant, msg.priority) == ("team-a", "flex")
    for field, bad in (("priority", "urgent"), ("tenant", "a b")):
        frame = codec.encode_generate("r1", ["hi"], False, False, None, {}, None,
                                      *(("t", bad) if field == "priority" else (bad, None)))
        with pytest.raises(codec.ProtocolError) as e:
            codec.decode([frame], codec.CLIENT_TYPES)
        assert e.value.field == field


def test_service_tier_and_priority_map_to_classes() -> None:
    assert priority_class({"service_tier": "flex"}) == ("flex", "service_tier")
    assert priority_class({"service_tier": "auto"}) == (None, "service_tier")
    assert priority_class({"service_tier": "priority"}) == ("priority", "service_tier")
    assert priority_class({"priority": -3}) == ("priority", "priority")
    assert priority_class({"priority": 0}) == (None, "priority")
    assert priority_class({"priority": 7}) == ("flex", "priority")
    assert priority_class({"service_tier": "standard_only"}, anthropic=True) == (None, "service_tier")
    for body, param in (({"service_tier": "gold"}, "service_tier"), ({"priority": 101}, "priority"),
                        ({"priority": "high"}, "priority"), ({"service_tier": "flex"}, "service_tier")):
        with pytest.raises(ApiError) as e:
            priority_class(body, anthropic=body == {"service_tier": "flex"})
        assert e.value.status == 400 and e.value.param == param


def test_headers_in_openai_and_anthropic_names() -> None:
    state = {"limit_requests": 60, "remaining_requests": 59, "reset_requests": 0.25, "limit_tokens": 1000,
             "remaining_tokens": 400, "reset_tokens": 75.5}
    h = ratelimit_headers(state, "/v1/chat/completions")
    assert h == {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
                 "x-ratelimit-reset-requests": "250ms", "x-ratelimit-limit-tokens": "1000",
                 "x-ratelimit-remaining-tokens": "400", "x-ratelimit-reset-tokens": "1m15.5s"}
    a = ratelimit_headers(state, "/v1/messages")
    assert a["anthropic-ratelimit-requests-remaining"] == "59" and a["anthropic-ratelimit-tokens-limit"] == "1000"
    assert a["anthropic-ratelimit-tokens-reset"].endswith("Z")
    assert ratelimit_headers(None, "/v1/completions") == {}


def test_concurrency_queue_share_and_flex_refusals() -> None:
    ten = Tenancy(keys.parse("sk name=c concurrency=3\nsk2 name=q queue_share=0.25\n"))
    q = FairQueue(ten.weight)
    held = [job(i, "c") for i in range(3)]
    ten.admitted("c", "m", held, 4, now=0.0)
    why = ten.refusal("c", 1, "m", ["x"], 1, 4, q, 100, now=0.0)
    assert why is not None and why[3] == "concurrency" and "3 at once" in why[1]
    ten.refused("c", why[3], now=0.0)
    assert ten.limits("c", now=0.0, retry=True) == {"retry_after": 1}  # a prompt in flight may end any moment
    ten.ended(held[0], "ok", 1, 1)
    assert ten.refusal("c", 1, "m", ["x"], 1, 4, q, 100, now=0.0) is None
    for i in range(25):  # q's share: a quarter of max_queue = 25 waiting prompts
        q.append(job(100 + i, "q"))
    why = ten.refusal("q", 1, "m", ["x"], 1, 4, q, 100, now=0.0)
    assert why is not None and why[3] == "queue_share"
    flex = ten.refusal("free", 2, "m", ["x"], 26, 4, q, 100, now=0.0)  # 25 + 26 waiting > half of 100
    assert flex is not None and flex[0] == ErrorCode.OVERLOADED and flex[3] == "flex"
    assert ten.refusal("free", 1, "m", ["x"], 26, 4, q, 100, now=0.0) is None  # a default one still waits


def test_a_tenant_holds_its_weight_of_the_slots_while_another_is_active() -> None:
    ten = Tenancy(keys.parse("sk name=a weight=1\nsk2 name=b weight=3\n"), idle=5.0)
    q = FairQueue(ten.weight)
    a_jobs = [job(i, "a") for i in range(8)]
    ten.admitted("a", "m", a_jobs, 4, now=0.0)
    for j in a_jobs[:2]:
        j.model = "m"
        ten.started(j)
    assert ten.eligible("m", 8, 1.0, q)("a")  # alone: every slot
    ten.admitted("b", "m", [job(50, "b")], 4, now=1.0)  # b asks: a's share is 8 * 1/4 = 2
    ok = ten.eligible("m", 8, 2.0, q)
    assert not ok("a") and ok("b")
    assert ten.eligible("m", 8, 7.0, q)("a")  # b idle for tenant_idle: a may take them all again
