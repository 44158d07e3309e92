"""Build a tiny random-weight checkpoint of any vlmq family offline.

Tests need a *real* mlx-vlm model (real architecture, real processor, real
`mlx_vlm.load`) but no hub access and no large weights. This writes one in the
exact on-disk format mlx-vlm reads: MLX safetensors, config.json, a byte-level
BPE tokenizer trained on built-in text, the family's chat template and
preprocessor config. What differs per family is its file's `TinyBuild`
(vlmq.worker.model.families); this module is the one builder. Same arch + seed gives
byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vlmq.worker.model import blas, families
from vlmq.worker.model.families import TinyBuild

# The Qwen2 pre-tokenizer regex; transformers' Qwen2Tokenizer rebuilds the
# pipeline from it, so ours must be identical or encodings drift.
_QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Training text for the BPE merges: enough variety for a few hundred merges.
_CORPUS: tuple[str, ...] = (
    "Convert this page to clean Markdown while preserving reading order.",
    "Describe this image in one or two sentences.",
    "Text Recognition: the quick brown fox jumps over the lazy dog.",
    "Invoice number 12345, dated 2024-03-17. Total due: $1,234.56 (net 30 days).",
    "# Heading\n\n| Column A | Column B |\n|---|---|\n| 1 | 2 |\n\n- item one\n- item two\n",
    "A photograph of a red bicycle leaning against a white wall in the afternoon sun.",
    "The document contains tables, figures, footnotes and equations such as E = mc^2.",
    "Chapter 3. Results and discussion. We observe that the model reads every line.",
    "Please transcribe the handwritten note: 'Meet me at 10:30 near the old library.'",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "You are a helpful assistant. The user asks a question and the assistant answers.",
    "Page 7 of 12 -- Appendix B: configuration options, defaults and environment.",
)

# Size presets: "bench" is the ~20 M-parameter model of benchmarks/run.py, big enough
# that matmuls (and so the BLAS and batching) dominate, as in real models.
# (text overrides, weight scale; None: the family's own). The vision overrides are the
# family's own (TinyBuild.sizes), and a size exists only for families that list it.
SIZES: dict[str, tuple[dict[str, Any], float | None]] = {
    "tiny": ({}, None),
    "bench": (
        {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6,
         "num_attention_heads": 8, "num_key_value_heads": 2,
         "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}},
        1.5,
    ),
}
_STAMP = "vlmq-tiny.json"  # written last: marks a complete build


def build_tiny_model(out_dir: Path, arch: str = "qwen2_vl", seed: int = 0,
                     size: str = "tiny") -> Path:
    """Write (or reuse) a tiny checkpoint of family `arch` in `out_dir`; return that folder."""
    found = families.find(arch)
    if found is None:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {families.names()}")
    build = found.tiny
    if size not in SIZES or (size != "tiny" and size not in build.sizes):
        raise ValueError(f"no {size!r} size for arch {arch!r}")
    out_dir = Path(out_dir)
    # The recipe's digest: editing a family's build rebuilds its folder.
    recipe = hashlib.sha256(json.dumps(asdict(build), sort_keys=True).encode()).hexdigest()
    stamp = {"arch": arch, "seed": seed, "version": 2, "recipe": recipe[:16]}
    if size != "tiny":
        stamp["size"] = size
    stamp_path = out_dir / _STAMP
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)

    ids = write_tokenizer(out_dir, build)
    text, size_scale = SIZES[size]
    config = {**fill(build.config, ids), **text}
    if size in build.sizes:
        config["vision_config"] = {**config["vision_config"], **build.sizes[size]}
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "preprocessor_config.json", build.preprocessor)
    for name, data in build.extra_files.items():
        write_json(out_dir / name, data)
    _write_weights(out_dir / "model.safetensors", config, seed,
                   build.weight_scale if size_scale is None else size_scale,
                   build.embed_scale)
    write_json(stamp_path, stamp)
    return out_dir


def _context_length(config: dict[str, Any]) -> int:
    """The tokenizer's model_max_length follows the config (top level or text_config)."""
    text = {**config, **config.get("text_config", {})}
    return int(text["max_position_embeddings"])


def fill(value: Any, ids: dict[str, int]) -> Any:
    """Replace "@<token>" / "@vocab" placeholders with the trained tokenizer's ids."""
    if isinstance(value, dict):
        return {k: fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, ids) for v in value]
    if isinstance(value, str) and value.startswith("@"):
        return ids["__len__"] if value == "@vocab" else ids[value[1:]]
    return value


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _move_specials(tok: Any, first_id: int) -> Any:
    """The same tokenizer with its added tokens renumbered from `first_id`.

    The gap is filled with unused tokens (no merge makes them), since mlx-vlm's
    streaming detokenizer needs dense ids.
    """
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    learned = max(vocab.values()) + 1
    vocab.update({f"<unused{i}>": i for i in range(learned, first_id)})
    for k, entry in enumerate(data["added_tokens"]):
        entry["id"] = first_id + k
        data["model"]["vocab"][entry["content"]] = first_id + k  # else ids are reassigned
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer(out_dir: Path, build: TinyBuild, vocab_size: int = 600) -> dict[str, int]:
    """Train the BPE, append the family's specials, write all tokenizer files; return ids.

    `vocab_size` 256 learns no merge: one token per byte, a character-level tokenizer
    for ASCII text (the trained reader's, worker/model/reader) that Qwen2Tokenizer
    still rebuilds identically."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    tok.add_special_tokens(list(build.specials))
    if build.specials_at is not None:
        tok = _move_specials(tok, build.specials_at)
    tok.save(str(out_dir / "tokenizer.json"))

    ids: dict[str, int] = {}
    for t in build.specials:
        token_id = tok.token_to_id(t)
        if token_id is None:
            raise RuntimeError(f"special token {t} missing after training")
        ids[t] = token_id
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    named = {build.eos, build.pad, build.bos}
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": build.tokenizer_class,
            "added_tokens_decoder": added,
            "additional_special_tokens": [t for t in build.specials if t not in named],
            "bos_token": build.bos,
            "eos_token": build.eos,
            "pad_token": build.pad,
            "unk_token": None,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "model_max_length": _context_length(build.config),
            "split_special_tokens": False,
            "chat_template": build.chat_template,
            **build.tokenizer_extra,
        },
    )
    write_json(out_dir / "chat_template.json", {"chat_template": build.chat_template})
    ids["__len__"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


def _write_weights(path: Path, config: dict[str, Any], seed: int, scale: float,
                   embed_scale: float | None) -> None:
    """Instantiate mlx-vlm's own class with seeded random init and save it MLX-style."""
    blas.select()  # before MLX loads
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = json.loads(json.dumps(config))  # from_dict adds text_config to the dict it gets
    module, _ = get_model_and_args(config=cfg)
    model_config = module.ModelConfig.from_dict(cfg)
    model_config = update_module_configs(  # type: ignore[no-untyped-call]
        model_config, module, cfg, ["text", "vision"]
    )
    mx.random.seed(seed)
    model = module.Model(model_config)
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    embed = scale if embed_scale is None else embed_scale
    weights = {k: (v * (embed if "embed_tokens" in k else scale) if v.ndim >= 2 else v)
               for k, v in flat}
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
