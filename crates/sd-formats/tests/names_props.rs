//! Properties of name conversion and version detection on arbitrary names: no panics,
//! conservation of tensors and bytes, and canonical names being fixed points.

use proptest::prelude::*;
use sd_formats::names::{
    convert_to_canonical, convert_to_canonical_report, detect_version, NameError, SdVersion,
};
use sd_formats::{FileId, TensorStorage};
use sd_tensor::DType;

const VOCAB: &[&str] = &[
    "down_blocks",
    "up_blocks",
    "mid_block",
    "resnets",
    "attentions",
    "downsamplers",
    "upsamplers",
    "conv",
    "conv_in",
    "conv_out",
    "conv_norm_out",
    "norm_out",
    "time_embedding",
    "linear_1",
    "linear_2",
    "add_embedding",
    "norm1",
    "norm2",
    "conv1",
    "conv2",
    "time_emb_proj",
    "conv_shortcut",
    "nin_shortcut",
    "encoder",
    "decoder",
    "mid",
    "attn_1",
    "to_q",
    "to_k",
    "to_v",
    "to_out",
    "query",
    "key",
    "value",
    "proj_attn",
    "group_norm",
    "q",
    "k",
    "v",
    "proj_out",
    "weight",
    "bias",
    "text_model",
    "embeddings",
    "token_embedding",
    "position_embedding",
    "final_layer_norm",
    "layers",
    "self_attn",
    "transformer",
    "resblocks",
    "attn",
    "in_proj_weight",
    "in_proj_bias",
    "out_proj",
    "ln_1",
    "ln_2",
    "ln_final",
    "mlp",
    "c_fc",
    "c_proj",
    "positional_embedding",
    "text_projection",
    "input_blocks",
    "output_blocks",
    "middle_block",
    "label_emb",
    "transformer_blocks",
    "attn2",
    "img_mod",
    "joint_blocks",
    "double_blocks",
    "quant_conv",
    "post_quant_conv",
    "gamma",
    "model",
    "diffusion_model",
    "block",
    "down",
    "up",
    "lora_A",
    "18446744073709551615",
    "99999999999999999999",
    "007",
    "",
];

const PREFIXES: &[&str] = &[
    "",
    "",
    "",
    "model.diffusion_model.",
    "unet.",
    "vae.",
    "first_stage_model.",
    "text_encoder.",
    "text_encoder_2.",
    "cond_stage_model.transformer.",
    "cond_stage_model.1.transformer.",
    "cond_stage_model.model.",
    "conditioner.embedders.0.transformer.",
    "conditioner.embedders.1.model.",
    "conditioner.embedders.",
    "transformer.",
    "encoder.",
    "decoder.",
];

const MARKERS: &[&str] = &[
    "conv_in.weight",
    "input_blocks.0.0.weight",
    "encoder.conv_in.weight",
    "decoder.conv_in.weight",
    "text_model.embeddings.token_embedding.weight",
    "embeddings.token_embedding.weight",
];

const VERSIONS: &[SdVersion] = &[
    SdVersion::Sd1,
    SdVersion::Sd1Inpaint,
    SdVersion::Sd1Pix2Pix,
    SdVersion::Sd2,
    SdVersion::Sd2Inpaint,
    SdVersion::Sdxl,
    SdVersion::SdxlInpaint,
    SdVersion::SdxlPix2Pix,
    SdVersion::SdxlRefiner,
    SdVersion::Sd3,
    SdVersion::Flux,
    SdVersion::FluxFill,
    SdVersion::Flux2,
    SdVersion::QwenImage,
];

fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(VOCAB).prop_map(str::to_owned),
        3 => (0u64..12).prop_map(|i| i.to_string()),
        1 => "[a-z_0-9]{0,6}",
    ]
}

