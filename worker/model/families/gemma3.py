"""Gemma 3 (google/gemma-3-*): SigLIP tower, MLX processor, one prompt per prefill."""

from __future__ import annotations

from vlmq.worker.model.families._base import (
    NO_GRID,
    Family,
    FamilySpec,
    TinyBuild,
    card_preset,
    task_rows,
)
from vlmq.worker.model.families._tiny import TEXT, chat_template

FAMILY = Family(
    model_type="gemma3",
    spec=FamilySpec(
        grid_prep=False, cache_off=NO_GRID,
        prefill_one="its get_input_embeddings returns a square (1, 1, L, L) attention mask "
                    "that BatchGenerator concatenates unpadded, so prompts of different "
                    "lengths cannot be prefilled together",
    ),
    defaults=task_rows(stop=("<end_of_turn>",)),
    presets=(
        card_preset("Gemma 3", ("gemma-3",), "https://huggingface.co/google/gemma-3-4b-it",
                    "Describe this image in detail.", stop=("<end_of_turn>",)),
    ),
    # <start_of_turn> turns; the processor expands <start_of_image> to image_seq_length
    # soft tokens (64 here).
    tiny=TinyBuild(
        specials=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        chat_template=chat_template(
            bos="<bos>", user="<start_of_turn>user\n", user_end="<end_of_turn>\n",
            assistant="<start_of_turn>model\n", assistant_end="<end_of_turn>\n",
            image="<start_of_image>"),
        eos="<eos>", pad="<pad>", bos="<bos>",
        tokenizer_class="PreTrainedTokenizerFast",
        tokenizer_extra={"extra_special_tokens": {
            "image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>"}},
        config={
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text", **TEXT, "vocab_size": "@vocab",
                "query_pre_attn_scalar": 32, "sliding_window": 64,
                "sliding_window_pattern": 2, "mm_tokens_per_image": 64,
            },
            "vision_config": {
                "model_type": "siglip_vision_model", "num_hidden_layers": 2,
                "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "patch_size": 14, "image_size": 112,
            },
            "vocab_size": "@vocab",
            "mm_tokens_per_image": 64,
            "image_token_index": "@<image_soft_token>",
            "boi_token_index": "@<start_of_image>",
            "eoi_token_index": "@<end_of_image>",
            "pad_token_id": "@<pad>",
            "eos_token_id": ["@<eos>", "@<end_of_turn>"],
        },
        preprocessor={
            "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "do_pan_and_scan": False, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "resample": 2,
            "size": {"height": 112, "width": 112},
        },
        # Tied embeddings: with them scaled too, every row echoes its last token.
        weight_scale=6.0, embed_scale=1.0,
        extra_files={"processor_config.json": {"image_seq_length": 64,
                                               "processor_class": "Gemma3Processor"}},
    ),
)
