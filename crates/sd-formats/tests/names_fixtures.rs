//! Whole-model key sets: diffusers / OpenCLIP / transformers layouts converted by
//! `convert_to_canonical` must give exactly the original single-file names and shapes that
//! diffusers' own conversion scripts produce (see `scripts/fixtures/make_name_fixtures.py`).

#[path = "common/names.rs"]
mod common;

use std::collections::BTreeMap;

use common::{assert_same, by_name, entries_by_name, load, prefixed, storages};
use sd_formats::names::{
    convert_to_canonical, convert_to_canonical_report, SdVersion, CLIP_G_PREFIX, CLIP_PREFIX,
    TEXT_PROJECTION_LINEAR, TEXT_PROJECTION_OPENCLIP,
};

fn convert(
    entries: &[(String, Vec<u64>)],
    version: Option<SdVersion>,
) -> BTreeMap<String, Vec<u64>> {
    by_name(&convert_to_canonical(storages(entries), version).expect("conversion"))
}

fn check_unet(model: &str, version: SdVersion) {
    let diffusers = load(&format!("{model}_unet_diffusers"));
    let want = entries_by_name(&load(&format!("{model}_unet_original")));
    for (prefix, hint) in [
        ("", None),
        ("unet.", None),
        ("model.diffusion_model.", None),
        ("unet.", Some(version)),
    ] {
        let got = convert(&prefixed(&diffusers, prefix), hint);
        assert_same(&got, &want);
    }
    // Original names are already canonical.
    let original = load(&format!("{model}_unet_original"));
    assert_same(&convert(&original, None), &want);
}

#[test]
fn sd15_unet_diffusers_to_original() {
    check_unet("sd15", SdVersion::Sd1);
}

#[test]
fn sd2_unet_diffusers_to_original() {
    check_unet("sd2", SdVersion::Sd2);
}

#[test]
fn sdxl_unet_diffusers_to_original() {
    check_unet("sdxl", SdVersion::Sdxl);
}

#[test]
fn bare_original_unet_gets_its_prefix() {
    let original = load("sd15_unet_original");
    let bare: Vec<_> = original
        .iter()
        .map(|(n, s)| {
            (
                n.strip_prefix("model.diffusion_model.").unwrap().to_owned(),
                s.clone(),
            )
        })
        .collect();
    assert_same(&convert(&bare, None), &entries_by_name(&original));
}

#[test]
fn vae_diffusers_to_original_with_conv_view() {
    let diffusers = load("sd_vae_diffusers");
    let want = entries_by_name(&load("sd_vae_original"));
    for prefix in ["", "vae.", "first_stage_model."] {
        let report =
            convert_to_canonical_report(storages(&prefixed(&diffusers, prefix)), None).unwrap();
        assert_same(&by_name(&report.tensors), &want);
        let mut reshaped = report.reshaped.clone();
        reshaped.sort();
        assert_eq!(reshaped.len(), 8, "{reshaped:?}");
        for name in &reshaped {
            assert_eq!(want[name], vec![512, 512, 1, 1]);
        }
    }
    // The reshape is a view: same bytes, same offsets.
    let input = storages(&diffusers);
    let out = convert_to_canonical(input.clone(), None).unwrap();
    let q_in = input
        .iter()
        .find(|s| s.name == "decoder.mid_block.attentions.0.to_q.weight")
        .unwrap();
    let q_out = out
        .iter()
        .find(|s| s.name == "first_stage_model.decoder.mid.attn_1.q.weight")
        .unwrap();
    assert_eq!(
        (q_in.offset, q_in.size, q_in.dtype),
        (q_out.offset, q_out.size, q_out.dtype)
    );
    assert_eq!(q_out.shape, vec![512, 512, 1, 1]);
}

#[test]
fn vae_legacy_diffusers_attention_names() {
    // diffusers before 0.15 named the mid attention query/key/value/proj_attn.
    let legacy: Vec<_> = load("sd_vae_diffusers")
        .into_iter()
        .map(|(n, s)| {
            let n = n
                .replace("attentions.0.to_q.", "attentions.0.query.")
                .replace("attentions.0.to_k.", "attentions.0.key.")
                .replace("attentions.0.to_v.", "attentions.0.value.")
                .replace("attentions.0.to_out.0.", "attentions.0.proj_attn.");
            (n, s)
        })
        .collect();
    assert!(legacy
        .iter()
        .any(|(n, _)| n.ends_with("attentions.0.proj_attn.weight")));
    assert_same(
        &convert(&legacy, None),
        &entries_by_name(&load("sd_vae_original")),
    );
}

#[test]
fn vae_original_two_dimensional_projections_are_viewed_as_conv() {
    let want = entries_by_name(&load("sd_vae_original"));
    let flat: Vec<_> = load("sd_vae_original")
        .into_iter()
        .map(|(n, s)| {
            if s.len() == 4 && n.contains("mid.attn_1.") {
                (n, s[..2].to_vec())
            } else {
                (n, s)
            }
        })
        .collect();
    let bare: Vec<_> = flat
        .iter()
        .map(|(n, s)| {
            (
                n.strip_prefix("first_stage_model.").unwrap().to_owned(),
                s.clone(),
            )
        })
        .collect();
    assert_same(&convert(&flat, None), &want);
    assert_same(&convert(&bare, None), &want);
}

