#!/usr/bin/env python3
"""diffusers / transformers state dicts -> one original-layout (LDM / stable-diffusion.cpp)
single-file state dict, for any number of levels and resnets per level.

Same mapping as diffusers' `scripts/convert_diffusers_to_original_stable_diffusion.py`, which
hard-codes SD1's 4 levels x 2 resnets; this generalises its index arithmetic:

* UNet (`model.diffusion_model.`): `input_blocks.0.0` = `conv_in`; level i resnet/attention
  j -> `input_blocks.{1 + i(L+1) + j}.{0,1}`; level i downsampler ->
  `input_blocks.{(i+1)(L+1)}.0.op`; up block i resnet/attention j (L+1 of them) ->
  `output_blocks.{i(L+1) + j}.{0,1}`; its upsampler -> `output_blocks.{i(L+1) + L}.{1|2}`;
  `mid_block` -> `middle_block.{0,1,2}`; resnet parts `norm1/conv1/norm2/conv2/time_emb_proj/
  conv_shortcut` -> `in_layers.0/in_layers.2/out_layers.0/out_layers.3/emb_layers.1/
  skip_connection`; transformer blocks keep their names.
* VAE (`first_stage_model.`): `down_blocks.i.resnets.j` -> `down.i.block.j`,
  `up_blocks.i` -> `up.{N-1-i}`, `mid_block.resnets.k` -> `mid.block_{k+1}`, the mid
  attention -> `mid.attn_1.{norm,q,k,v,proj_out}` with the linear weights reshaped to
  `[C, C, 1, 1]`, `conv_shortcut` -> `nin_shortcut`, `conv_norm_out` -> `norm_out`.
* CLIP (`cond_stage_model.transformer.`): the transformers names, `text_model.` included.

`python3 convert.py --check` checks the mapping against the SD1.5 / SD VAE name fixtures of
`crates/sd-formats/tests/fixtures/names/` (made by diffusers' own script).
"""

import re

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer."

_UNET_FIXED = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_UNET_RESNET = [
    ("norm1", "in_layers.0"),
    ("conv1", "in_layers.2"),
    ("norm2", "out_layers.0"),
    ("conv2", "out_layers.3"),
    ("time_emb_proj", "emb_layers.1"),
    ("conv_shortcut", "skip_connection"),
]


def _resnet_part(rest, table):
    head, _, tail = rest.partition(".")
    for hf, sd in table:
        if head == hf:
            return sd + "." + tail
    raise KeyError(rest)


def unet_name(k, layers, up_has_attn):
    """One diffusers UNet2DConditionModel name -> LDM name. `layers`: layers_per_block;
    `up_has_attn[i]`: up block i is a CrossAttnUpBlock2D."""
    L = layers
    for hf, sd in _UNET_FIXED.items():
        if k.startswith(hf + "."):
            return sd + k[len(hf) :]
    m = re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", k)
    if m:
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        idx = 1 + i * (L + 1) + j
        if kind == "resnets":
            return f"input_blocks.{idx}.0.{_resnet_part(rest, _UNET_RESNET)}"
        return f"input_blocks.{idx}.1.{rest}"
    m = re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", k)
    if m:
        return f"input_blocks.{(int(m[1]) + 1) * (L + 1)}.0.op.{m[2]}"
    m = re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", k)
    if m:
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        idx = i * (L + 1) + j
        if kind == "resnets":
            return f"output_blocks.{idx}.0.{_resnet_part(rest, _UNET_RESNET)}"
        return f"output_blocks.{idx}.1.{rest}"
    m = re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", k)
    if m:
        i = int(m[1])
        return f"output_blocks.{i * (L + 1) + L}.{2 if up_has_attn[i] else 1}.{m[2]}"
    m = re.match(r"mid_block\.resnets\.(\d+)\.(.*)", k)
    if m:
        return f"middle_block.{2 * int(m[1])}.{_resnet_part(m[2], _UNET_RESNET)}"
    m = re.match(r"mid_block\.attentions\.0\.(.*)", k)
    if m:
        return f"middle_block.1.{m[1]}"
    raise KeyError(k)


_VAE_RESNET = [
    ("norm1", "norm1"),
    ("conv1", "conv1"),
    ("norm2", "norm2"),
    ("conv2", "conv2"),
    ("conv_shortcut", "nin_shortcut"),
]
_VAE_ATTN = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
    # diffusers' older names
    "query": "q",
    "key": "k",
    "value": "v",
    "proj_attn": "proj_out",
}


