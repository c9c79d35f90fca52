"""Adds the `sd-rs.config` metadata key to the built-in model file.

Rewrites `models/builtin/sd-rs-shapes.safetensors` with the same tensors (same names, dtypes
and values) and the existing `__metadata__` plus `sd-rs.config`: a JSON object with `unet`,
`vae` and `clip` sections in the field names of sd-models' Rust configs (`UnetConfig`,
`VaeConfig`, `ClipTextConfig`), read by `sd_pipeline::model_config`.

    python3 scripts/builtin_model/add_metadata.py
"""

import json
import os
import sys

from safetensors import safe_open
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "..", "models", "builtin", "sd-rs-shapes.safetensors")

CONFIG = {
    "unet": {
        "in_channels": 4,
        "out_channels": 4,
        "model_channels": 32,
        "channel_mult": [1, 2, 2],
        "num_res_blocks": 2,
        "attention_resolutions": [1, 2],
        "heads": {"Heads": 4},
        "transformer_depth": 1,
        "context_dim": 32,
        "use_linear_in_transformer": False,
        "norm_groups": 8,
    },
    "vae": {
        "in_channels": 3,
        "out_channels": 3,
        "ch": 32,
        "ch_mult": [1, 2, 2],
        "num_res_blocks": 1,
        "z_channels": 4,
        "norm_groups": 8,
        "eps": 1e-6,
        "use_quant_conv": True,
        "scaling_factor": 0.18215,
    },
    "clip": {
        "vocab_size": 49408,
        "hidden_size": 32,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "max_position_embeddings": 77,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
        "clip_skip": 1,
        "final_layer_norm": True,
    },
    "name": "sd-rs-shapes",
    "prediction": "eps",
    "width": 64,
    "height": 64,
    "cfg_scale": 5.0,
}


def main():
    path = os.path.normpath(sys.argv[1] if len(sys.argv) > 1 else PATH)
    tensors = {}
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata() or {})
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    meta["sd-rs.config"] = json.dumps(CONFIG, sort_keys=True)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)
    print(f"{path}: {len(tensors)} tensors, metadata keys {sorted(meta)}")


if __name__ == "__main__":
    main()
