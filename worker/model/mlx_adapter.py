"""The one place vlmq touches mlx-vlm's model and processor APIs.

mlx-vlm's API has moved between minor versions, and some of what vlmq needs
(numpy-only preprocessing, rebuilding prompt ids from a cached grid, feeding
cached vision features back in) is a use of it that upstream does not
advertise. Keeping all of it here means a version bump is checked against one
module and its tests (tests/worker/model/test_mlx_adapter.py), not the whole worker.

Two kinds of function live here, and the split matters:
- CPU side (`format_prompt`, `prepare`, `prepare_from_grid`): numpy and PIL
  only, safe to run in a thread pool while the MLX thread is busy.
- MLX side (`load_model`, `vision_features`, `build_prompt_kwargs`,
  `features_from_numpy`): must only run on the engine's single MLX thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmq.shared.chat import Message
from vlmq.worker.model import families, names
from vlmq.worker.model.families import FamilySpec

# Families a worker refuses at start, and why (the missing piece and where it lives).
# Not family files: vlmq cannot build a tiny one, so it cannot verify them.
REFUSED: dict[str, str] = {
    "deepseekocr": (
        "mlx-vlm 0.7.10 builds DeepSeek-OCR's SAM encoder from fixed defaults "
        "(mlx_vlm/models/deepseekocr/deepseekocr.py: SAMEncoder(SAMViTConfig()), 768 wide, "
        "12 layers, 1024 px) whatever config.json says, and its processor pads every image "
        "to 1024 px, so no small offline build exists and vlmq has not verified that "
        "batched output equals sequential generate for it"
    ),
}


def family_of(model_type: str) -> FamilySpec:
    """The adapter spec of a served family (ValueError for any other model type)."""
    return families.get(model_type).spec


# HF fast tokenizers raise "Already borrowed" when one instance is used from
# several threads at once; tokenizing is cheap, so serialise it.
_TOKENIZER_LOCK = threading.Lock()


# ---------------------------------------------------------------- library log noise


class _Drop(logging.Filter):
    """Drops a library's records that start with one of `starts`; with `scoped`, only
    while this thread is inside `scope()` (a call known to provoke them for nothing)."""

    def __init__(self, starts: tuple[str, ...], *, scoped: bool = False) -> None:
        super().__init__()
        self.starts = starts
        self.scoped = scoped
        self._local = threading.local()

    @contextmanager
    def scope(self) -> Iterator[None]:
        self._local.active = True
        try:
            yield
        finally:
            self._local.active = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.scoped and not getattr(self._local, "active", False):
            return True
        return not record.getMessage().startswith(self.starts)


# vlmq runs MLX, never PyTorch: transformers says so on import, for nothing.
_NO_TORCH = _Drop(("PyTorch was not found.",))
# mlx-vlm's apply_chat_template adds enable_thinking=False whenever the processor's
# apply_chat_template takes **kwargs (all do), not when the template reads it; transformers
# then warns that a kwarg the template lacks belongs in processor_kwargs. Rendering with
# tokenize=False uses no processor kwargs, and a template without the variable renders
# the same (tests/worker/prep/test_image_size.py). Dropped only inside format_prompt.
_TEMPLATE_KWARGS = _Drop(("Kwargs passed to `processor.__call__` have to be in",),
                         scoped=True)
_NOISE = {"transformers": _NO_TORCH, "transformers.processing_utils": _TEMPLATE_KWARGS}


def quiet_library_noise() -> None:
    """Filter the transformers lines above (std logging filters on its named loggers, which
    transformers' own logging module hands out). Call before transformers is imported (the
    PyTorch line comes at import); idempotent."""
    for name, drop in _NOISE.items():
        logger = logging.getLogger(name)
        if drop not in logger.filters:
            logger.addFilter(drop)


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded (bad path, offline hub, bad checkpoint).

    `network`: the hub could not be reached (DNS, refused, timed out), which a later try
    may fix; any other load error is the configuration's and stays until someone changes
    it (the worker exits EX_CONFIG so that a service manager stops restarting it).
    """

    @property
    def network(self) -> bool:
        return _network_failure(self)


