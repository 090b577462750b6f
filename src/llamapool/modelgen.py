"""Random-weight llama GGUFs of any shape: the demo/test model, and benchmark models of real shapes.

Speed does not depend on weight values, so a random model of a real shape measures the same
decode cost as a trained one. Its output is gibberish: near-ties everywhere, so batches of other shapes
(rounding otherwise) pick other tokens. A ``peaked`` model has the same tensors (shapes, types, cost)
but a greedy output that no rounding changes: each token's successor wins by tens of logits.
"""

from __future__ import annotations

import itertools
import os
import string
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf

QTYPES = ("f32", "f16", "q8_0")
SPACE = "\u2581"  # SentencePiece's word-boundary marker
MIN_VOCAB = 300  # <unk> <s> </s>, 256 byte tokens, the ChatML tokens, and room for "▁" and ASCII
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")  # control tokens, last in the vocab; <|im_end|> ends a turn
# fill-in-the-middle (``fim``): the GGUF key of each role (tokenizer.ggml.fim_<role>_token_id, as llama.cpp's
# src/llama-vocab.cpp reads them) and its token, Qwen2.5-Coder's texts (which llama.cpp also finds by text);
# control tokens just before the ChatML ones
FIM_TOKENS = (("pre", "<|fim_prefix|>"), ("suf", "<|fim_suffix|>"), ("mid", "<|fim_middle|>"),
              ("pad", "<|fim_pad|>"), ("rep", "<|repo_name|>"), ("sep", "<|file_sep|>"))
# ChatML, as Hugging Face ChatML models write it (tokenizer.chat_template)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CHUNK = 1 << 22  # elements generated (and quantized) at a time
PEAK_EMBD_STD = 64.0  # peaked: token embeddings' std, against O(1) a layer that the blocks add
PEAK_LOGIT = 32.0  # peaked: the successor's logit; any other token's is about N(0, PEAK_LOGIT^2 / n_embd)
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part hello world llama pool token model server "
    "worker router request reply stream queue batch prompt text data over new sound take only little "
    "work know place year live me back give most very after thing our just name good sentence man "
    "think say great where help through much before line right too mean old any same tell boy follow "
    "came want show also around form three small set put end does another well large must big even "
    "such because turn here why ask went men read need land different home us move try kind hand "
    "picture again change off play spell air away animal house point page letter mother answer found "
    "study still learn should world high every near add food between own below country plant last "
    "school father keep tree never start city earth eye light thought head under story saw left few "
    "while along might close something seem next hard open example begin life always those both paper "
    "together got group often run important until children side feet car mile night walk white sea "
    "began grow took river four carry state once book hear stop without second later miss idea enough "
    "eat face watch far really almost let above girl sometimes mountain cut young talk soon list song "
    "being leave family"
)


def _closure(word: str) -> Iterator[str]:
    """Every piece SentencePiece may build on the way to ``word``: all its substrings, short ones first.

    With all of them in the vocab any adjacent pair inside the word can merge, so the whole word
    always ends up as one token whatever the merge order.
    """
    n = len(word)
    for size in range(2, n + 1):
        for i in range(n - size + 1):
            yield word[i : i + size]


def _pieces() -> Iterator[str]:
    """Normal pieces in priority order (with repeats; the caller dedups)."""
    yield SPACE
    yield from string.ascii_letters + string.digits + string.punctuation
    yield from "éèêàâçñüöäïøßåæ"
    yield from (SPACE + c for c in string.ascii_letters)
    words = _WORDS.split()
    for w in words:
        yield from _closure(SPACE + w)
    for w in words[:200]:
        yield from _closure(SPACE + w.capitalize())
    yield from (SPACE + d for d in string.digits)
    for n in (2, 3, 4):  # synthetic letter n-grams for large vocabs, all reachable by merges
        for prefix in ("", SPACE):
            yield from (prefix + "".join(t) for t in itertools.product(string.ascii_lowercase, repeat=n))


