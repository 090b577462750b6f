"""Chat prompts: messages rendered with the model's own chat template, the way Hugging Face does it.

The template is the GGUF's ``tokenizer.chat_template``, or the file ``model.chat_template`` names in
the config. It is compiled once per worker, in a sandboxed Jinja2 environment with what Hugging
Face templates expect: ``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt``,
``raise_exception(msg)``, ``strftime_now(fmt)``, the ``tojson`` filter, loop controls and the
``{% generation %}`` tag. Special-token text that the template writes (``<|im_start|>``) becomes the
control token; the messages' contents are tokenized as text (worker/content_text.py), unless the
model's ``parse_special_in_content`` says its callers are trusted.

The Jinja part needs no llama.cpp, so the supervisor can check a configured template
(:func:`compile_template`) without loading CUDA libraries; only :meth:`ChatFormatter.load` and
:meth:`ChatFormatter.tokens` call llama.cpp, on the engine thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from llamapool.protocol.messages import ChatMessage, ErrorCode
from llamapool.worker.content_text import ControlTexts, chat_tokens, parsed_in_chunks
from llamapool.worker.tools import ToolFormat, detect

CONFIG_KEY = "model.chat_template"


class ChatError(ValueError):
    """A chat prompt that cannot be turned into tokens; ``code`` is the error code of the reply."""

    def __init__(self, message: str, code: str = ErrorCode.INVALID_REQUEST):
        super().__init__(message)
        self.code = code


class TemplateRaised(Exception):
    """The template called ``raise_exception(message)``."""


class TemplateFileError(Exception):
    """The configured template file cannot be read or compiled (a permanent worker error)."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> Any:
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (Hugging Face marks assistant text with it): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)  # type: ignore[no-any-return]

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_template(source: str) -> Any:
    """The compiled template; raises ``jinja2.TemplateSyntaxError`` when it does not compile."""
    return _environment().from_string(source)


class ChatTemplate:
    """A compiled chat template and the special-token texts it is rendered with."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.template = compile_template(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text; :class:`ChatError` (``invalid_request``) when the template raises."""
        extra = {} if tools is None else {"tools": tools}
        try:
            return str(self.template.render(
                messages=list(messages), bos_token=self.bos_token, eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt, **extra,
            ))
        except TemplateRaised as e:
            raise ChatError(f"chat template: {e}") from None
        except Exception as e:  # a template bug meeting these messages (undefined, type error, sandbox)
            raise ChatError(f"chat template failed: {type(e).__name__}: {e}") from None