def _network_failure(exc: BaseException) -> bool:
    """Whether the cause chain holds a socket-level failure (the hub's client wraps them).
    Offline mode (HF_HUB_OFFLINE) is a ConnectionError to the hub, but chosen: no restart
    will download what is not cached."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OfflineModeIsEnabled):
            return False
        if isinstance(cause, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    processor: Any
    model_id: str
    model_type: str
    cacheable: bool
    context_length: int
    fingerprint: str  # changes when the weights or configs change; part of cache keys
    family: FamilySpec


@dataclass(frozen=True)
class Prepared:
    """One item ready for the MLX thread.

    `input_ids` is None only for families prepared on the MLX thread
    (`deferred_image`/`text` set instead), see `prepare`.
    """

    text: str
    input_ids: np.ndarray | None
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    deferred_image: Image.Image | None = None

    @property
    def prompt_tokens(self) -> int | None:
        return None if self.input_ids is None else int(self.input_ids.shape[0])


# ---------------------------------------------------------------- loading


def load_model(model_path: str) -> LoadedModel:
    """Load through `mlx_vlm.load`: a local folder offline, else a hub id via its normal path."""
    quiet_library_noise()  # before mlx_vlm imports transformers
    from mlx_vlm.utils import load

    folder = model_folder(model_path)
    try:
        model, processor = load(str(folder))
    except Exception as exc:  # any loader failure becomes one clear error
        raise ModelLoadError(f"cannot load model {model_path!r}: {exc}") from exc
    model_type = str(model.config.model_type).lower()
    spec = family_of(model_type)
    return LoadedModel(
        model=model,
        processor=processor,
        model_id=model_path,
        model_type=model_type,
        cacheable=spec.cacheable,
        context_length=_context_length(model.config),
        fingerprint=fingerprint(folder),
        family=spec,
    )


def model_folder(model_path: str) -> Path:
    """The local folder of a model (a hub id downloads here; a built-in name is its own
    folder, names.py), once its family is accepted."""
    from mlx_vlm.utils import get_model_path

    local = check_local(model_path)
    target = str(local) if local.exists() else model_path
    try:
        folder = get_model_path(target)  # a hub id downloads to its snapshot folder here
    except Exception as exc:  # any loader failure becomes one clear error
        raise ModelLoadError(f"cannot load model {model_path!r}: {exc}") from exc
    check_family(folder, model_path)
    return Path(folder)


def check_local(model_path: str) -> Path:
    """The model's local path (a built-in name's folder: worker/model/names.py);
    ModelLoadError when it names a folder that is missing or holds no config.json (a hub
    id, which has neither / first nor ./ ~, passes). Cheap (`tiny` is built once), so the
    worker checks it before anything else."""
    try:
        local = Path(names.resolve(model_path)).expanduser()
    except OSError as exc:  # `tiny` could not be built into the cache dir
        raise ModelLoadError(f"cannot prepare model {model_path!r}: {exc}") from exc
    if local.exists() and not (local / "config.json").is_file():
        raise ModelLoadError(f"model folder {local} has no config.json")
    if not local.exists() and (local.is_absolute() or model_path.startswith((".", "~"))):
        raise ModelLoadError(f"model folder {local} does not exist")
    return local


def check_family(folder: Path, model_path: str) -> str:
    """The folder's model type, or ModelLoadError when vlmq cannot serve it exactly.

    Checked before the weights load: a family whose batched output is not verified
    would risk wrong text, so the worker refuses it at start instead.
    """
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        model_type = str(config["model_type"]).lower()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read model_type from {model_path!r}: {exc}") from exc
    if model_type in REFUSED:
        raise ModelLoadError(f"model type {model_type} is not supported: {REFUSED[model_type]}")
    if families.find(model_type) is None:
        raise ModelLoadError(
            f"model type {model_type} is not one vlmq has verified (batched output equal "
            f"to sequential generate); verified: {', '.join(families.names())}"
        )
    return model_type


def fingerprint(folder: Path) -> str:
    """Identity of a model folder's weights and configs, without reading gigabytes.

    Names, sizes and mtimes of the safetensors and JSON files: re-converting or
    fine-tuning into the same folder changes it, and each hub revision is its own
    snapshot folder. Cached vision features are keyed by it, so they never go stale.
    """
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.suffix in (".safetensors", ".json") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _context_length(config: Any) -> int:
    text = getattr(config, "text_config", None)
    for source in (text, config):
        value = getattr(source, "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            return value
    return 32768


# ---------------------------------------------------------------- CPU side


# A prompt: one user turn's text, or a whole conversation (an interactive request).
Prompt = str | Sequence[Message]


def format_prompt(processor: Any, config: Any, prompt: Prompt, num_images: int) -> str:
    """The chat-templated prompt, exactly as `mlx_vlm.generate` callers build it: a text is
    one user turn; a conversation renders each turn with the model's template, the image
    at the start of the turn marked `image` (else, as mlx-vlm does, the last user turn)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    given: Any = prompt if isinstance(prompt, str) else conversation(prompt, num_images)
    with _TOKENIZER_LOCK, _TEMPLATE_KWARGS.scope():
        return str(apply_chat_template(processor, config, given, num_images=num_images))


