//! Version detection on real key sets (original and diffusers names) and on the
//! characteristic tensors of the DiT families.

#[path = "common/names.rs"]
mod common;

use common::{load, prefixed, storages};
use sd_formats::names::{convert_to_canonical, detect_version, detect_version_of, SdVersion};

type Entries = Vec<(String, Vec<u64>)>;

fn detect(entries: &[(String, Vec<u64>)]) -> Option<SdVersion> {
    detect_version(entries.iter().map(|(n, s)| (n.as_str(), s.as_slice())))
}

/// Sets input channel `channels` on the UNet's first convolution, in either layout.
fn with_in_channels(mut entries: Entries, channels: u64) -> Entries {
    let mut found = false;
    for (name, shape) in &mut entries {
        if name.ends_with("input_blocks.0.0.weight")
            || (name.ends_with("conv_in.weight") && !name.contains("coder."))
        {
            shape[1] = channels;
            found = true;
        }
    }
    assert!(found);
    entries
}

fn unet_forms(model: &str) -> Vec<Entries> {
    let diffusers = load(&format!("{model}_unet_diffusers"));
    vec![
        load(&format!("{model}_unet_original")),
        diffusers.clone(),
        prefixed(&diffusers, "unet."),
        prefixed(&diffusers, "model.diffusion_model."),
    ]
}

fn check_family(model: &str, base: SdVersion, inpaint: SdVersion) {
    for unet in unet_forms(model) {
        assert_eq!(detect(&unet), Some(base), "{model} {}", unet[0].0);
        assert_eq!(
            detect(&with_in_channels(unet.clone(), 9)),
            Some(inpaint),
            "{model}"
        );
        assert_eq!(detect(&with_in_channels(unet, 5)), None, "{model}");
    }
}

#[test]
fn sd1_by_context_dim() {
    check_family("sd15", SdVersion::Sd1, SdVersion::Sd1Inpaint);
    let unet = load("sd15_unet_original");
    assert_eq!(
        detect(&with_in_channels(unet, 8)),
        Some(SdVersion::Sd1Pix2Pix)
    );
}

#[test]
fn sd2_by_context_dim() {
    check_family("sd2", SdVersion::Sd2, SdVersion::Sd2Inpaint);
}

#[test]
fn sdxl_by_label_emb_and_context() {
    check_family("sdxl", SdVersion::Sdxl, SdVersion::SdxlInpaint);
    let unet = load("sdxl_unet_diffusers");
    assert_eq!(
        detect(&with_in_channels(unet.clone(), 8)),
        Some(SdVersion::SdxlPix2Pix)
    );
    // Without add_embedding the 2048-wide context still says SDXL ...
    let no_label: Entries = unet
        .iter()
        .filter(|(n, _)| !n.starts_with("add_embedding."))
        .cloned()
        .collect();
    assert_eq!(detect(&no_label), Some(SdVersion::Sdxl));
    // ... and without cross-attention, add_embedding does.
    let no_attn: Entries = unet
        .iter()
        .filter(|(n, _)| !n.contains("attn2"))
        .cloned()
        .collect();
    assert_eq!(detect(&no_attn), Some(SdVersion::Sdxl));
}

#[test]
fn sdxl_refiner_by_1280_context() {
    let t: Entries = vec![
        (
            "model.diffusion_model.input_blocks.0.0.weight".into(),
            vec![384, 4, 3, 3],
        ),
        (
            "model.diffusion_model.label_emb.0.0.weight".into(),
            vec![1536, 2560],
        ),
        (
            "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight".into(),
            vec![768, 1280],
        ),
    ];
    assert_eq!(detect(&t), Some(SdVersion::SdxlRefiner));
}

#[test]
fn text_encoder_breaks_ties_without_attention() {
    let no_attn = |model: &str| -> Entries {
        load(&format!("{model}_unet_original"))
            .into_iter()
            .filter(|(n, _)| !n.contains("attn2"))
            .collect()
    };
    let mut sd2 = no_attn("sd2");
    assert_eq!(detect(&sd2), None);
    sd2.extend(load("sd2_clip_original"));
    assert_eq!(detect(&sd2), Some(SdVersion::Sd2));
    let mut sd1 = no_attn("sd15");
    sd1.extend(load("sd15_clip_original"));
    assert_eq!(detect(&sd1), Some(SdVersion::Sd1));
}

#[test]
fn whole_checkpoints() {
    let mut sd15 = load("sd15_unet_original");
    sd15.extend(load("sd_vae_original"));
    sd15.extend(load("sd15_clip_original"));
    assert_eq!(detect(&sd15), Some(SdVersion::Sd1));
    // Detection gives the same answer after conversion to canonical names.
    let converted = convert_to_canonical(storages(&sd15), None).unwrap();
    assert_eq!(detect_version_of(&converted), Some(SdVersion::Sd1));

    let mut sdxl = prefixed(&load("sdxl_unet_diffusers"), "unet.");
    sdxl.extend(prefixed(&load("sd_vae_diffusers"), "vae."));
    sdxl.extend(prefixed(&load("sd15_clip_diffusers"), "text_encoder."));
    sdxl.extend(prefixed(&load("sdxl_clip_g_diffusers"), "text_encoder_2."));
    assert_eq!(detect(&sdxl), Some(SdVersion::Sdxl));
    let converted = convert_to_canonical(storages(&sdxl), None).unwrap();
    assert_eq!(detect_version_of(&converted), Some(SdVersion::Sdxl));
}

