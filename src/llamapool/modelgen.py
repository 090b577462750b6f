"""Random-weight llama GGUFs of any shape: the demo/test model, and benchmark models of real shapes.

Speed does not depend on weight values, so a random model of a real shape measures the same
decode cost as a trained one. Its output is gibberish.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import numpy as np

QTYPES = ("f32", "f16", "q8_0")


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style vocab: <unk> <s> </s>, 256 byte tokens, then normal pieces."""
    import gguf

    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL] + [tt.BYTE] * 256
    seen = set(tokens)
    words = ("the of and to in is you that it he was for on are as with his they at be this have "
             "from or one had by word but not what all were we when your can said there use an each "
             "which she do how their if will up other about out many then them these so some her "
             "would make like him into time has look two more write go see number no way could "
             "people my than first water been call who oil its now find long down day did get come "
             "made may part hello world llama pool token model server worker router").split()
    pieces = ["\u2581"] + list(string.ascii_letters + string.digits + string.punctuation)
    pieces += ["\u2581" + w for w in words] + words
    pieces += ["\u2581" + c for c in string.ascii_letters]
    pieces += [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    normal: list[str] = []
    for p in pieces:
        if p not in seen:
            seen.add(p)
            normal.append(p)
    i = 0
    while len(tokens) + len(normal) < n_vocab:  # synthetic pieces for large vocabs
        p = f"\u2581{string.ascii_lowercase[i % 26]}{i}"
        i += 1
        if p not in seen:
            seen.add(p)
            normal.append(p)
    normal = normal[: n_vocab - len(tokens)]
    scores = [0.0] * len(tokens) + [-float(k) for k in range(len(normal))]
    # longer pieces first: SentencePiece merges prefer higher scores
    order = sorted(range(len(normal)), key=lambda k: (-len(normal[k]), k))
    normal = [normal[k] for k in order]
    return tokens + normal, scores, [int(t) for t in types] + [int(tt.NORMAL)] * len(normal)


def make_model(path: str | os.PathLike[str], *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
               n_head_kv: int = 2, n_ff: int = 128, n_vocab: int = 512, n_ctx_train: int = 4096,
               qtype: str = "f32", seed: int = 0) -> Path:
    """Write a llama-architecture GGUF with random weights and return its path."""
    import gguf

    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    if n_vocab < 300:
        raise ValueError("n_vocab must be >= 300 (259 special and byte tokens plus pieces)")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    if qtype == "q8_0" and (n_embd % 32 or n_ff % 32):
        raise ValueError("q8_0 needs n_embd and n_ff to be multiples of 32")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("llamapool-random")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7}[qtype])
    tokens, scores, types = _vocab(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def mat(name: str, rows: int, cols: int, std: float) -> None:
        a = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        if qtype == "f16":
            w.add_tensor(name, a.astype(np.float16))
        elif qtype == "q8_0":
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    kv = n_head_kv * head_dim
    mat("token_embd.weight", n_vocab, n_embd, 1.0)
    for i in range(n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        mat(f"blk.{i}.attn_q.weight", n_embd, n_embd, n_embd**-0.5)
        mat(f"blk.{i}.attn_k.weight", kv, n_embd, n_embd**-0.5)
        mat(f"blk.{i}.attn_v.weight", kv, n_embd, n_embd**-0.5)
        mat(f"blk.{i}.attn_output.weight", n_embd, n_embd, n_embd**-0.5)
        norm(f"blk.{i}.ffn_norm.weight")
        mat(f"blk.{i}.ffn_gate.weight", n_ff, n_embd, n_embd**-0.5)
        mat(f"blk.{i}.ffn_up.weight", n_ff, n_embd, n_embd**-0.5)
        mat(f"blk.{i}.ffn_down.weight", n_embd, n_ff, n_ff**-0.5)
    norm("output_norm.weight")
    mat("output.weight", n_vocab, n_embd, 2.0 * n_embd**-0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
