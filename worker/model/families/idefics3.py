"""Idefics3 (SmolDocling, granite-docling): DocTags output, MLX processor."""

from __future__ import annotations

from vlmq.worker.model.families._base import (
    NO_GRID,
    Family,
    FamilySpec,
    Preset,
    TinyBuild,
    task_rows,
)
from vlmq.worker.model.families._tiny import TEXT, chat_template

DOCLING = "Convert this page to docling."
_END = ("<end_of_utterance>",)

FAMILY = Family(
    model_type="idefics3",
    spec=FamilySpec(grid_prep=False, cache_off=NO_GRID),
    defaults=task_rows(DOCLING, stop=_END),
    presets=(
        Preset("granite-docling", ("granite-docling",), task_rows(DOCLING, 8192, stop=_END),
               "https://huggingface.co/ibm-granite/granite-docling-258M (DocTags output)"),
        Preset("SmolDocling", ("smoldocling",), task_rows(DOCLING, 8192, stop=_END),
               "https://huggingface.co/docling-project/SmolDocling-256M-preview"),
    ),
    # "User:<image>...<end_of_utterance>" turns; the processor expands <image> to
    # image_seq_len tokens between fake-token markers.
    tiny=TinyBuild(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>",
                  "<image>", "<end_of_utterance>", "<global-img>"),
        chat_template=chat_template(
            bos="<|im_start|>", user="User:", user_end="<end_of_utterance>\n",
            assistant="Assistant:", assistant_end="<end_of_utterance>\n", image="<image>"),
        eos="<end_of_utterance>", pad="<|endoftext|>",
        tokenizer_class="PreTrainedTokenizerFast",
        config={
            "architectures": ["Idefics3ForConditionalGeneration"],
            "model_type": "idefics3",
            "text_config": {
                "model_type": "llama", **TEXT, "vocab_size": "@vocab", "rms_norm_eps": 1e-5,
            },
            "vision_config": {
                "model_type": "idefics3_vision", "hidden_size": 64, "num_attention_heads": 4,
                "patch_size": 14, "num_hidden_layers": 2, "intermediate_size": 128,
                "image_size": 112,
            },
            "vocab_size": "@vocab",
            "scale_factor": 2,
            "image_token_id": "@<image>",
            "eos_token_id": ["@<end_of_utterance>", "@<|endoftext|>"],
        },
        preprocessor={
            "image_processor_type": "Idefics3ImageProcessor",
            "processor_class": "Idefics3Processor",
            "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "do_pad": True, "do_image_splitting": False,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "rescale_factor": 1 / 255, "resample": 1,
            "size": {"longest_edge": 112}, "max_image_size": {"longest_edge": 112},
        },
        # (112 / 14)^2 patches, pixel-shuffled by scale_factor^2.
        extra_files={"processor_config.json": {"image_seq_len": 16,
                                               "processor_class": "Idefics3Processor"}},
    ),
)