def build_vocab(n_vocab: int, fim: bool = False) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style vocab of exactly ``n_vocab`` tokens: (tokens, scores, token types).

    <unk>, <s>, </s>, the 256 byte-fallback tokens <0x00>..<0xFF>, then unique normal pieces with
    decreasing scores: single characters first, then common words (and every piece on the way to
    them), then synthetic letter n-grams; last, the control tokens: with ``fim`` the six of
    ``FIM_TOKENS``, then ChatML's <|im_start|> <|im_end|>.
    """
    import gguf

    if n_vocab < MIN_VOCAB:
        raise ValueError(f"n_vocab must be >= {MIN_VOCAB}, got {n_vocab}")
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(tt.UNKNOWN), int(tt.CONTROL), int(tt.CONTROL)] + [int(tt.BYTE)] * 256
    controls = [t for _, t in FIM_TOKENS] * fim + list(CHATML_TOKENS)
    n_normal = n_vocab - len(tokens) - len(controls)
    normal: dict[str, None] = {}  # insertion-ordered set
    for p in _pieces():
        normal.setdefault(p)
        if len(normal) == n_normal:
            break
    else:
        raise ValueError(f"n_vocab {n_vocab} is too large (at most {len(tokens) + len(normal) + len(controls)})")
    scores = [0.0] * len(tokens) + [-float(k) for k in range(n_normal + len(controls))]
    return (tokens + list(normal) + controls, scores,
            types + [int(tt.NORMAL)] * n_normal + [int(tt.CONTROL)] * len(controls))


def make_model(path: str | os.PathLike[str], *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
               n_head_kv: int = 2, n_ff: int = 128, n_vocab: int = 512, n_ctx_train: int = 32768,
               qtype: str = "f32", seed: int = 0, chat_template: str | None = CHATML_TEMPLATE,
               peaked: bool = False, fim: bool = False) -> Path:
    """Write a llama-architecture GGUF with random weights to ``path`` and return it as a Path.

    Weights are N(0, 1/fan_in) (token embeddings N(0, 1)), norms are 1, so activations stay
    O(1) and the logits are neither flat nor NaN. ``qtype`` ("f32", "f16", "q8_0") applies to
    the matrices; norms are always f32. Same arguments and seed give the same bytes. Tensors are
    generated and written one at a time, and the file appears atomically (written to a temp
    file beside it, then renamed). ``chat_template`` goes into ``tokenizer.chat_template`` (ChatML
    by default, whose control tokens are in the vocab; None: the model has no chat template).

    ``peaked``: the same tensors (names, shapes, types: the same decode cost), but greedy decoding
    follows :func:`peaked_next`, one cycle through every normal token, whatever the context, each
    successor ahead of every other token by about ``PEAK_LOGIT * (1 - sqrt(2 ln(n_vocab) / n_embd))``
    logits (over 16 at the default shape, over 28 at the 1B one), so no rounding changes the output:
    token embeddings have std ``PEAK_EMBD_STD``, so the blocks (weights as above, fed by RMS norms)
    barely move the residual stream, and row ``peaked_next(t)`` of ``output.weight`` is token ``t``'s
    embedding scaled to norm ``PEAK_LOGIT / sqrt(n_embd)``. Control and byte tokens embed as a normal
    token does (so are never anyone's successor), and their output rows are random ones of that norm.

    ``fim``: the vocab has the fill-in-the-middle tokens of ``FIM_TOKENS`` and the GGUF declares them
    (``tokenizer.ggml.fim_pre_token_id`` ...), as a code model's does: ``/infill`` and ``suffix`` serve it.
    """
    import gguf

    head_dim = _check_dims(n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx_train, qtype)
    if peaked and fim:
        raise ValueError("a peaked model has no FIM tokens: pass peaked or fim, not both")
    tokens, scores, types = build_vocab(n_vocab, fim)

    specs = _tensor_specs(n_embd, n_layer, n_head_kv * head_dim, n_ff, n_vocab)

    gtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[qtype]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[gtype]

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    try:
        _write_metadata(w, n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx_train, head_dim, ftype, tokens,
                        scores, types, chat_template, fim)
        # Declare all tensors up front, then generate and stream them one at a time in the same order,
        # so at most one tensor is in memory (GGUFWriter.add_tensor would hold them all until written).
        for name, shape, std in specs:
            if std is None:
                w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
            else:
                nbytes = shape[0] * shape[1] // block * type_size
                w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=gtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        ones = np.ones(n_embd, dtype=np.float32)
        embd: np.ndarray | None = None
        for name, shape, std in specs:
            if std is None:
                w.write_tensor_data(ones)
            elif peaked and name == "token_embd.weight":
                embd = _peaked_embd(rng, n_vocab, n_embd, gtype, seed)
                w.write_tensor_data(embd)
            elif peaked and name == "output.weight":
                assert embd is not None
                w.write_tensor_data(_peaked_output(rng, embd, n_embd, gtype, seed))
            else:
                w.write_tensor_data(_random_matrix(rng, shape, std, gtype))
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _peaked_cycle(n_vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the normal tokens in cycle order, ``alias``: the normal token whose embedding each token has)."""
    import gguf

    types = np.array(build_vocab(n_vocab)[2])
    normal = np.flatnonzero(types == int(gguf.TokenType.NORMAL))
    rng = np.random.default_rng([seed, 0x9EA4])  # apart from the weights' stream
    order = rng.permutation(normal)
    alias = np.arange(n_vocab)
    other = np.flatnonzero(types != int(gguf.TokenType.NORMAL))
    alias[other] = rng.choice(normal, len(other))
    return order, alias


def peaked_next(n_vocab: int, seed: int = 0) -> np.ndarray:
    """A ``peaked`` model's successor of every token (greedy decoding's next token after it, whatever
    came before): one cycle through all normal tokens in a random order; a control or byte token is
    followed by what follows the normal token it embeds as. Never a control or byte token."""
    order, alias = _peaked_cycle(n_vocab, seed)
    nxt = np.empty(n_vocab, dtype=np.int64)
    nxt[order] = np.roll(order, -1)
    return nxt[alias]


def _peaked_embd(rng: np.random.Generator, n_vocab: int, n_embd: int, gtype: gguf.GGMLQuantizationType,
                 seed: int) -> np.ndarray:
    """Random token embeddings of std ``PEAK_EMBD_STD``; a control or byte token's row is its alias's."""
    e = _random_matrix(rng, (n_vocab, n_embd), PEAK_EMBD_STD, gtype)
    alias = _peaked_cycle(n_vocab, seed)[1]
    moved = np.flatnonzero(alias != np.arange(n_vocab))
    e[moved] = e[alias[moved]]
    return e


def _peaked_output(rng: np.random.Generator, embd: np.ndarray, n_embd: int, gtype: gguf.GGMLQuantizationType,
                   seed: int) -> np.ndarray:
    """``output.weight`` of a peaked model: row ``next(t)`` is token ``t``'s embedding (as stored) scaled to
    norm ``PEAK_LOGIT / sqrt(n_embd)``; the other rows (control and byte tokens) random of that norm.
    Q8_0 rows are the embedding's blocks with a new scale: no rounding beyond the fp16 scale's."""
    import gguf

    n_vocab = embd.shape[0]
    order = _peaked_cycle(n_vocab, seed)[0]
    succ = np.roll(order, -1)
    norm = PEAK_LOGIT / np.sqrt(n_embd)
    out = _random_matrix(rng, (n_vocab, n_embd), norm / np.sqrt(n_embd), gtype)
    step = max(1, _CHUNK // n_embd)
    for i in range(0, len(order), step):
        src, dst = order[i : i + step], succ[i : i + step]
        rows = embd[src]
        if gtype == gguf.GGMLQuantizationType.Q8_0:
            blocks = rows.reshape(len(src), -1, 34)
            q = blocks[..., 2:].view(np.int8).astype(np.float32).reshape(len(src), -1)  # one scale a row
            scale = (norm / np.linalg.norm(q, axis=1)).astype(np.float16)
            blocks[..., :2] = scale.view(np.uint8).reshape(-1, 1, 2)
            out[dst] = blocks.reshape(len(src), -1)
        else:
            r = rows.astype(np.float32)
            out[dst] = (r * (norm / np.linalg.norm(r, axis=1, keepdims=True))).astype(out.dtype)
    return out


def _random_matrix(rng: np.random.Generator, shape: tuple[int, ...], std: float,
                   gtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """N(0, std^2) matrix of ``shape`` in ggml type ``gtype``, generated in row chunks to bound memory."""
    import gguf

    rows, cols = shape
    if gtype == gguf.GGMLQuantizationType.F32:
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(std)
        return a
    if gtype == gguf.GGMLQuantizationType.Q8_0:
        return _random_q8_0(rng, rows, cols, std)
    res: np.ndarray | None = None
    step = max(1, _CHUNK // cols)
    for r in range(0, rows, step):
        a = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        a *= np.float32(std)
        q = gguf.quants.quantize(a, gtype)
        if res is None:
            res = np.empty((rows, q.shape[1]), dtype=q.dtype)
        res[r : r + step] = q
    assert res is not None
    return res


def _random_q8_0(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """Q8_0 blocks written directly (an fp16 scale, then 32 int8), uniform with standard deviation
    ``std``: seconds for an 8B shape where quantising floats took minutes (speed does not depend on
    the weights' values)."""
    scale = np.float16(std / np.sqrt((255**2 - 1) / 12))  # the std of the integers -127..127
    out = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    out[..., :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    step = max(1, _CHUNK // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        out[r : r + n, :, 2:] = rng.integers(-127, 128, size=(n, cols // 32, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, cols // 32 * 34)


def _check_dims(n_embd: int, n_layer: int, n_head: int, n_head_kv: int, n_ff: int, n_ctx_train: int,
                qtype: str) -> int:
    """A ValueError naming what is wrong with the shape; else the head dimension."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    dims = {"n_embd": n_embd, "n_layer": n_layer, "n_head": n_head, "n_head_kv": n_head_kv,
            "n_ff": n_ff, "n_ctx_train": n_ctx_train}
    for k, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"n_embd ({n_embd}) must divide by n_head ({n_head}), "
                         f"and n_head by n_head_kv ({n_head_kv})")
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"head dim n_embd/n_head = {head_dim} must be even (RoPE rotates pairs)")
    if qtype == "q8_0" and (n_embd % 32 or n_ff % 32):
        raise ValueError(f"q8_0 needs n_embd and n_ff to be multiples of 32, got {n_embd} and {n_ff}")
    return head_dim


def _tensor_specs(n_embd: int, n_layer: int, kv: int, n_ff: int, n_vocab: int
                  ) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(name, numpy shape (out, in), std) of every tensor in file order; std None marks a norm weight
    (ones, always f32)."""
    e, f = n_embd**-0.5, n_ff**-0.5
    specs: list[tuple[str, tuple[int, ...], float | None]] = [
        ("token_embd.weight", (n_vocab, n_embd), 1.0)]
    for i in range(n_layer):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", (n_embd,), None),
                  (b + "attn_q.weight", (n_embd, n_embd), e),
                  (b + "attn_k.weight", (kv, n_embd), e),
                  (b + "attn_v.weight", (kv, n_embd), e),
                  (b + "attn_output.weight", (n_embd, n_embd), e),
                  (b + "ffn_norm.weight", (n_embd,), None),
                  (b + "ffn_gate.weight", (n_ff, n_embd), e),
                  (b + "ffn_up.weight", (n_ff, n_embd), e),
                  (b + "ffn_down.weight", (n_embd, n_ff), f)]
    specs += [("output_norm.weight", (n_embd,), None),
              ("output.weight", (n_vocab, n_embd), 2.0 * e)]

    return specs


def _write_metadata(w: Any, n_embd: int, n_layer: int, n_head: int, n_head_kv: int, n_ff: int,
                    n_ctx_train: int, head_dim: int, ftype: Any, tokens: list[str], scores: list[float],
                    types: list[int], chat_template: str | None, fim: bool = False) -> None:
    import gguf

    w.add_name("llamapool-random")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_eot_token_id(len(tokens) - 1)  # <|im_end|>
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for role, text in FIM_TOKENS * fim:  # as llama.cpp's src/llama-vocab.cpp reads them
        w.add_uint32(f"tokenizer.ggml.fim_{role}_token_id", tokens.index(text))


RERANK_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4: pad, unk, cls (BOS), sep, mask
RERANK_ARCHS = ("bert", "qwen3")
# a rerank template of Qwen3-Reranker's form (llama-server replaces {query} and {document}): ChatML, whose
# control tokens the generator's vocab has; the model's answer would be "yes" or "no"
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query provided. "
    "Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Query>: {query}\n"
    "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"
)


def build_wordpiece_vocab(n_vocab: int) -> tuple[list[str], list[int]]:
    """A WordPiece vocab as llama.cpp's BERT tokenizer (WPM) reads it: (tokens, token types). The BERT
    specials first, then the normal pieces of :func:`build_vocab` without byte tokens: a piece starting
    with "▁" begins a word, any other continues one (the "phantom space" form convert_hf_to_gguf.py
    writes for ``##`` pieces). Lowercase text tokenizes into whole words; an unknown word is [UNK]."""
    import gguf

    if n_vocab < MIN_VOCAB:
        raise ValueError(f"n_vocab must be >= {MIN_VOCAB}, got {n_vocab}")
    tt = gguf.TokenType
    normal: dict[str, None] = {}
    for p in _pieces():
        normal.setdefault(p)
        if len(normal) == n_vocab - len(RERANK_SPECIALS):
            break
    types = [int(tt.CONTROL), int(tt.UNKNOWN), int(tt.CONTROL), int(tt.CONTROL), int(tt.CONTROL)]
    return list(RERANK_SPECIALS) + list(normal), types + [int(tt.NORMAL)] * len(normal)


def make_reranker(path: str | os.PathLike[str], *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                  n_ff: int = 128, n_vocab: int = 512, n_ctx_train: int = 512, seed: int = 0,
                  rerank_template: str | None = None, arch: str = "bert") -> Path:
    """Write a random-weight BERT cross-encoder GGUF (the shape of bge-reranker-base) that llama.cpp
    loads with rank pooling, and return it as a Path.

    Architecture ``bert`` (bidirectional, absolute positions, LayerNorms with biases), a WordPiece vocab
    (:func:`build_wordpiece_vocab`; [CLS] is BOS, [SEP] the separator), ``bert.pooling_type = rank`` and
    the classification head llama.cpp's RANK pooling applies to the [CLS] row: ``cls`` (n_embd x n_embd,
    tanh) then ``cls.output`` (one label: the relevance score, a raw logit). Weights N(0, 1/fan_in),
    norms 1, biases N(0, 0.1); all f32; same arguments and seed give the same bytes. ``rerank_template``
    goes into ``tokenizer.chat_template.rerank`` (llama-server's prompt with ``{query}`` and
    ``{document}``, as Qwen3-Reranker GGUFs carry); None: the pair is [CLS] query [SEP] document.

    ``arch="qwen3"``: a causal reranker of Qwen3-Reranker's layout instead: the Qwen3 decoder (the
    tensors of :func:`make_model` and per-head q/k RMS norms, the SentencePiece vocab of
    :func:`build_vocab`), a two-label ``cls.output`` ("yes", "no") that llama.cpp's rank pooling applies
    to the last token and softmaxes (the score: P(yes)), and ``rerank_template`` defaulting to
    :data:`QWEN3_RERANK_TEMPLATE`.
    """
    if arch not in RERANK_ARCHS:
        raise ValueError(f"arch must be one of {RERANK_ARCHS}, got {arch!r}")
    if arch == "qwen3":
        return _write_reranker(path, "qwen3", *_qwen3_reranker(n_embd, n_layer, n_head, n_ff, n_vocab, n_ctx_train,
                                                                seed, rerank_template or QWEN3_RERANK_TEMPLATE))
    _check_dims(n_embd, n_layer, n_head, n_head, n_ff, n_ctx_train, "f32")
    tokens, types = build_wordpiece_vocab(n_vocab)
    tensors = _reranker_tensors(np.random.default_rng(seed), n_embd, n_layer, n_ff, n_vocab, n_ctx_train)

    def metadata(w: Any) -> None:
        _reranker_metadata(w, n_embd, n_layer, n_head, n_ff, n_ctx_train, tokens, types, rerank_template)

    return _write_reranker(path, "bert", metadata, tensors)


def _write_reranker(path: str | os.PathLike[str], arch: str, metadata: Any,
                    tensors: list[tuple[str, np.ndarray]]) -> Path:
    """Write a small GGUF of ``arch`` (``metadata(writer)`` adds its keys) atomically; return its Path."""
    import gguf

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, arch)
    try:
        metadata(w)
        for name, data in tensors:
            w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _reranker_metadata(w: Any, n_embd: int, n_layer: int, n_head: int, n_ff: int, n_ctx_train: int,
                       tokens: list[str], types: list[int], rerank_template: str | None) -> None:
    import gguf

    w.add_name("llamapool-random-reranker")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_classifier_output_labels(["relevance"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(2)
    w.add_pad_token_id(0)
    w.add_unk_token_id(1)
    w.add_bos_token_id(2)
    w.add_sep_token_id(3)
    w.add_mask_token_id(4)
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    w.add_add_eos_token(False)
    if rerank_template is not None:
        w.add_chat_template([{"name": "rerank", "template": rerank_template}])


def _reranker_tensors(rng: np.random.Generator, n_embd: int, n_layer: int, n_ff: int, n_vocab: int,
                      n_ctx_train: int) -> list[tuple[str, np.ndarray]]:
    """A BERT cross-encoder's tensors (llama.cpp's names; numpy shapes are (out, in)) in file order."""
    e, f = n_embd**-0.5, n_ff**-0.5

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)

    def vec(n: int, std: float = 0.1) -> np.ndarray:
        return rng.standard_normal(n, dtype=np.float32) * np.float32(std)

    ones = np.ones(n_embd, dtype=np.float32)
    tensors: list[tuple[str, np.ndarray]] = [
        ("token_embd.weight", mat(n_vocab, n_embd, 1.0)), ("token_types.weight", mat(2, n_embd, 0.1)),
        ("position_embd.weight", mat(n_ctx_train, n_embd, 0.1)),
        ("token_embd_norm.weight", ones), ("token_embd_norm.bias", vec(n_embd))]
    for i in range(n_layer):
        b = f"blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors += [(b + name + ".weight", mat(n_embd, n_embd, e)), (b + name + ".bias", vec(n_embd))]
        tensors += [(b + "attn_output_norm.weight", ones), (b + "attn_output_norm.bias", vec(n_embd)),
                    (b + "ffn_up.weight", mat(n_ff, n_embd, e)), (b + "ffn_up.bias", vec(n_ff)),
                    (b + "ffn_down.weight", mat(n_embd, n_ff, f)), (b + "ffn_down.bias", vec(n_embd)),
                    (b + "layer_output_norm.weight", ones), (b + "layer_output_norm.bias", vec(n_embd))]
    tensors += [("cls.weight", mat(n_embd, n_embd, e)), ("cls.bias", vec(n_embd)),
                ("cls.output.weight", mat(1, n_embd, 4.0 * e)), ("cls.output.bias", vec(1))]
    return tensors


def _qwen3_reranker(n_embd: int, n_layer: int, n_head: int, n_ff: int, n_vocab: int, n_ctx_train: int, seed: int,
                    template: str) -> tuple[Any, list[tuple[str, np.ndarray]]]:
    """A Qwen3 cross-encoder's metadata writer and tensors (all f32)."""
    import gguf

    n_head_kv = max(1, n_head // 2)
    head_dim = _check_dims(n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx_train, "f32")
    tokens, scores, types = build_vocab(n_vocab)
    rng = np.random.default_rng(seed)
    tensors: list[tuple[str, np.ndarray]] = []
    for name, shape, std in _tensor_specs(n_embd, n_layer, n_head_kv * head_dim, n_ff, n_vocab):
        f32 = gguf.GGMLQuantizationType.F32
        tensors.append((name, np.ones(shape, np.float32) if std is None else _random_matrix(rng, shape, std, f32)))
    for i in range(n_layer):
        tensors += [(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, np.float32)),
                    (f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, np.float32))]
    tensors.append(("cls.output.weight", rng.standard_normal((2, n_embd), dtype=np.float32)
                    * np.float32(4.0 * n_embd**-0.5)))

    def metadata(w: Any) -> None:
        _write_metadata(w, n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx_train, head_dim,
                        gguf.LlamaFileType.ALL_F32, tokens, scores, types, None)
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_chat_template([{"name": "rerank", "template": template}])

    return metadata, tensors


LORA_TARGETS = ("attn_q", "attn_v", "ffn_up")  # make_lora's default: the matrices an adapter changes


def make_lora(path: str | os.PathLike[str], base: str | os.PathLike[str], *, rank: int = 8, alpha: float = 16.0,
              targets: tuple[str, ...] = LORA_TARGETS, seed: int = 1) -> Path:
    """Write a random-weight LoRA adapter GGUF for the GGUF ``base`` (one :func:`make_model` wrote, or any
    llama.cpp model with those matrices) to ``path`` and return it as a Path.

    As llama.cpp's ``llama_adapter_lora_init`` reads one (src/llama-adapter.cpp): ``general.type`` =
    "adapter", the base's ``general.architecture``, ``adapter.type`` = "lora", ``adapter.lora.alpha``; for
    each of the base's ``blk.N.<target>.weight`` (``targets``) the pair ``blk.N.<target>.weight.lora_a``
    (numpy shape (rank, in)) and ``.lora_b`` ((out, rank)), f32. llama.cpp adds ``scale * alpha / rank * B @
    A`` to the matrix; A is N(0, 1/in) and B N(0, 1/rank), so at alpha = rank and scale 1 the change is as
    large as the matrix itself (the defaults double it): greedy output differs from the base's. Same arguments
    give the same bytes; the file appears atomically."""
    import gguf

    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    reader = gguf.GGUFReader(str(base))
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{base}: no general.architecture: not a model GGUF")
    wanted = [(t.name, int(t.shape[1]), int(t.shape[0])) for t in reader.tensors  # ggml ne: (in, out)
              if len(t.shape) == 2 and t.name.endswith(".weight") and t.name.split(".")[-2] in targets
              and t.name.startswith("blk.")]
    if not wanted:
        raise ValueError(f"{base}: none of the matrices {', '.join(targets)} is in the model")
    rng, f32 = np.random.default_rng(seed), gguf.GGMLQuantizationType.F32
    tensors = []
    for name, n_out, n_in in wanted:
        tensors += [(f"{name}.lora_a", _random_matrix(rng, (rank, n_in), n_in**-0.5, f32)),
                    (f"{name}.lora_b", _random_matrix(rng, (n_out, rank), rank**-0.5, f32))]

    def metadata(w: Any) -> None:
        w.add_name("llamapool-random-lora")
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))

    return _write_reranker(path, str(arch_field.contents()), metadata, tensors)