/// Realistic names with random indices: `{}` placeholders are filled with small numbers.
const TEMPLATES: &[&str] = &[
    "down_blocks.{}.resnets.{}.conv1.weight",
    "down_blocks.{}.resnets.{}.conv_shortcut.bias",
    "down_blocks.{}.attentions.{}.transformer_blocks.{}.attn2.to_k.weight",
    "down_blocks.{}.downsamplers.0.conv.weight",
    "up_blocks.{}.resnets.{}.time_emb_proj.weight",
    "up_blocks.{}.attentions.{}.proj_in.weight",
    "up_blocks.{}.upsamplers.0.conv.bias",
    "mid_block.resnets.{}.norm2.weight",
    "mid_block.attentions.{}.norm.bias",
    "encoder.down_blocks.{}.resnets.{}.conv_shortcut.weight",
    "decoder.up_blocks.{}.resnets.{}.norm1.bias",
    "decoder.up_blocks.{}.upsamplers.0.conv.weight",
    "encoder.mid_block.attentions.{}.to_q.weight",
    "decoder.mid_block.attentions.0.proj_attn.weight",
    "decoder.mid.attn_{}.v.weight",
    "transformer.resblocks.{}.attn.in_proj_weight",
    "transformer.resblocks.{}.attn.in_proj_bias",
    "transformer.resblocks.{}.mlp.c_fc.weight",
    "text_model.encoder.layers.{}.self_attn.q_proj.weight",
    "encoder.layers.{}.self_attn.k_proj.bias",
    "input_blocks.{}.{}.in_layers.2.weight",
];

fn template() -> impl Strategy<Value = String> {
    (
        prop::sample::select(PREFIXES),
        prop::sample::select(TEMPLATES),
        prop::collection::vec(prop_oneof![4 => 0u64..4, 1 => 0u64..40], 3),
    )
        .prop_map(|(p, t, idx)| {
            let mut out = String::from(p);
            let mut idx = idx.into_iter();
            for (i, piece) in t.split("{}").enumerate() {
                if i > 0 {
                    out.push_str(&idx.next().unwrap_or(0).to_string());
                }
                out.push_str(piece);
            }
            out
        })
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => template(),
        4 => (prop::sample::select(PREFIXES), prop::collection::vec(segment(), 0..9))
            .prop_map(|(p, segs)| format!("{p}{}", segs.join("."))),
        1 => prop::sample::select(MARKERS).prop_map(str::to_owned),
        1 => any::<String>(),
    ]
}

/// Storages with distinct names (a file never holds one name twice).
fn storages() -> impl Strategy<Value = Vec<TensorStorage>> {
    prop::collection::vec(storage(), 0..40).prop_map(|mut v| {
        let mut seen = std::collections::HashSet::new();
        v.retain(|s| seen.insert(s.name.clone()));
        v
    })
}

fn storage() -> impl Strategy<Value = TensorStorage> {
    (
        name(),
        prop::sample::select(&[DType::F32, DType::F16, DType::Q8_0][..]),
        prop::collection::vec(
            prop_oneof![
                0u64..10,
                Just(3),
                Just(768),
                Just(1024),
                Just(1280),
                Just(2048)
            ],
            0..5,
        ),
        0u64..1 << 40,
        0u32..4,
    )
        .prop_map(|(name, dtype, shape, offset, file)| {
            let size = shape.iter().fold(2u64, |a, &d| a.saturating_mul(d));
            TensorStorage {
                name,
                dtype,
                shape,
                file: FileId(file),
                offset,
                size,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn conversion_never_panics_and_conserves_tensors(
        input in storages(),
        version in prop::option::of(prop::sample::select(VERSIONS)),
    ) {
        let shapes: Vec<(&str, &[u64])> = input.iter().map(|s| (s.name.as_str(), s.shape.as_slice())).collect();
        let _ = detect_version(shapes);
        match convert_to_canonical_report(input.clone(), version) {
            Ok(report) => {
                prop_assert_eq!(report.tensors.len(), input.len() + 2 * report.split.len());
                let bytes_in: u128 = input.iter().map(|s| u128::from(s.size)).sum();
                let bytes_out: u128 = report.tensors.iter().map(|s| u128::from(s.size)).sum();
                prop_assert_eq!(bytes_in, bytes_out);
                let mut names: Vec<_> = report.tensors.iter().map(|s| &s.name).collect();
                names.sort();
                names.dedup();
                prop_assert_eq!(names.len(), report.tensors.len());
                // Every tensor the conversion renamed is canonical: converting those again
                // changes nothing.
                let renamed: Vec<TensorStorage> = report
                    .tensors
                    .iter()
                    .filter(|s| !input.iter().any(|i| i.name == s.name))
                    .cloned()
                    .collect();
                let again = convert_to_canonical(renamed.clone(), version);
                prop_assert_eq!(again, Ok(renamed));
            }
            Err(NameError::Collision { first, second, .. }) => {
                prop_assert!(input.iter().any(|s| s.name == first));
                prop_assert!(input.iter().any(|s| s.name == second));
            }
            Err(NameError::Split { name, .. }) => {
                prop_assert!(name.contains("in_proj_"));
            }
        }
    }
}