#[test]
fn components_without_a_diffusion_model_are_unknown() {
    assert_eq!(detect(&load("sd_vae_original")), None);
    assert_eq!(detect(&load("sd_vae_diffusers")), None);
    assert_eq!(detect(&load("sd15_clip_original")), None);
    assert_eq!(detect(&load("sdxl_clip_g_original")), None);
    assert_eq!(detect(&[]), None);
}

#[test]
fn diffusers_dits() {
    let flux = load("flux_dit_diffusers_few_blocks");
    assert_eq!(detect(&flux), Some(SdVersion::Flux));
    assert_eq!(
        detect(&prefixed(&flux, "transformer.")),
        Some(SdVersion::Flux)
    );
    let fill: Entries = flux
        .iter()
        .map(|(n, s)| {
            if n == "x_embedder.weight" {
                (n.clone(), vec![s[0], 384])
            } else {
                (n.clone(), s.clone())
            }
        })
        .collect();
    assert_eq!(detect(&fill), Some(SdVersion::FluxFill));

    let sd3 = load("sd3_dit_diffusers_few_blocks");
    assert_eq!(detect(&sd3), Some(SdVersion::Sd3));
    assert_eq!(
        detect(&prefixed(&sd3, "model.diffusion_model.")),
        Some(SdVersion::Sd3)
    );

    let qwen = load("qwen_image_dit_diffusers_few_blocks");
    assert_eq!(detect(&qwen), Some(SdVersion::QwenImage));
    assert_eq!(
        detect(&prefixed(&qwen, "model.diffusion_model.")),
        Some(SdVersion::QwenImage)
    );
}

fn named(names: &[(&str, &[u64])]) -> Entries {
    names
        .iter()
        .map(|(n, s)| ((*n).to_owned(), s.to_vec()))
        .collect()
}

#[test]
fn original_dits() {
    let flux = named(&[
        ("model.diffusion_model.img_in.weight", &[3072, 64]),
        (
            "model.diffusion_model.double_blocks.0.img_attn.qkv.weight",
            &[9216, 3072],
        ),
        (
            "model.diffusion_model.single_blocks.0.linear1.weight",
            &[21504, 3072],
        ),
    ]);
    assert_eq!(detect(&flux), Some(SdVersion::Flux));
    let mut fill = flux.clone();
    fill[0].1 = vec![3072, 384];
    assert_eq!(detect(&fill), Some(SdVersion::FluxFill));
    // A bare Flux file (sd.cpp's --diffusion-model).
    let bare: Entries = flux
        .iter()
        .map(|(n, s)| {
            (
                n.strip_prefix("model.diffusion_model.").unwrap().to_owned(),
                s.clone(),
            )
        })
        .collect();
    assert_eq!(detect(&bare), Some(SdVersion::Flux));

    let mut flux2 = flux.clone();
    flux2.push((
        "model.diffusion_model.double_stream_modulation_img.lin.weight".into(),
        vec![18432, 3072],
    ));
    assert_eq!(detect(&flux2), Some(SdVersion::Flux2));

    let sd3 = named(&[
        (
            "model.diffusion_model.x_embedder.proj.weight",
            &[1536, 16, 2, 2],
        ),
        (
            "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
            &[4608, 1536],
        ),
    ]);
    assert_eq!(detect(&sd3), Some(SdVersion::Sd3));

    let qwen = named(&[
        ("model.diffusion_model.img_in.weight", &[3072, 64]),
        (
            "model.diffusion_model.transformer_blocks.0.img_mod.1.weight",
            &[18432, 3072],
        ),
    ]);
    assert_eq!(detect(&qwen), Some(SdVersion::QwenImage));

    // HunyuanVideo shares Flux's block names but is not Flux.
    let mut hunyuan = flux;
    hunyuan.push((
        "model.diffusion_model.txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight"
            .into(),
        vec![6144, 3072],
    ));
    assert_eq!(detect(&hunyuan), None);
}

#[test]
fn dit_names_are_left_alone() {
    for fixture in [
        "flux_dit_diffusers_few_blocks",
        "sd3_dit_diffusers_few_blocks",
        "qwen_image_dit_diffusers_few_blocks",
    ] {
        let input = storages(&prefixed(&load(fixture), "model.diffusion_model."));
        assert_eq!(
            convert_to_canonical(input.clone(), None).unwrap(),
            input,
            "{fixture}"
        );
        let bare = storages(&load(fixture));
        assert_eq!(
            convert_to_canonical(bare.clone(), None).unwrap(),
            bare,
            "{fixture}"
        );
    }
}
