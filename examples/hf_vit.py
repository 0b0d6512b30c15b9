"""Hugging Face ViT (ViTForImageClassification) from a config (no weights downloaded), unmodified.

Needs transformers (`pip install transformers`, or `pip install karma[hf]`).

    karma-plan examples/hf_vit.py --print-ir                      # ViT-B/16, 224x224, 1000 classes
    KARMA_HF=large karma-plan examples/hf_vit.py --print-ir       # ViT-L/16
    KARMA_HF=tiny karma-plan examples/hf_vit.py --print-ir        # 2 layers, hidden 64, 32x32
    KARMA_IMAGE=384 karma-plan examples/hf_vit.py --hardware v100-16g --gpu-mem 16G  # larger images (576 patches)

Image classification on random images: the inputs are keyword arguments,
`model(pixel_values=float [B, 3, H, W], labels=int64 [B])`; the model computes its own
cross-entropy (`output.loss`), so there are no targets. The sequence is one token per
patch plus [CLS]: (KARMA_IMAGE / patch size)^2 + 1. No attention mask.
"""

import os

import torch

try:
    from transformers import ViTConfig, ViTForImageClassification
except ImportError as e:
    raise ImportError("examples/hf_vit.py needs Hugging Face transformers; install it with "
                      "`pip install transformers` (or `pip install karma[hf]`)") from e

SIZES = {
    # name: (config fields, default image size, batch size)
    "tiny": (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                  num_attention_heads=4, patch_size=8, num_labels=10), 32, 2),
    "base": (dict(num_hidden_layers=12, hidden_size=768, intermediate_size=3072,
                  num_attention_heads=12, patch_size=16, num_labels=1000), 224, 64),
    "large": (dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=4096,
                   num_attention_heads=16, patch_size=16, num_labels=1000), 224, 64),
}
SIZE = os.environ.get("KARMA_HF", "base")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_HF={SIZE!r} is not a ViT size; use one of {', '.join(SIZES)}")
_CONFIG, _DEFAULT_IMAGE, BATCH_SIZE = SIZES[SIZE]
IMAGE = int(os.environ.get("KARMA_IMAGE", _DEFAULT_IMAGE))
if IMAGE < 1 or IMAGE % _CONFIG["patch_size"]:
    raise ValueError(f"KARMA_IMAGE={IMAGE} is not a positive multiple of the patch size "
                     f"{_CONFIG['patch_size']} of the {SIZE} size")


def build_model() -> torch.nn.Module:
    # problem_type set here: otherwise the loss function infers it and writes it into the
    # config during the first forward.
    config = ViTConfig(**_CONFIG, image_size=IMAGE, problem_type="single_label_classification",
                       attn_implementation="sdpa")
    return ViTForImageClassification(config)


def example_batch(batch_size: int):
    """({"pixel_values": float32 [B, 3, H, W], "labels": int64 [B]}, None)."""
    return {
        "pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE),
        "labels": torch.randint(0, _CONFIG["num_labels"], (batch_size,)),
    }, None
