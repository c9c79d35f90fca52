//! OpenCLIP -> transformers conversion details: the fused q/k/v split by offsets, the
//! projection and other extras, collisions and pass-through.

use sd_formats::names::{
    convert_to_canonical, convert_to_canonical_report, NameError, SdVersion, CLIP_G_PREFIX,
    CLIP_PREFIX,
};
use sd_formats::{FileId, TensorStorage};
use sd_tensor::DType;

fn storage(name: &str, dtype: DType, shape: &[u64], offset: u64, size: u64) -> TensorStorage {
    TensorStorage {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        file: FileId(3),
        offset,
        size,
    }
}

fn find<'a>(tensors: &'a [TensorStorage], name: &str) -> &'a TensorStorage {
    tensors.iter().find(|t| t.name == name).unwrap_or_else(|| {
        panic!(
            "no {name} in {:?}",
            tensors.iter().map(|t| &t.name).collect::<Vec<_>>()
        )
    })
}

#[test]
fn sd2_in_proj_splits_into_q_k_v_by_offset() {
    let c = 1024u64;
    let w_offset = 1_000_000;
    let w_size = 3 * c * c * 2;
    let b_offset = w_offset + w_size;
    let b_size = 3 * c * 4;
    let input = vec![
        storage(
            "cond_stage_model.model.transformer.resblocks.5.attn.in_proj_weight",
            DType::F16,
            &[3 * c, c],
            w_offset,
            w_size,
        ),
        storage(
            "cond_stage_model.model.transformer.resblocks.5.attn.in_proj_bias",
            DType::F32,
            &[3 * c],
            b_offset,
            b_size,
        ),
    ];
    let report = convert_to_canonical_report(input, Some(SdVersion::Sd2)).unwrap();
    assert_eq!(report.tensors.len(), 6);
    assert_eq!(report.split.len(), 2);
    assert_eq!(report.renamed, 0);
    let layer = format!("{CLIP_PREFIX}text_model.encoder.layers.5.self_attn.");
    for (i, p) in ["q", "k", "v"].iter().enumerate() {
        let w = find(&report.tensors, &format!("{layer}{p}_proj.weight"));
        assert_eq!(w.shape, vec![c, c]);
        assert_eq!(
            w.offset,
            w_offset + i as u64 * c * c * 2,
            "{p} weight offset"
        );
        assert_eq!(w.size, c * c * 2);
        assert_eq!((w.dtype, w.file), (DType::F16, FileId(3)));
        let b = find(&report.tensors, &format!("{layer}{p}_proj.bias"));
        assert_eq!(b.shape, vec![c]);
        assert_eq!(b.offset, b_offset + i as u64 * c * 4, "{p} bias offset");
        assert_eq!(b.size, c * 4);
    }
    // q, k, v stay in input order, in the input's place.
    let names: Vec<_> = report
        .tensors
        .iter()
        .map(|t| t.name.rsplit('.').nth(1).unwrap().to_owned())
        .collect();
    assert_eq!(
        names,
        ["q_proj", "k_proj", "v_proj", "q_proj", "k_proj", "v_proj"]
    );
}

#[test]
fn quantized_in_proj_splits_on_row_blocks() {
    // Q8_0: 34 bytes per 32 elements; rows of 1280 are 40 blocks.
    let row = 1280 / 32 * 34;
    let t = storage(
        "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight",
        DType::Q8_0,
        &[3 * 1280, 1280],
        64,
        3 * 1280 * row,
    );
    let out = convert_to_canonical(vec![t], None).unwrap();
    let k = find(
        &out,
        &format!("{CLIP_G_PREFIX}text_model.encoder.layers.0.self_attn.k_proj.weight"),
    );
    assert_eq!(k.offset, 64 + 1280 * row);
    assert_eq!(k.size, 1280 * row);
    assert_eq!(k.dtype, DType::Q8_0);
}