def conversation(messages: Sequence[Message], num_images: int) -> list[dict[str, Any]]:
    """The turns as mlx-vlm's apply_chat_template takes them: an image part (which it
    counts as an explicit image marker) leads the content of the turn that carries it."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content: Any = m.content
        if m.image and num_images:
            content = [{"type": "image"}, {"type": "text", "text": m.content}]
        out.append({"role": m.role, "content": content})
    return out


def prepare(processor: Any, config: Any, image: Image.Image | None, prompt: Prompt) -> Prepared:
    """CPU-only preparation of one item; creates no MLX arrays.

    grid_prep families: numpy pixels via the processor's own image processor, then
    ids via the same expansion the processor does. Other families' processors
    return MLX arrays, so only the template is applied here and the rest runs
    on the MLX thread (`build_prompt_kwargs`).
    """
    text = format_prompt(processor, config, prompt, num_images=0 if image is None else 1)
    if image is None:
        return Prepared(text=text, input_ids=_tokenize(processor, text))
    if not family_of(str(config.model_type)).grid_prep:
        return Prepared(text=text, input_ids=None, deferred_image=image.convert("RGB"))
    out = processor.image_processor(images=[image.convert("RGB")])
    pixel_values = np.asarray(out["pixel_values"])
    grid = np.asarray(out["image_grid_thw"], dtype=np.int64)
    return Prepared(
        text=text,
        input_ids=expand_and_tokenize(processor, text, grid),
        pixel_values=pixel_values,
        image_grid_thw=grid,
    )


def prepare_from_grid(
    processor: Any, config: Any, image_grid_thw: np.ndarray, prompt: Prompt
) -> Prepared:
    """Cache-hit preparation: the same ids as `prepare`, from the cached grid alone."""
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    text = format_prompt(processor, config, prompt, num_images=grid.shape[0])
    return Prepared(
        text=text, input_ids=expand_and_tokenize(processor, text, grid), image_grid_thw=grid
    )


def expand_and_tokenize(processor: Any, text: str, grid: np.ndarray) -> np.ndarray:
    """Repeat each image pad token grid.prod() // merge**2 times, then tokenize.

    Mirrors mlx-vlm's Qwen2VLProcessor.__call__ text path, minus its
    conversion to MLX arrays.
    """
    pad = processor.image_token
    merge = int(processor.image_processor.merge_size) ** 2
    pieces = text.split(pad)
    if len(pieces) - 1 != grid.shape[0]:
        raise ValueError(f"prompt has {len(pieces) - 1} image slots for {grid.shape[0]} images")
    counts = [int(np.prod(g)) // merge for g in grid]
    expanded = pieces[0] + "".join(
        pad * n + rest for n, rest in zip(counts, pieces[1:], strict=True)
    )
    return _tokenize(processor, expanded)


def _tokenize(processor: Any, text: str) -> np.ndarray:
    with _TOKENIZER_LOCK:
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    return np.asarray(ids, dtype=np.int32)


# ---------------------------------------------------------------- MLX side


def vision_features(model: Any, prepared: Prepared) -> Any:
    """Run the vision tower for one prepared image: (n_image_tokens, hidden)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if prepared.pixel_values is None or prepared.image_grid_thw is None:
        raise ValueError("vision_features needs pixel_values and image_grid_thw")
    tower = getattr(model, family_of(str(model.config.model_type)).tower)
    leaves: list[tuple[str, Any]] = tree_flatten(tower.parameters())  # type: ignore[assignment]
    dtype = leaves[0][1].dtype  # the tower's weight dtype
    pixels = mx.array(prepared.pixel_values).astype(dtype)
    grid = mx.array(prepared.image_grid_thw)
    feats = tower(pixels, grid, output_hidden_states=False)
    mx.eval(feats)
    return feats