#[test]
fn clip_l_transformers_to_canonical() {
    let diffusers = load("sd15_clip_diffusers");
    let want = entries_by_name(&load("sd15_clip_original"));
    for prefix in [
        "",
        "text_encoder.",
        "cond_stage_model.transformer.",
        "conditioner.embedders.0.transformer.",
    ] {
        assert_same(&convert(&prefixed(&diffusers, prefix), None), &want);
    }
    // transformers >= 5 drops the `text_model.` level.
    let v5: Vec<_> = diffusers
        .iter()
        .map(|(n, s)| (n.strip_prefix("text_model.").unwrap().to_owned(), s.clone()))
        .collect();
    for prefix in ["", "text_encoder.", "cond_stage_model.transformer."] {
        assert_same(&convert(&prefixed(&v5, prefix), None), &want);
    }
}

#[test]
fn sd2_openclip_to_canonical() {
    let original = load("sd2_clip_original");
    let want = entries_by_name(&prefixed(&load("sd2_clip_diffusers"), CLIP_PREFIX));
    let report = convert_to_canonical_report(storages(&original), None).unwrap();
    assert_same(&by_name(&report.tensors), &want);
    assert_eq!(report.split.len(), 2 * 23);
    // The diffusers text encoder lands on the same names.
    let diffusers = load("sd2_clip_diffusers");
    assert_same(
        &convert(&prefixed(&diffusers, "text_encoder."), None),
        &want,
    );
    assert_same(&convert(&diffusers, None), &want);
}

/// bigG: the original `text_projection` is `P`, the transformers one `P^T`; names differ.
fn clip_g_expected(projection: &str) -> BTreeMap<String, Vec<u64>> {
    load("sdxl_clip_g_diffusers")
        .into_iter()
        .map(|(n, s)| {
            let n = if n == TEXT_PROJECTION_LINEAR {
                projection.to_owned()
            } else {
                n
            };
            (format!("{CLIP_G_PREFIX}{n}"), s)
        })
        .collect()
}

#[test]
fn sdxl_openclip_g_to_canonical() {
    let original = load("sdxl_clip_g_original");
    assert_same(
        &convert(&original, None),
        &clip_g_expected(TEXT_PROJECTION_OPENCLIP),
    );

    let diffusers = load("sdxl_clip_g_diffusers");
    let want = clip_g_expected(TEXT_PROJECTION_LINEAR);
    assert_same(
        &convert(&prefixed(&diffusers, "text_encoder_2."), None),
        &want,
    );
    // A bare transformers file 1280 wide is bigG: second slot.
    assert_same(&convert(&diffusers, None), &want);
}

fn sd15_original_checkpoint() -> Vec<(String, Vec<u64>)> {
    let mut all = load("sd15_unet_original");
    all.extend(load("sd_vae_original"));
    all.extend(load("sd15_clip_original"));
    all
}

#[test]
fn sd15_pipeline_folders_to_single_file_names() {
    let mut pipeline = prefixed(&load("sd15_unet_diffusers"), "unet.");
    pipeline.extend(prefixed(&load("sd_vae_diffusers"), "vae."));
    pipeline.extend(prefixed(&load("sd15_clip_diffusers"), "text_encoder."));
    let want = entries_by_name(&sd15_original_checkpoint());
    assert_same(&convert(&pipeline, None), &want);
    assert_same(&convert(&sd15_original_checkpoint(), None), &want);
}

#[test]
fn sdxl_single_file_to_canonical() {
    let mut checkpoint = load("sdxl_unet_original");
    checkpoint.extend(load("sd_vae_original"));
    checkpoint.extend(prefixed(
        &load("sd15_clip_diffusers"),
        "conditioner.embedders.0.transformer.",
    ));
    checkpoint.extend(load("sdxl_clip_g_original"));
    checkpoint.push(("conditioner.embedders.1.model.logit_scale".into(), vec![]));

    let mut want = entries_by_name(&load("sdxl_unet_original"));
    want.extend(entries_by_name(&load("sd_vae_original")));
    want.extend(entries_by_name(&prefixed(
        &load("sd15_clip_diffusers"),
        CLIP_PREFIX,
    )));
    want.extend(clip_g_expected(TEXT_PROJECTION_OPENCLIP));
    want.insert("conditioner.embedders.1.model.logit_scale".into(), vec![]);

    assert_same(&convert(&checkpoint, None), &want);
    assert_same(&convert(&checkpoint, Some(SdVersion::Sdxl)), &want);

    // And the diffusers pipeline folders land on the same names (bar the projection's).
    let mut pipeline = prefixed(&load("sdxl_unet_diffusers"), "unet.");
    pipeline.extend(prefixed(&load("sd_vae_diffusers"), "vae."));
    pipeline.extend(prefixed(&load("sd15_clip_diffusers"), "text_encoder."));
    pipeline.extend(prefixed(&load("sdxl_clip_g_diffusers"), "text_encoder_2."));
    let mut want_pipeline = want.clone();
    want_pipeline.remove("conditioner.embedders.1.model.logit_scale");
    let projection = want_pipeline
        .remove(&format!("{CLIP_G_PREFIX}{TEXT_PROJECTION_OPENCLIP}"))
        .unwrap();
    want_pipeline.insert(
        format!("{CLIP_G_PREFIX}{TEXT_PROJECTION_LINEAR}"),
        projection,
    );
    assert_same(&convert(&pipeline, None), &want_pipeline);
}

#[test]
fn conversion_is_idempotent_on_fixtures() {
    for fixture in [
        "sd15_unet_diffusers",
        "sdxl_unet_diffusers",
        "sd_vae_diffusers",
        "sd2_clip_original",
        "sdxl_clip_g_original",
        "sd15_clip_diffusers",
    ] {
        let once = convert_to_canonical(storages(&load(fixture)), None).unwrap();
        let twice = convert_to_canonical(once.clone(), None).unwrap();
        assert_eq!(once, twice, "{fixture}");
    }
}