#[test]
fn unsplittable_in_proj_is_an_error() {
    let t = storage(
        "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight",
        DType::F16,
        &[1000, 1024],
        0,
        2_048_000,
    );
    match convert_to_canonical(vec![t], None) {
        Err(NameError::Split { name, shape, .. }) => {
            assert_eq!(
                name,
                "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight"
            );
            assert_eq!(shape, vec![1000, 1024]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn openclip_extras() {
    let input = vec![
        storage(
            "cond_stage_model.model.text_projection",
            DType::F16,
            &[1024, 1024],
            0,
            2 << 20,
        ),
        storage("cond_stage_model.model.logit_scale", DType::F32, &[], 0, 4),
        storage(
            "cond_stage_model.model.positional_embedding",
            DType::F32,
            &[77, 1024],
            0,
            77 * 4096,
        ),
        storage(
            "cond_stage_model.model.ln_final.weight",
            DType::F32,
            &[1024],
            0,
            4096,
        ),
        // SDXL refiner: its only embedder is OpenCLIP-G, at index 0.
        storage(
            "conditioner.embedders.0.model.token_embedding.weight",
            DType::F16,
            &[49408, 1280],
            0,
            49408 * 2560,
        ),
        storage(
            "conditioner.embedders.0.model.transformer.resblocks.3.ln_2.bias",
            DType::F32,
            &[1280],
            0,
            5120,
        ),
    ];
    let names: Vec<_> = convert_to_canonical(input, None)
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(
        names,
        [
            "cond_stage_model.transformer.text_model.text_projection",
            "cond_stage_model.model.logit_scale",
            "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
            "cond_stage_model.transformer.text_model.final_layer_norm.weight",
            "cond_stage_model.1.transformer.text_model.embeddings.token_embedding.weight",
            "cond_stage_model.1.transformer.text_model.encoder.layers.3.layer_norm2.bias",
        ]
    );
}

#[test]
fn collisions_name_both_sources() {
    let input = vec![
        storage(
            "cond_stage_model.transformer.text_model.final_layer_norm.weight",
            DType::F32,
            &[768],
            0,
            3072,
        ),
        storage(
            "cond_stage_model.model.ln_final.weight",
            DType::F32,
            &[768],
            0,
            3072,
        ),
    ];
    let err = convert_to_canonical(input, None).unwrap_err();
    assert_eq!(
        err,
        NameError::Collision {
            target: "cond_stage_model.transformer.text_model.final_layer_norm.weight".into(),
            first: "cond_stage_model.transformer.text_model.final_layer_norm.weight".into(),
            second: "cond_stage_model.model.ln_final.weight".into(),
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("cond_stage_model.model.ln_final.weight"),
        "{msg}"
    );

    // A fused projection colliding with an already-split one.
    let input = vec![
        storage(
            "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.k_proj.bias",
            DType::F32,
            &[4],
            0,
            16,
        ),
        storage(
            "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_bias",
            DType::F32,
            &[12],
            0,
            48,
        ),
    ];
    assert!(matches!(
        convert_to_canonical(input, None),
        Err(NameError::Collision { second, .. }) if second == "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_bias"
    ));

    // Exact duplicates too.
    let dup = storage("anything.weight", DType::F32, &[1], 0, 4);
    assert!(matches!(
        convert_to_canonical(vec![dup.clone(), dup], None),
        Err(NameError::Collision { .. })
    ));
}

#[test]
fn unknown_and_adapter_names_pass_unchanged() {
    let names = [
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight",
        "lora_te_text_model_encoder_layers_0_mlp_fc1.alpha",
        "model_ema.decay",
        "alphas_cumprod",
        "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight",
        // Bare T5 names without the block-0 `q` marker of a T5 file (see names_t5.rs).
        "encoder.final_layer_norm.weight",
        "shared.weight",
        "model.diffusion_model.down_blocks.0.resnets.0.weird.weight",
        "cond_stage_model.model.transformer.resblocks.0.attn.strange",
        "vae.encoder.block.0.weight",
        "conditioner.embedders.2.something.weight",
        "model.0.weight",
    ];
    let input: Vec<_> = names
        .iter()
        .map(|n| storage(n, DType::F32, &[2, 2], 0, 16))
        .collect();
    assert_eq!(convert_to_canonical(input.clone(), None).unwrap(), input);
}

#[test]
fn bare_prefixless_names_need_their_component_marker() {
    // Diffusers UNet names with no conv_in.weight (e.g. a LoRA) are not touched ...
    let lora = vec![storage(
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
        DType::F32,
        &[4, 320],
        0,
        5120,
    )];
    assert_eq!(convert_to_canonical(lora.clone(), None).unwrap(), lora);
    // ... while under the pipeline folder prefix they are structural names like any other.
    let mut peft = lora;
    peft[0].name = format!("unet.{}", peft[0].name);
    assert_eq!(
        convert_to_canonical(peft, None).unwrap()[0].name,
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.lora_A.weight"
    );
}

/// Stability's SD3 single files keep CLIP-L and bigG under `text_encoders.clip_{l,g}.
/// transformer.` (transformers names below); they land in the canonical CLIP slots whatever
/// the family, while the DiT's own names stay.
#[test]
fn sd3_single_file_encoders_move_to_the_clip_slots() {
    let input = vec![
        storage(
            "text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight",
            DType::F16,
            &[49408, 768],
            0,
            49408 * 768 * 2,
        ),
        storage(
            "text_encoders.clip_g.transformer.text_projection.weight",
            DType::F16,
            &[1280, 1280],
            0,
            1280 * 1280 * 2,
        ),
        storage(
            "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
            DType::F16,
            &[4608, 1536],
            0,
            4608 * 1536 * 2,
        ),
    ];
    for version in [Some(SdVersion::Sd3), None] {
        let out = convert_to_canonical(input.clone(), version).unwrap();
        find(
            &out,
            &format!("{CLIP_PREFIX}text_model.embeddings.token_embedding.weight"),
        );
        find(&out, &format!("{CLIP_G_PREFIX}text_projection.weight"));
        find(
            &out,
            "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
        );
    }
}
