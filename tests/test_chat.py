"""Chat prompts: Hugging Face-style templates rendered in a sandbox, and chat end to end through the daemon."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import llama_cpp
import msgpack
import pytest

from llamapool import AsyncClient, BadRequestError, Client, Completion
from llamapool.config import ConfigError, from_dict
from llamapool.modelgen import CHATML_TEMPLATE, CHATML_TOKENS, make_model
from llamapool.protocol import codec
from llamapool.protocol.messages import ErrorCode
from llamapool.worker.chat import ChatError, ChatTemplate

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
GREEDY: dict[str, Any] = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}

# Mistral-7B-Instruct-v0.1's template, verbatim: it writes BOS itself and refuses a system role.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Llama 3.2's template without its tool-calling part: strftime_now, trim, whitespace control.
LLAMA32 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


# ---------------------------------------------------------------- rendering


def test_chatml_renders_as_hugging_face_does() -> None:
    t = ChatTemplate(CHATML_TEMPLATE, "<s>", "</s>")
    assert t.render(CHAT) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                              "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n")
    assert t.render(CHAT, add_generation_prompt=False).endswith("Hello world<|im_end|>\n")


def test_raise_exception_becomes_a_chat_error_with_the_templates_message() -> None:
    t = ChatTemplate(MISTRAL, "<s>", "</s>")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "And now?"}]
    assert t.render(chat) == "<s>[INST] Hi [/INST]Hello</s>[INST] And now? [/INST]"
    with pytest.raises(ChatError) as e:
        t.render(CHAT)
    assert e.value.code == ErrorCode.INVALID_REQUEST
    assert str(e.value) == "chat template: Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(ChatError) as e:
        t.render([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    assert str(e.value) == "chat template: Only user and assistant roles are supported!"


def test_strftime_now_gives_todays_date() -> None:
    before = datetime.now()
    text = ChatTemplate(LLAMA32, "<|begin_of_text|>", "<|eot_id|>").render(
        [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hi "}])
    days = {d.strftime("%d %b %Y") for d in (before, datetime.now(), before + timedelta(seconds=1))}
    assert text in {
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\n"
        f"Today Date: {day}\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        for day in days
    }


def test_environment_trims_blocks_and_has_tojson_loop_controls_and_generation() -> None:
    src = ("{% for m in messages %}\n"
           "    {% if m.role == 'skip' %}\n"
           "        {% continue %}\n"
           "    {% endif %}\n"
           "{{ m | tojson }}\n"
           "    {% if loop.index >= 3 %}{% break %}{% endif %}\n"
           "{% endfor %}\n"
           "{% generation %}done{% endgeneration %}")
    chat = [{"role": "user", "content": "é\"1"}, {"role": "skip", "content": "x"},
            {"role": "a", "content": "2"}, {"role": "b", "content": "3"}]
    assert ChatTemplate(src).render(chat) == (
        '{"role": "user", "content": "é\\"1"}\n{"role": "a", "content": "2"}\ndone')


@pytest.mark.parametrize("src, why", [
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{{ ''.__class__ }}{{ cycler.__init__.__globals__ }}", "SecurityError"),
    ("{% set _ = messages.append({'role': 'x', 'content': 'y'}) %}", "SecurityError"),  # immutable
    ("{{ messages[0].content + 1 }}", "TypeError"),
])
def test_templates_run_sandboxed_and_their_failures_are_chat_errors(src: str, why: str) -> None:
    with pytest.raises(ChatError, match=f"chat template failed: {why}") as e:
        ChatTemplate(src).render(CHAT)
    assert e.value.code == ErrorCode.INVALID_REQUEST


# ---------------------------------------------------------------- config, model, protocol


def test_config_chat_template_is_a_file_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(CHATML_TEMPLATE)
    cfg = from_dict({"model": {"path": "m.gguf", "chat_template": "t.jinja"}}, tmp_path)
    assert cfg.model.chat_template == str(tmp_path / "t.jinja")
    with pytest.raises(ConfigError, match=r"^model\.chat_template: file .*nope\.jinja does not exist"):
        from_dict({"model": {"path": "m.gguf", "chat_template": "nope.jinja"}}, tmp_path)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"^model\.chat_template: .*bad\.jinja is not a valid Jinja2 template"):
        from_dict({"model": {"path": "m.gguf", "chat_template": "bad.jinja"}}, tmp_path)


def test_demo_model_has_chatml_tokens_and_template(model_path: str) -> None:
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    assert llm.metadata["tokenizer.chat_template"] == CHATML_TEMPLATE
    vocab = llm._model.vocab
    start, end = llm.n_vocab() - 2, llm.n_vocab() - 1
    assert [llm.detokenize([t], special=True).decode() for t in (start, end)] == list(CHATML_TOKENS)
    assert llama_cpp.llama_vocab_is_control(vocab, start) and llama_cpp.llama_vocab_is_control(vocab, end)
    assert llama_cpp.llama_vocab_eot(vocab) == end
    assert llama_cpp.llama_vocab_is_eog(vocab, end), "<|im_end|> must end generation"
    assert not llama_cpp.llama_vocab_is_eog(vocab, start)
    assert llm.tokenize(b"<|im_start|>user", add_bos=False, special=True)[0] == start
    assert start not in llm.tokenize(b"<|im_start|>user", add_bos=False, special=False)


@pytest.mark.parametrize("prompt, field", [
    ([{"role": "user", "content": "hi"}, {"content": "x"}], "messages[1].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "", "content": "x"}], "messages[0].role"),
    ([{"role": "r" * 65, "content": "x"}], "messages[0].role"),
    ([{"role": b"user", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "x", "nickname": "bob"}], "messages[0].nickname"),
    ([{"role": "user", "content": "x"}, "hello"], "messages[1]"),
    ([{"role": "user", "content": "x"}, 5], "messages[1]"),
    ([5, {"role": "user", "content": "x"}], "prompt"),
])
def test_malformed_messages_are_refused_naming_the_field(prompt: Any, field: str) -> None:
    frame = msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt": prompt}, use_bin_type=True)
    with pytest.raises(codec.ProtocolError) as e:
        codec.decode([frame], codec.CLIENT_TYPES)
    assert (e.value.code, e.value.field, e.value.id) == (ErrorCode.INVALID_REQUEST, field, "r")
    assert f"'{field}'" in e.value.message


def test_chat_prompts_round_trip_in_a_batch() -> None:
    frame = msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompts": ["a", CHAT, [1, 2]]})
    msg = codec.decode([frame], codec.CLIENT_TYPES)
    assert msg.prompts == ["a", CHAT, [1, 2]]  # type: ignore[union-attr]
    assert codec.decode([codec.encode(msg)], codec.CLIENT_TYPES) == msg
    bad = msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompts": ["a", [CHAT[0], {"role": "u"}]]})
    with pytest.raises(codec.ProtocolError) as e:
        codec.decode([bad], codec.CLIENT_TYPES)
    assert e.value.field == "prompts[1][1].content"


# ---------------------------------------------------------------- through the daemon


def tokens_of(model_path: str, text: str, add_bos: bool) -> list[int]:
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    return list(llm.tokenize(text.encode(), add_bos=add_bos, special=True))


def test_chat_on_the_demo_model(start_daemon, model_path: str) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon()
    rendered = ChatTemplate(CHATML_TEMPLATE).render(CHAT)
    ids = tokens_of(model_path, rendered, add_bos=True)
    assert ids[:2] == [1, 510] and ids.count(1) == 1  # BOS once, then <|im_start|> as one token
    with d.client() as c:
        done = c.chat(CHAT, **GREEDY)
        stream = c.chat_stream(CHAT, **GREEDY)
        chunks = [ch.text for ch in stream]
        # the chat prompt is the rendered template, special tokens parsed: the same as sending its ids
        same = c.generate(ids, **GREEDY)
        # a text prompt does not parse special tokens: "<|im_start|>" is many tokens there
        raw = c.generate(rendered, max_tokens=1)
    assert done.usage.prompt_tokens == len(ids)
    assert done.usage.completion_tokens == 24 and done.finish_reason == "length" and done.text
    assert stream.completion is not None and stream.completion.text == done.text
    assert "".join(chunks) == done.text
    assert same.text == done.text
    assert raw.usage.prompt_tokens > len(ids)

    async def go() -> tuple[Completion, str, Completion | None]:
        async with AsyncClient(d.endpoint) as ac:
            one = await ac.chat(CHAT, **GREEDY)
            s = ac.chat_stream(CHAT, **GREEDY)
            text = "".join([ch.text async for ch in s])
            return one, text, s.completion

    one, text, last = asyncio.run(go())
    assert one.text == text == done.text and last is not None and last.text == done.text


def test_chat_cli_with_piped_stdin_keeps_the_history(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon()
    params = {"max_tokens": 8, "temperature": 0.0}
    out = subprocess.run(
        [sys.executable, "-m", "llamapool.cli", "chat", "--endpoint", d.endpoint, "--system", "Be brief.",
         "--max-tokens", "8", "--temperature", "0"],
        input=b"Hello world\n\nwhat next\n", capture_output=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr.decode()
    history: list[dict[str, str]] = [{"role": "system", "content": "Be brief."}]
    replies = []
    with d.client() as c:
        for line in ("Hello world", "what next"):
            history.append({"role": "user", "content": line})
            reply = c.chat(history, **params).text
            history.append({"role": "assistant", "content": reply})
            replies.append(reply)
    assert replies[0] and replies[1]
    assert out.stdout.decode() == f"{replies[0]}\n{replies[1]}\n"


def test_model_without_a_template(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bare = make_model(tmp_path / "bare.gguf", chat_template=None)
    d = start_daemon(wait_workers=1, model={"path": str(bare)}, workers={"cpu_workers": 1})
    with d.client() as c:
        with pytest.raises(BadRequestError) as e:
            c.chat(CHAT, max_tokens=4)
        assert e.value.code == "no_chat_template" and e.value.field == "messages"
        assert "model.chat_template" in e.value.message
        many = c.generate_many([CHAT, "Hello world"], max_tokens=4, return_exceptions=True)
        assert isinstance(many[0], BadRequestError) and many[0].code == "no_chat_template"
        assert isinstance(many[1], Completion) and many[1].usage.completion_tokens >= 1
        for bad, field in (([{"role": "user", "content": "hi"}, {"content": "x"}], "messages[1].role"),
                           ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
                           ([], "messages")):
            with pytest.raises(BadRequestError) as e:
                c.chat(bad, max_tokens=4)
            assert e.value.field == field, e.value
        assert c.generate("Hello world", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4


def test_configured_template_wins_and_its_exceptions_are_bad_requests(  # type: ignore[no-untyped-def]
        start_daemon, model_path: str, tmp_path: Path) -> None:
    (tmp_path / "mistral.jinja").write_text(MISTRAL)
    d = start_daemon(wait_workers=1, model={"chat_template": str(tmp_path / "mistral.jinja")},
                     workers={"cpu_workers": 1})
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "And now?"}]
    # the template writes "<s>" itself: no second BOS
    ids = tokens_of(model_path, "<s>[INST] Hi [/INST]Hello</s>[INST] And now? [/INST]", add_bos=False)
    assert ids[0] == 1 and ids.count(1) == 1
    with Client(d.endpoint) as c:
        for _ in range(2):  # the worker keeps serving after the template raised
            with pytest.raises(BadRequestError) as e:
                c.chat(CHAT, max_tokens=4)
            assert e.value.code == "invalid_request" and e.value.field == "messages"
            assert e.value.message == ("chat template: Conversation roles must alternate "
                                       "user/assistant/user/assistant/...")
            done = c.chat(chat, **GREEDY)
            assert done.usage.prompt_tokens == len(ids)
            assert done.text == c.generate(ids, **GREEDY).text


def test_leaving_an_async_chat_stream_cancels_it(start_daemon) -> None:  # type: ignore[no-untyped-def]
    # 16,000 tokens take the tiny model over 10 s on a CPU; a cancelled stream frees its slot in far less
    d = start_daemon(wait_workers=1, model={"ctx_per_slot": 16384}, workers={"cpu_workers": 1})
    long: dict[str, Any] = {"max_tokens": 16000, "ignore_eos": True}

    async def freed(ac: AsyncClient) -> bool:
        for _ in range(20):
            if sum(w["active"] for w in (await ac.status())["workers"]) == 0:
                return True
            await asyncio.sleep(0.1)
        return False

    async def go() -> None:
        async with AsyncClient(d.endpoint) as ac:
            async for _chunk in ac.chat_stream(CHAT, **long):
                assert sum(w["active"] for w in (await ac.status())["workers"]) == 1
                break
            assert await freed(ac), "break did not cancel the request"
            async with ac.chat_stream(CHAT, **long) as s:
                await s.__anext__()
            assert await freed(ac), "leaving 'async with' did not cancel the request"
            assert s.completion is None

    asyncio.run(go())
