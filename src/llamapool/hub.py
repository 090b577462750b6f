"""Models by name: ``hf:OWNER/REPO:QUANT`` or ``hf:OWNER/REPO/FILE.gguf``, from the Hugging Face Hub.

A reference is downloaded once, with ``huggingface_hub``, into its shared cache (``HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``): the library resumes a broken transfer and checks the
size; a fresh file's sha256 is checked against the Hub's (the etag of a Git LFS file) and its GGUF magic.
``HF_TOKEN`` opens gated and private repos, ``HF_ENDPOINT`` names a mirror.

Every Hub call has a connect and read timeout (``LLAMAPOOL_HUB_TIMEOUT`` seconds, default 20; the
download's own reads wait at most ``HF_HUB_DOWNLOAD_TIMEOUT``, huggingface_hub's, default 10): an
endpoint that accepts connections and never answers is a :class:`HubError` naming the reference
(or the cached file is used) within a minute, not a silent wait.

- :func:`cached` finds a reference in the cache without the network (config loading uses it, so a
  SIGHUP reload or a second start needs no network);
- :func:`fetch` asks the Hub which file a reference names and downloads what the cache lacks; when
  the Hub cannot be reached it falls back to the cache, else raises :class:`HubError` naming the reference.

:func:`gguf_info` reads the few keys of a GGUF file's header that ``llamapool models`` shows (architecture,
context length, chat template family).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "hf:"
DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_ENV = "LLAMAPOOL_HUB_TIMEOUT"
DEFAULT_TIMEOUT = 20.0  # seconds to connect, and between bytes of an answer, for each Hub call
_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class HubError(RuntimeError):
    """A reference that cannot be resolved or downloaded; the message names it."""


@dataclass(frozen=True)
class HubRef:
    """``hf:OWNER/REPO:QUANT`` (a quantisation, e.g. ``Q4_K_M``) or ``hf:OWNER/REPO/FILE.gguf``."""

    repo: str
    file: str = ""
    quant: str = ""
    revision: str = "main"
    mmproj: bool = False  # a model's projector (its repo's mmproj file), not the model

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo}" + (f"/{self.file}" if self.file else f":{self.quant}" if self.quant else "")

    @property
    def name(self) -> str:
        """The model's default name: the file's stem, else REPO without "-GGUF" and the quant
        (``hf:bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M`` -> ``Llama-3.2-1B-Instruct-Q4_K_M``)."""
        if self.file:
            return _PART.sub("", Path(self.file).name).removesuffix(".gguf")
        base = re.sub(r"[-_.]?gguf$", "", self.repo.split("/")[1], flags=re.I) or self.repo.split("/")[1]
        return f"{base}-{self.quant}" if self.quant else base

    def pick(self, files: Iterable[str]) -> list[str]:
        """The repo files this reference names (all parts of a split GGUF, first part first)."""
        ggufs = sorted(f for f in files if f.endswith(".gguf"))
        if self.file:
            if self.file not in ggufs:
                raise HubError(f"{self}: the repo has no file {self.file}; its GGUF files: {_few(ggufs)}")
            chosen = [self.file]
        elif self.mmproj:
            chosen = [_mmproj_file(self, ggufs)]
        else:
            models = [f for f in ggufs if "mmproj" not in Path(f).name.lower()]
            if self.quant:
                pat = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(self.quant)}([^A-Za-z0-9]|$)", re.I)
                models = [f for f in models if pat.search(Path(f).name)]
            stems = sorted({_PART.sub("", f) for f in models})
            if not stems:
                raise HubError(f"{self}: no GGUF file of the repo matches {self.quant or 'a model'} "
                               f"(its GGUF files: {_few(ggufs)}); name one: {PREFIX}{self.repo}/FILE.gguf")
            if len(stems) > 1:
                raise HubError(f"{self}: {len(stems)} files match ({_few(stems)}); name one: "
                               f"{PREFIX}{self.repo}/FILE.gguf")
            chosen = [f for f in models if _PART.sub("", f) == stems[0]]
        first = _PART.search(chosen[0])
        if first and len(chosen) == 1:  # a file ref naming one part of a split GGUF: take all its parts
            chosen = sorted(f for f in ggufs if _PART.sub("", f) == _PART.sub("", chosen[0]))
        if first and len(chosen) != int(first.group(2)):
            raise HubError(f"{self}: {int(first.group(2))} parts expected, the repo has {len(chosen)}")
        return chosen


def _mmproj_file(ref: HubRef, ggufs: list[str]) -> str:
    """The repo's projector file, as llama-server -hf finds it: a GGUF whose name has "mmproj"; of several,
    the one of the reference's quantisation, else the F16 one, else BF16, F32, Q8_0, else the first."""
    found = [f for f in ggufs if "mmproj" in Path(f).name.lower()]
    if not found:
        raise HubError(f"{ref}: the repo has no mmproj GGUF (a file with 'mmproj' in its name; its GGUF files: "
                       f"{_few(ggufs)}); name one: {PREFIX}{ref.repo}/FILE.gguf")
    for want in ([ref.quant] if ref.quant else []) + ["f16", "bf16", "f32", "q8_0"]:
        pat = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(want)}([^A-Za-z0-9]|$)", re.I)
        hits = [f for f in found if pat.search(Path(f).name)]
        if hits:
            return hits[0]
    return found[0]