def build_prompt_kwargs(
    model: Any, processor: Any, prepared: Prepared, features: Any | None
) -> tuple[list[int], dict[str, Any]]:
    """Prompt ids and the per-request `prompt_kwargs` that `BatchGenerator.insert` takes.

    With `features` the tower is skipped (`cached_image_features=`). Qwen's
    `get_input_embeddings` takes its text-only branch when pixel_values is
    None, so a one-element placeholder stands in on a cache hit; it is never read.
    """
    import mlx.core as mx

    if prepared.input_ids is None:
        return _deferred_prompt_kwargs(model, processor, prepared)
    ids = mx.array(prepared.input_ids)[None]
    kwargs: dict[str, Any] = {"mask": mx.ones_like(ids)}
    pixels = None
    if prepared.image_grid_thw is not None:
        kwargs["image_grid_thw"] = mx.array(prepared.image_grid_thw)
        if features is not None:
            kwargs["cached_image_features"] = features
            pixels = mx.zeros((1,), dtype=mx.float32)
        elif prepared.pixel_values is not None:
            pixels = mx.array(prepared.pixel_values)
        else:
            raise ValueError("image item has neither pixel_values nor cached features")
    embed = model.get_input_embeddings(ids, pixels, **kwargs)
    out = {k: v for k, v in embed.to_dict().items() if v is not None}
    if "image_grid_thw" in kwargs:
        out["image_grid_thw"] = kwargs["image_grid_thw"]
    if family_of(str(model.config.model_type)).rope_index and "position_ids" not in out:
        out["position_ids"], out["rope_deltas"] = model.language_model.get_rope_index(
            ids, kwargs.get("image_grid_thw"), None, kwargs["mask"]
        )
        model.get_input_embeddings(ids[:, :1], None, mask=kwargs["mask"][:, :1])
    mx.eval([v for v in out.values() if isinstance(v, mx.array)])
    return prepared.input_ids.tolist(), out


def _deferred_prompt_kwargs(
    model: Any, processor: Any, prepared: Prepared
) -> tuple[list[int], dict[str, Any]]:
    """Generic path for families whose processor makes MLX arrays (uncached)."""
    import mlx.core as mx
    from mlx_vlm.utils import prepare_inputs

    images = [prepared.deferred_image] if prepared.deferred_image is not None else None
    with _TOKENIZER_LOCK:
        inputs = prepare_inputs(  # type: ignore[no-untyped-call]
            processor, images=images, prompts=prepared.text
        )
    ids = inputs["input_ids"]
    pixels = inputs.get("pixel_values")
    extra = {
        k: v
        for k, v in inputs.items()
        if k not in ("input_ids", "pixel_values", "attention_mask") and v is not None
    }
    embed = model.get_input_embeddings(ids, pixels, mask=inputs.get("attention_mask"), **extra)
    out = {**extra, **{k: v for k, v in embed.to_dict().items() if v is not None}}
    mx.eval([v for v in out.values() if isinstance(v, mx.array)])
    return ids[0].tolist(), out


# ---------------------------------------------------------------- cache format


