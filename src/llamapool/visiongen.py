"""A random-weight vision model for tests: a text GGUF (``modelgen.make_model``) and its mmproj GGUF, a tiny
SigLIP-style encoder with Gemma 3's projector (libmtmd's ``gemma3``: the ViT, an average pool of
``n_merge`` x ``n_merge`` patches, an RMS norm and one matrix into the text model's embedding width).

The encoder's weights are random like the text model's, so its embeddings differ from image to image and
the text model's greedy reply depends on the image; an image is resized to ``image_size`` square pixels
and becomes ``(image_size / patch_size / n_merge)^2`` tokens (16 by default: 64 px, 8 px patches, 2 x 2
pooled).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from llamapool.modelgen import make_model

# make-model --vision-tower: the projector's shape (image side, patch, pooling, width, layers, heads, FFN)
TOWERS = {
    "tiny": {"image_size": 64, "patch_size": 8, "n_merge": 2, "v_embd": 32, "v_layer": 1, "v_head": 2, "v_ff": 64},
    # Gemma 3's (SigLIP So400m): 896 px, 14 px patches, 4 x 4 pooling: 256 tokens an image
    "siglip-so400m": {"image_size": 896, "patch_size": 14, "n_merge": 4, "v_embd": 1152, "v_layer": 27,
                      "v_head": 16, "v_ff": 4304},
}
MODEL_FILE = "model.gguf"
MMPROJ_FILE = "mmproj.gguf"


def make_vision_model(folder: str | os.PathLike[str], *, n_embd: int = 64, n_layer: int = 2, n_vocab: int = 512,
                      image_size: int = 64, patch_size: int = 8, n_merge: int = 2, v_embd: int = 32,
                      v_layer: int = 1, v_head: int = 2, v_ff: int = 64, seed: int = 0,
                      **text: Any) -> tuple[Path, Path]:
    """Write ``folder/model.gguf`` (a random llama model, ChatML template; ``text``: more of
    :func:`make_model`'s shape arguments) and ``folder/mmproj.gguf`` (its projector); return both paths.
    Same arguments, same bytes."""
    side = image_size // patch_size
    if image_size % patch_size or side % n_merge:
        raise ValueError(f"image_size ({image_size}) must divide by patch_size ({patch_size}), and the "
                         f"patches a side ({side}) by n_merge ({n_merge})")
    if v_embd % v_head or (v_embd // v_head) % 2:
        raise ValueError(f"v_embd ({v_embd}) must divide by v_head ({v_head}) into an even head size")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(out / MODEL_FILE, n_embd=n_embd, n_layer=n_layer, n_vocab=n_vocab, seed=seed, **text)
    mmproj = out / MMPROJ_FILE
    tmp = mmproj.with_name(f".{mmproj.name}.{os.getpid()}.tmp")
    try:
        _write_mmproj(tmp, n_embd, image_size, patch_size, n_merge, v_embd, v_layer, v_head, v_ff, seed)
        os.replace(tmp, mmproj)
    finally:
        tmp.unlink(missing_ok=True)
    return model, mmproj


def _tensors(n_embd: int, patch: int, n_patches: int, v_embd: int, v_layer: int, v_ff: int,
             rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """(name, array in numpy's order: ggml's shape reversed) of every projector tensor, random
    N(0, 1/fan_in) matrices, unit norms, zero biases."""
    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    fan = 3 * patch * patch
    conv = (rng.standard_normal((v_embd, 3, patch, patch), dtype=np.float32) / np.float32(np.sqrt(fan)))
    t: list[tuple[str, np.ndarray]] = [
        ("v.patch_embd.weight", conv.astype(np.float32)),
        ("v.patch_embd.bias", zeros(v_embd)),
        ("v.position_embd.weight", (rng.standard_normal((n_patches, v_embd), dtype=np.float32) * 0.1)),
    ]
    for i in range(v_layer):
        b = f"v.blk.{i}."
        t += [(b + "ln1.weight", ones(v_embd)), (b + "ln1.bias", zeros(v_embd))]
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t += [(b + name + ".weight", mat(v_embd, v_embd)), (b + name + ".bias", zeros(v_embd))]
        t += [(b + "ln2.weight", ones(v_embd)), (b + "ln2.bias", zeros(v_embd)),
              (b + "ffn_up.weight", mat(v_ff, v_embd)), (b + "ffn_up.bias", zeros(v_ff)),
              (b + "ffn_down.weight", mat(v_embd, v_ff)), (b + "ffn_down.bias", zeros(v_embd))]
    t += [("v.post_ln.weight", ones(v_embd)), ("v.post_ln.bias", zeros(v_embd)),
          ("mm.soft_emb_norm.weight", ones(v_embd)),
          # ggml [n_embd, v_embd]: the graph multiplies by its transpose (clip_graph_siglip)
          ("mm.input_projection.weight", mat(n_embd, v_embd).T.copy())]
    return t


def _write_mmproj(path: Path, n_embd: int, image_size: int, patch: int, n_merge: int, v_embd: int, v_layer: int,
                  v_head: int, v_ff: int, seed: int) -> None:
    import gguf

    w = gguf.GGUFWriter(path, "clip")
    try:
        w.add_name("llamapool-random-mmproj")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_string("clip.projector_type", "gemma3")
        w.add_bool("clip.has_vision_encoder", True)
        w.add_bool("clip.has_audio_encoder", False)
        w.add_bool("clip.use_gelu", True)
        w.add_uint32("clip.vision.image_size", image_size)
        w.add_uint32("clip.vision.patch_size", patch)
        w.add_uint32("clip.vision.embedding_length", v_embd)
        w.add_uint32("clip.vision.feed_forward_length", v_ff)
        w.add_uint32("clip.vision.block_count", v_layer)
        w.add_uint32("clip.vision.projection_dim", n_embd)
        w.add_uint32("clip.vision.attention.head_count", v_head)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        w.add_uint32("clip.vision.projector.scale_factor", n_merge)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        rng = np.random.default_rng([seed, 0x715])
        n_patches = (image_size // patch) ** 2
        for name, a in _tensors(n_embd, patch, n_patches, v_embd, v_layer, v_ff, rng):
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