def is_ref(path: str) -> bool:
    return path.startswith(PREFIX)


def parse(text: str, mmproj: bool = False) -> HubRef:
    """``hf:OWNER/REPO:QUANT`` or ``hf:OWNER/REPO/FILE.gguf`` (``hf:OWNER/REPO``: its one GGUF);
    a ValueError that says what is wrong."""
    body = text[len(PREFIX):] if is_ref(text) else text
    quant = ""
    if ":" in body:
        body, quant = body.rsplit(":", 1)
        if not _NAME.fullmatch(quant):
            raise ValueError(f"{text}: the quantisation after ':' must be like Q4_K_M, got {quant!r}")
    parts = body.split("/")
    if len(parts) < 2 or not all(_NAME.fullmatch(p) for p in parts[:2]):
        raise ValueError(f"{text}: expected hf:OWNER/REPO:QUANT (e.g. hf:bartowski/Llama-3.2-1B-Instruct-GGUF:"
                         f"Q4_K_M) or hf:OWNER/REPO/FILE.gguf")
    file = "/".join(parts[2:])
    if file and (quant or not file.endswith(".gguf") or ".." in parts[2:] or "" in parts[2:]):
        raise ValueError(f"{text}: a file in the repo must be FILE.gguf, without ':QUANT'")
    return HubRef("/".join(parts[:2]), file, quant, mmproj=mmproj)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def timeout() -> float:
    """Seconds a Hub call waits to connect and for each part of an answer (``LLAMAPOOL_HUB_TIMEOUT``)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise HubError(f"{TIMEOUT_ENV}={raw!r}: expected seconds (a number > 0)") from None
    if not value > 0:
        raise HubError(f"{TIMEOUT_ENV}={raw!r}: expected seconds (a number > 0)")
    return value


def cache_dir() -> Path:
    """huggingface_hub's cache, as it finds it (read at each call: tests and the CLI may set it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def _storage(ref: HubRef) -> Path:
    return cache_dir() / ("models--" + ref.repo.replace("/", "--"))


def cached(ref: HubRef) -> Path | None:
    """The reference's file in the cache (the snapshot of its revision), or None; no network."""
    storage = _storage(ref)
    try:
        commit = (storage / "refs" / ref.revision).read_text().strip()
    except OSError:
        return None
    snap = storage / "snapshots" / commit
    files = [str(p.relative_to(snap)) for p in snap.rglob("*.gguf") if p.is_file()]
    try:
        chosen = ref.pick(files)
    except HubError:
        return None
    return snap / chosen[0]


def _network_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a Hub that cannot be reached, for the HTTP client this huggingface_hub uses."""
    import importlib

    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for mod, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                       ("requests", ("ConnectionError", "Timeout"))):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        found.extend(getattr(m, n) for n in names if hasattr(m, n))
    return tuple(found)


def _hub_failure(ref: HubRef, e: BaseException) -> HubError | None:
    """The error to raise for an answer of the Hub (None: the Hub was not reached, try the cache)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(e, GatedRepoError):
        return HubError(f"{ref}: {ref.repo} is gated: accept its terms on the Hub and set HF_TOKEN")
    if isinstance(e, RepositoryNotFoundError):
        return HubError(f"{ref}: no repo {ref.repo} at {endpoint()} (a private one needs HF_TOKEN)")
    if isinstance(e, HfHubHTTPError):
        status = getattr(e.response, "status_code", 0) if getattr(e, "response", None) is not None else 0
        if status and status < 500 and status not in (408, 429):
            return HubError(f"{ref}: {endpoint()} answered {status}: {str(e).splitlines()[0]}")
    return None


