//! The real SD1.x / SD2.x configs declare exactly the tensors (names and shapes) of the
//! real checkpoints, as listed by sd-formats' name fixtures (generated from the real
//! diffusers / transformers models and diffusers' conversion scripts).

use std::collections::BTreeMap;
use std::path::PathBuf;

use sd_models::clip::{ClipTextConfig, ClipTextModel};
use sd_models::unet::{UnetConfig, UnetModel};
use sd_models::vae::{AutoencoderKl, VaeConfig};
use sd_models::{ParamBuilder, Params};

/// `name -> shape` (outermost first) of a name fixture, names prefixed with `prefix`.
fn fixture(name: &str, prefix: &str) -> BTreeMap<String, Vec<usize>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-formats/tests/fixtures/names")
        .join(format!("{name}.txt"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (n, s) = l.split_once('\t').unwrap();
            let shape = s.split(',').map(|d| d.parse().unwrap()).collect();
            (format!("{prefix}{n}"), shape)
        })
        .collect()
}

fn declared(params: &Params) -> BTreeMap<String, Vec<usize>> {
    params
        .tensors
        .iter()
        .map(|(n, t)| {
            let nd = t.n_dims().max(1);
            (n.clone(), t.shape(nd))
        })
        .collect()
}

/// Compares names exactly and shapes up to trailing 1-sized dims.
fn assert_same(what: &str, got: BTreeMap<String, Vec<usize>>, want: BTreeMap<String, Vec<usize>>) {
    let missing: Vec<_> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    let extra: Vec<_> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what}: missing {missing:?}, extra {extra:?}"
    );
    let trim = |s: &[usize]| {
        let n = s.iter().rposition(|&d| d != 1).map_or(0, |i| i + 1);
        s[..n].to_vec()
    };
    for (k, s) in &want {
        assert_eq!(trim(&got[k]), trim(s), "{what}: shape of {k}");
    }
}

#[test]
fn unet_sd1_and_sd2_declare_the_real_tensors() {
    for (cfg, fx) in [
        (UnetConfig::sd1(), "sd15_unet_original"),
        (UnetConfig::sd2(), "sd2_unet_original"),
    ] {
        let pb = ParamBuilder::new(None, 4096).unwrap();
        UnetModel::new(&pb, cfg).unwrap();
        assert_same(fx, declared(&pb.finish()), fixture(fx, ""));
    }
}

#[test]
fn vae_declares_the_real_tensors() {
    let pb = ParamBuilder::new(None, 4096).unwrap();
    AutoencoderKl::new(&pb, VaeConfig::default()).unwrap();
    assert_same(
        "vae",
        declared(&pb.finish()),
        fixture("sd_vae_original", ""),
    );
}

#[test]
fn clip_sd1_and_sd2_declare_the_real_tensors() {
    let pb = ParamBuilder::new(None, 4096).unwrap();
    ClipTextModel::new(&pb, ClipTextConfig::sd1()).unwrap();
    assert_same(
        "clip sd1",
        declared(&pb.finish()),
        fixture("sd15_clip_original", ""),
    );
    // SD2's text encoder as diffusers ships it has the 23 layers SD2 uses.
    let pb = ParamBuilder::new(None, 4096).unwrap();
    ClipTextModel::new(&pb, ClipTextConfig::sd2()).unwrap();
    assert_same(
        "clip sd2",
        declared(&pb.finish()),
        fixture("sd2_clip_diffusers", "cond_stage_model.transformer."),
    );
}

#[test]
fn unet_sdxl_declares_the_real_tensors() {
    let pb = ParamBuilder::new(None, 4096).unwrap();
    UnetModel::new(&pb, UnetConfig::sdxl()).unwrap();
    assert_same(
        "sdxl unet",
        declared(&pb.finish()),
        fixture("sdxl_unet_original", ""),
    );
}

#[test]
fn unet_sdxl_structure_reads_from_the_real_tensors() {
    let real = fixture("sdxl_unet_original", "");
    let cfg = UnetConfig::from_shapes(|n| real.get(n).cloned(), &UnetConfig::sdxl()).unwrap();
    assert_eq!(cfg, UnetConfig::sdxl());
}

#[test]
fn clip_sdxl_declares_the_real_tensors() {
    // CLIP-L: SDXL uses 11 of the 12 layers and no final layer norm; the file has all.
    let pb = ParamBuilder::new(None, 4096).unwrap();
    ClipTextModel::new(&pb, ClipTextConfig::sdxl_clip_l()).unwrap();
    let mut want = fixture("sd15_clip_original", "");
    want.retain(|k, _| !k.contains("layers.11.") && !k.contains("final_layer_norm"));
    assert_same("clip-l sdxl", declared(&pb.finish()), want);
    // bigG with its projection: every tensor of transformers' CLIPTextModelWithProjection
    // (without a catalog the transformers `Linear` projection is declared).
    let pb = ParamBuilder::new(None, 4096).unwrap();
    ClipTextModel::new(&pb, ClipTextConfig::sdxl_clip_g()).unwrap();
    assert_same(
        "clip-g sdxl",
        declared(&pb.finish()),
        fixture("sdxl_clip_g_diffusers", "cond_stage_model.1.transformer."),
    );
}