def features_to_numpy(features: Any) -> tuple[np.ndarray, str]:
    """Exact numpy copy plus MLX dtype name; bfloat16 (no numpy dtype) travels as uint16 bits."""
    import mlx.core as mx

    name = str(features.dtype).rsplit(".", 1)[-1]
    if features.dtype == mx.bfloat16:
        return np.array(features.view(mx.uint16)), name
    return np.array(features), name


def features_from_numpy(array: np.ndarray, dtype_name: str) -> Any:
    """Inverse of `features_to_numpy`."""
    import mlx.core as mx

    dtype = getattr(mx, dtype_name, None)
    if not isinstance(dtype, mx.Dtype):
        raise ValueError(f"unknown MLX dtype name {dtype_name!r}")
    if dtype == mx.bfloat16:
        return mx.array(np.ascontiguousarray(array, dtype=np.uint16)).view(mx.bfloat16)
    return mx.array(array).astype(dtype)


# ---------------------------------------------------------------- text


def eos_token_ids(processor: Any) -> frozenset[int]:
    """The ids mlx-vlm's generators stop on (config eos plus the tokenizer's own)."""
    criteria = processor.tokenizer.stopping_criteria
    return frozenset(int(t) for t in criteria.eos_token_ids)


def decode(processor: Any, ids: list[int]) -> str:
    """Token ids to text, special tokens kept so stop strings such as <|im_start|> are seen."""
    with _TOKENIZER_LOCK:
        return str(processor.tokenizer.decode(ids, skip_special_tokens=False))


REPLACEMENT_CHAR = "\ufffd"


class TokenText:
    """A row's text as its tokens come, released a token at a time.

    mlx-vlm's streaming detokenizers (what its server uses) hold a token back until the
    next one starts a word, so a person waits a whole word, or a whole answer in a
    language without spaces, for text that is already decoded. This decodes a short window
    instead: the tokens since the text last grew, after the ones before them (whose text
    is known), and releases the difference once it ends in a whole character. The window
    gives a tokenizer the context it needs for a leading space or a merge, so the text
    stays the start of the whole decode (tests/worker/model/test_chat_prompts.py).
    """

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # the window's first token: context whose text is released
        self._read = 0  # the first token whose text is not released yet

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._release(final=False)

    def finalize(self) -> None:
        """The row has ended: release what is held, whole or not."""
        self._release(final=True)

    def _release(self, *, final: bool) -> None:
        if self._read >= len(self.tokens):
            return
        known = decode(self.processor, self.tokens[self._prefix:self._read])
        window = decode(self.processor, self.tokens[self._prefix:])
        if not final and (len(window) <= len(known) or window.endswith(REPLACEMENT_CHAR)):
            return  # nothing new yet, or a character whose bytes have not all come
        self.text += window[len(known):]
        self._prefix, self._read = self._read, len(self.tokens)


def streaming_detokenizer(processor: Any) -> TokenText:
    """A fresh incremental detokenizer for one row: add_token(id) per token, `.text` the
    text so far, `finalize()` at the end."""
    return TokenText(processor)


def streamable(detok: Any, stops: Sequence[str], sent: int) -> tuple[str, int]:
    """The row's text so far, and how much of it may be sent: whole characters only (a
    trailing U+FFFD is a character whose bytes have not all come), and nothing from where
    a stop string starts or could start once more tokens come. `sent`: characters already
    sent (only the text from there, less the longest stop, is searched)."""
    text = str(detok.text)
    end = len(text.rstrip(REPLACEMENT_CHAR))
    longest = max((len(s) for s in stops if s), default=0)
    start = max(0, sent - longest)
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop, start)
        if at >= 0:
            end = min(end, at)
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text.endswith(stop[:k], 0, end):
                end -= k
                break
    return text, max(end, 0)


def release_thread_streams() -> None:
    """Free the MLX streams this thread created; call last on any thread that ran MLX.

    MLX 0.32 no longer cleans per-thread streams itself; without this a process
    whose MLX thread has ended can abort at exit ("terminate called without an
    active exception", ml-explore/mlx#3126).
    """
    import mlx.core as mx

    mx.clear_streams()