def fetch(ref: HubRef, say: Callable[[str], None] | None = None, progress: bool | None = None) -> Path:
    """The local path of ``ref``'s file, downloaded (all parts of a split GGUF) unless the cache has it.

    ``say`` gets one line before and after a download; ``progress`` shows huggingface_hub's progress
    bars (default: when stderr is a terminal). Raises :class:`HubError`.
    """
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import OfflineModeIsEnabled

    say = say or (lambda _line: None)
    token = os.environ.get("HF_TOKEN") or None
    net = (*_network_errors(), OfflineModeIsEnabled)
    try:
        info = HfApi(endpoint=endpoint(), token=token).model_info(ref.repo, revision=ref.revision, files_metadata=True,
                                                                  timeout=timeout())
    except Exception as e:
        failure = None if isinstance(e, net) else _hub_failure(ref, e)
        if failure is None and isinstance(e, (*net, OSError)):
            local = cached(ref)
            if local is not None:
                say(f"{ref}: {endpoint()} unreachable ({_short(e)}); using the cached {local}")
                return local
            failure = HubError(f"{ref}: cannot reach {endpoint()} ({_short(e)}), and the model is not in the "
                               f"cache {cache_dir()}: connect, set HF_ENDPOINT to a mirror, or copy the cache")
        if failure is None:
            raise
        raise failure from None
    names = ref.pick(s.rfilename for s in info.siblings or [])
    sizes = {s.rfilename: s.size for s in info.siblings or [] if s.size}
    todo = [n for n in names if not (_storage(ref) / "snapshots" / str(info.sha) / n).exists()]
    if todo:
        total = sum(sizes.get(n, 0) for n in todo)
        say(f"{ref}: downloading {', '.join(todo)}" + (f" ({_size(total)})" if total else "") +
            f" from {endpoint()} into {cache_dir()}")
    show = sys.stderr.isatty() if progress is None else progress
    start, paths = time.monotonic(), []
    for n in names:
        fresh = n in todo
        try:
            if fresh:  # asked first with our timeout: hf_hub_download retries a silent one for minutes
                get_hf_file_metadata(hf_hub_url(ref.repo, n, revision=ref.revision, endpoint=endpoint()),
                                     token=token, timeout=timeout())
            path = Path(_download(hf_hub_download, ref, n, token, show))
        except Exception as e:
            failure = _hub_failure(ref, e)
            if failure is None and isinstance(e, (*net, OSError)):
                failure = HubError(f"{ref}: downloading {n} from {endpoint()} failed: {_short(e)}")
            if failure is None:
                raise
            raise failure from None
        if fresh:
            _verify(ref, path)
        paths.append(path)
    if todo:
        say(f"{ref}: downloaded {paths[0]} in {time.monotonic() - start:.1f} s")
    return paths[0]


def _download(download: Any, ref: HubRef, name: str, token: str | None, progress: bool) -> str:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was = are_progress_bars_disabled()
    (enable_progress_bars if progress else disable_progress_bars)()
    try:
        return str(download(ref.repo, name, revision=ref.revision, cache_dir=str(cache_dir()), endpoint=endpoint(),
                            token=token, etag_timeout=timeout()))
    finally:
        (disable_progress_bars if was else enable_progress_bars)()


def _verify(ref: HubRef, path: Path) -> None:
    """A fresh download: GGUF magic, and the sha256 the Hub gave as its etag (a Git LFS file); a bad
    file is removed from the cache."""
    blob = path.resolve()
    problem = ""
    with open(blob, "rb") as fh:
        if path.name.endswith(".gguf") and fh.read(4) != b"GGUF":  # every part of a split GGUF has a header
            problem = "it is not a GGUF file"
        if not problem and re.fullmatch(r"[0-9a-f]{64}", blob.name):
            fh.seek(0)
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
            if digest != blob.name:
                problem = f"its sha256 {digest[:12]}... is not the Hub's {blob.name[:12]}..."
    if problem:
        for p in (path, blob):
            p.unlink(missing_ok=True)
        raise HubError(f"{ref}: the downloaded {path.name} was removed: {problem}")


def _short(e: BaseException) -> str:
    if "Timeout" in type(e).__name__ or isinstance(e, TimeoutError):  # httpx's ConnectTimeout, ReadTimeout, ...
        return f"no answer within {timeout():g} s, {TIMEOUT_ENV}: {type(e).__name__}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _few(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "") if names else "none"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF header says about a model (``llamapool models``)."""

    path: str
    size: int
    architecture: str
    context_length: int
    chat_template: str  # a family name: chatml, llama3, gemma, ...; "none" without a template
    description: str  # general.name and the size label, where the file has them


_FAMILIES = (("<|start_header_id|>", "llama3"), ("<start_of_turn>", "gemma"), ("<|im_start|>", "chatml"),
             ("<|channel|>", "harmony"), ("[INST]", "mistral"), ("<\uff5cUser\uff5c>", "deepseek"),
             ("<|user|>", "phi/zephyr"), ("<|turn>", "gemma"), ("<|User|>", "deepseek"))


def template_family(template: str) -> str:
    """The chat template's family, from the tokens it writes ("none" for no template, "other" when unknown)."""
    if not template:
        return "none"
    return next((family for marker, family in _FAMILIES if marker in template), "other")


_INFO_KEYS = ("general.architecture", "general.name", "general.size_label", "tokenizer.chat_template")


def gguf_info(path: str | os.PathLike[str]) -> GgufInfo:
    """Read the keys of a GGUF header that :class:`GgufInfo` shows (``gguf_header.py``: the tokenizer's
    long arrays are skipped, no weights are read; it stops once it has them all)."""
    from llamapool.gguf_header import read_fields

    def complete(f: dict[str, Any]) -> bool:
        return all(k in f for k in _INFO_KEYS) and f"{f['general.architecture']}.context_length" in f

    fields = read_fields(path, until=complete)

    def field(key: str) -> Any:
        v = fields.get(key)
        return v if isinstance(v, str | int | float) else None

    arch = str(field("general.architecture") or "?")
    ctx = field(f"{arch}.context_length")
    desc = " ".join(str(v) for v in (field("general.name"), field("general.size_label")) if v)
    return GgufInfo(str(path), os.path.getsize(path), arch, int(ctx) if ctx else 0,
                    template_family(str(field("tokenizer.chat_template") or "")), desc)