def read_template_file(path: str) -> str:
    """The text of a configured template file; ``ValueError`` naming the config key."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{CONFIG_KEY}: file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{CONFIG_KEY}: cannot read {path}: {e}") from None


def check_template_file(path: str) -> None:
    """Config-time check that the file exists and compiles; ``ValueError`` naming the config key."""
    source = read_template_file(path)
    try:
        compile_template(source)
    except Exception as e:
        raise ValueError(f"{CONFIG_KEY}: {path} is not a valid Jinja2 template: {e}") from None


class ChatFormatter:
    """What the engine holds: the worker's template (or why it has none) and its tokenizer."""

    def __init__(self, template: ChatTemplate | None, missing: str,
                 tokenize: Callable[[str], list[int]], bos: int, add_bos: bool,
                 tool_format: ToolFormat | None = None, *, raw: Callable[[str], list[int]] | None = None,
                 controls: ControlTexts | None = None, parse_special_in_content: bool = False):
        self.template = template
        self.tool_format = tool_format or ToolFormat("generic", native=False)  # how its calls are written
        self.missing = missing  # the no_chat_template message when ``template`` is None
        self._raw = raw or tokenize  # text -> tokens, special-token text read as text, nothing added
        self.controls = controls or ControlTexts.of({})  # the vocabulary's control tokens, by text
        self._tokenize = partial(parsed_in_chunks, controls=self.controls, parsed=tokenize)  # special tokens
        # parsed, nothing added (64 control tokens at a time: llama.cpp's parsing is quadratic)
        self.parse_special_in_content = parse_special_in_content  # trusted callers: contents parsed too
        self.bos = bos
        self.add_bos = add_bos

    @classmethod
    def load(cls, model: Any, vocab: Any, path: str = "", parse_special_in_content: bool = False) -> ChatFormatter:
        """The template of ``path`` (a file; it wins) or of the model's GGUF metadata.

        A configured file that cannot be read or compiled is a permanent worker error; a GGUF
        template that does not compile only makes chat requests fail with ``no_chat_template``.
        """
        import llama_cpp as L

        from llamapool.worker.vocab import tokenize as llama_tokenize

        def text(tok: int) -> str:
            return L.llama_vocab_get_text(vocab, tok).decode(errors="replace") if tok >= 0 else ""

        bos, eos = L.llama_vocab_bos(vocab), L.llama_vocab_eos(vocab)

        def tokenize(s: str) -> list[int]:  # the template writes BOS itself; its special tokens are parsed
            return llama_tokenize(vocab, s, add_special=False, parse_special=True)

        def as_text(s: str) -> list[int]:  # a content's text: special-token text stays text
            return llama_tokenize(vocab, s, add_special=False, parse_special=False)

        def make(source: str) -> ChatTemplate:
            return ChatTemplate(source, text(bos), text(eos))

        template, missing = None, ""
        if path:
            try:
                template = make(read_template_file(path))
            except ValueError as e:
                raise TemplateFileError(str(e)) from None
            except Exception as e:
                raise TemplateFileError(f"{CONFIG_KEY}: {path} is not a valid Jinja2 template: {e}") from None
        else:
            raw = L.llama_model_chat_template(model, None)
            if not raw:
                missing = (f"the model has no chat template (no tokenizer.chat_template in its GGUF); "
                           f"set {CONFIG_KEY} in the config to a Jinja2 template file")
            else:
                try:
                    template = make(raw.decode(errors="replace"))
                except Exception as e:
                    missing = (f"the model's chat template (tokenizer.chat_template in its GGUF) does not "
                               f"compile ({e}); set {CONFIG_KEY} in the config to a Jinja2 template file")
        def special(marker: str) -> int | None:  # the control token that is ``marker``, if one is
            toks = tokenize(marker)
            attr = L.llama_vocab_get_attr(vocab, toks[0]) if len(toks) == 1 else 0
            return toks[0] if attr & (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED) else None

        tool_format = detect(template.source, special) if template is not None else None
        return cls(template, missing, tokenize, bos, bool(L.llama_vocab_get_add_bos(vocab)) and bos >= 0,
                   tool_format, raw=as_text, controls=control_texts(vocab),
                   parse_special_in_content=parse_special_in_content)

    def render(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text, with ``tools`` (and earlier calls and results) as the template's family
        writes them (tools.ToolFormat.messages)."""
        msgs, render = self._renderer(messages, tools)
        return render(msgs)

    def _renderer(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None
                  ) -> tuple[list[dict[str, Any]], Callable[[list[dict[str, Any]]], str]]:
        """The messages as the template takes them, and the template's rendering of such messages."""
        template = self.template
        if template is None:
            raise ChatError(self.missing, ErrorCode.NO_CHAT_TEMPLATE)
        fmt = self.tool_format
        native = tools if tools and fmt.native else None
        return fmt.messages(list(messages), tools), lambda msgs: template.render(msgs, tools=native)

    def tokens(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None,
               marker: str = "") -> list[int]:
        """The prompt's tokens: rendered, special tokens parsed where the template writes them (in the
        contents too with ``parse_special_in_content``), BOS added once when the model wants one. With a
        ``marker`` (an image's place in a content: protocol.media.MEDIA_MARKER), each one the rendered text
        holds is :data:`MEDIA_TOKEN` in the tokens, the text on either side tokenized apart (as libmtmd does)."""
        msgs, render = self._renderer(messages, tools)
        parsed, raw = (_split_at(marker, self._tokenize), _split_at(marker, self._raw)) if marker \
            else (self._tokenize, self._raw)
        if self.parse_special_in_content:
            tokens = parsed(render(msgs))
        else:
            tokens = chat_tokens(msgs, render, self.controls, parsed, raw)
        if self.add_bos and (not tokens or tokens[0] != self.bos):
            tokens.insert(0, self.bos)
        return tokens


MEDIA_TOKEN = -1  # an image's place in ChatFormatter.tokens' output (with a marker)


def _split_at(marker: str, tokenize: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
    """``tokenize`` of the text between the markers, each marker :data:`MEDIA_TOKEN`."""
    def split(text: str) -> list[int]:
        out: list[int] = []
        for k, piece in enumerate(text.split(marker)):
            if k:
                out.append(MEDIA_TOKEN)
            if piece:
                out += tokenize(piece)
        return out

    return split


def control_texts(vocab: Any) -> ControlTexts:
    """The vocabulary's tokens that only special-token parsing reads (control and unknown), by text."""
    import llama_cpp as L

    gated = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNKNOWN
    texts: dict[str, int] = {}
    for tok in range(L.llama_vocab_n_tokens(vocab)):
        if L.llama_vocab_get_attr(vocab, tok) & gated:
            texts.setdefault(L.llama_vocab_get_text(vocab, tok).decode(errors="replace"), tok)
    return ControlTexts.of(texts)