def vae_name(k, levels):
    """One diffusers AutoencoderKL name -> (LDM name, reshape linear to 1x1 conv)."""
    if k.split(".")[0] in ("quant_conv", "post_quant_conv"):
        return k, False
    m = re.match(r"(encoder|decoder)\.(.*)", k)
    if not m:
        raise KeyError(k)
    part, rest = m[1], m[2]
    if rest.startswith("conv_in.") or rest.startswith("conv_out."):
        return k, False
    if rest.startswith("conv_norm_out."):
        return f"{part}.norm_out.{rest[len('conv_norm_out.'):]}", False
    m = re.match(r"(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest)
    if m:
        i = int(m[2]) if m[1] == "down" else levels - 1 - int(m[2])
        return f"{part}.{m[1]}.{i}.block.{m[3]}.{_resnet_part(m[4], _VAE_RESNET)}", False
    m = re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.(.*)", rest)
    if m:
        return f"{part}.down.{m[1]}.downsample.{m[2]}", False
    m = re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", rest)
    if m:
        return f"{part}.up.{levels - 1 - int(m[1])}.upsample.{m[2]}", False
    m = re.match(r"mid_block\.resnets\.(\d+)\.(.*)", rest)
    if m:
        return f"{part}.mid.block_{int(m[1]) + 1}.{_resnet_part(m[2], _VAE_RESNET)}", False
    m = re.match(r"mid_block\.attentions\.0\.(.*)\.(weight|bias)$", rest)
    if m and m[1] in _VAE_ATTN:
        sd = _VAE_ATTN[m[1]]
        return f"{part}.mid.attn_1.{sd}.{m[2]}", sd != "norm" and m[2] == "weight"
    raise KeyError(k)


def clip_state_dict(sd):
    """transformers >= 5 drops the `text_model.` prefix of a bare CLIPTextModel."""
    if any(k.startswith("text_model.") for k in sd):
        return dict(sd)
    return {"text_model." + k: v for k, v in sd.items()}


def to_original(unet_sd, vae_sd, clip_sd, unet_layers, unet_up_has_attn, vae_levels):
    """Returns (original-layout state dict, {original name: (component, diffusers name,
    reshaped)}) so the file can be loaded back into the diffusers models."""
    out, back = {}, {}

    def put(name, value, comp, src, reshaped):
        assert name not in out, name
        out[name] = value
        back[name] = (comp, src, reshaped)

    for k, v in unet_sd.items():
        put(UNET_PREFIX + unet_name(k, unet_layers, unet_up_has_attn), v, "unet", k, False)
    for k, v in vae_sd.items():
        name, reshape = vae_name(k, vae_levels)
        if reshape and v.dim() == 2:
            v = v.reshape(*v.shape, 1, 1)
        else:
            reshape = False
        put(VAE_PREFIX + name, v, "vae", k, reshape)
    text = clip_state_dict(clip_sd)
    bare = not any(k.startswith("text_model.") for k in clip_sd)
    for k, v in text.items():
        if k.endswith("position_ids"):
            continue
        src = k[len("text_model.") :] if bare else k
        put(CLIP_PREFIX + k, v, "text_encoder", src, False)
    return out, back


def from_original(state, back):
    """Inverse of `to_original`: {component: diffusers state dict}."""
    comps = {"unet": {}, "vae": {}, "text_encoder": {}}
    for name, v in state.items():
        comp, src, reshaped = back[name]
        if reshaped:
            v = v.reshape(v.shape[0], v.shape[1])
        comps[comp][src] = v
    return comps


def _read_fixture(path):
    out = {}
    for line in open(path, encoding="utf-8"):
        if line.startswith("#") or not line.strip():
            continue
        name, shape = line.rstrip("\n").split("\t")
        out[name] = tuple(int(x) for x in shape.split(",")) if shape else ()
    return out


def _check():
    import os

    import torch

    d = os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "..", "..", "crates", "sd-formats", "tests", "fixtures", "names",
    )
    unet_d = _read_fixture(os.path.join(d, "sd15_unet_diffusers.txt"))
    unet_o = _read_fixture(os.path.join(d, "sd15_unet_original.txt"))
    vae_d = _read_fixture(os.path.join(d, "sd_vae_diffusers.txt"))
    vae_o = _read_fixture(os.path.join(d, "sd_vae_original.txt"))
    clip_d = _read_fixture(os.path.join(d, "sd15_clip_diffusers.txt"))
    clip_o = _read_fixture(os.path.join(d, "sd15_clip_original.txt"))

    def strip(sd, p):
        return {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}

    mk = lambda sd: {k: torch.empty(s, device="meta") for k, s in sd.items()}
    u = strip(unet_d, "unet.") or unet_d
    v = strip(vae_d, "vae.") or vae_d
    c = strip(clip_d, "text_encoder.") or clip_d
    out, back = to_original(mk(u), mk(v), mk(c), 2, [False, True, True, True], 4)
    got = {k: tuple(t.shape) for k, t in out.items()}
    want = {**unet_o, **vae_o, **clip_o}
    want = {k: s for k, s in want.items() if not k.endswith("position_ids")}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    bad = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    print(f"converted {len(got)} names; missing {len(missing)}, extra {len(extra)}, shape {len(bad)}")
    for k in (missing + extra + bad)[:20]:
        print("  ", k, got.get(k), want.get(k))
    assert not missing and not extra and not bad
    back_sd = from_original(out, back)
    assert {k: tuple(t.shape) for k, t in back_sd["unet"].items()} == {k: tuple(s) for k, s in u.items()}
    print("ok")


if __name__ == "__main__":
    import sys

    if "--check" in sys.argv:
        _check()
