//! LoRA parity with diffusers: one random rank-2 LoRA for the tiny SD1
//! (`scripts/fixtures/make_lora_fixtures.py`: UNet attention, feed-forward, transformer in/out
//! projections, a resnet's 3x3 conv and time-embedding projection; text encoder attention and
//! MLP), in kohya (`lora_unet_<diffusers path>`, `.alpha`), PEFT (`unet.<path>.lora_A`) and
//! older diffusers (`unet.<path>.lora.down`) layouts, applied through the residency manager
//! with multiplier 0.8, against diffusers' `load_lora_weights` fused at `lora_scale=0.8`:
//! the UNet output and the text encoder's last hidden state within 1e-3 (relative L2). A LoRA
//! for a module the model does not have is an error naming the tensor.
//!
//! LyCORIS: LoHa and LoKr files (`scripts/fixtures/make_lycoris_fixtures.py`: PEFT's adapters
//! with random weights, Tucker-form convolutions included, merged by PEFT at 0.8) against the
//! UNet output of PEFT's merge.

use sd_formats::files::TensorCatalog;
use sd_models::diffusion::DiffusionArch;
use sd_models::text_encoder::TextEncoder;
use sd_models::unet::UnetModel;
use sd_models::HostData;
use sd_pipeline::family::ModelSpec;
use sd_pipeline::runtime::{BuiltGraph, ModelHandle, Runtime, RuntimeError, RuntimeOptions};
use sd_residency::{Component, LoraSpec, ResidencyError, SourceId};
use sd_tensor::DType;
use sd_testutil::{SafetensorsWriter, StTensor};

const MULTIPLIER: f32 = 0.8;

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn reference(name: &str) -> Vec<f32> {
    reference_in("reference.safetensors", name)
}

fn reference_in(file: &str, name: &str) -> Vec<f32> {
    let mut loader = TensorCatalog::new();
    loader
        .add_file(fixtures().join("lora").join(file), None)
        .unwrap();
    let bytes = loader.read_converted(name, DType::F32).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn token_ids() -> Vec<i32> {
    let text = std::fs::read_to_string(fixtures().join("lora/reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["multiplier"].as_f64().unwrap() as f32, MULTIPLIER);
    v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap() as i32)
        .collect()
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (&a, &b) in got.iter().zip(want) {
        num += ((a - b) as f64).powi(2);
        den += (b as f64).powi(2);
    }
    (num / den).sqrt()
}

struct Tiny {
    rt: Runtime,
    text: (ModelHandle, TextEncoder),
    unet: (ModelHandle, UnetModel),
    ctx_dim: usize,
}

fn tiny() -> Tiny {
    let mut loader = TensorCatalog::new();
    loader
        .add_file(fixtures().join("pipeline/tiny_sd1.safetensors"), None)
        .unwrap();
    let spec = ModelSpec::detect(&loader).unwrap();
    sd_models::weights::canonicalize(&mut loader, None).unwrap();
    let DiffusionArch::Unet(ucfg) = spec.diffusion.1.clone() else {
        panic!("not a UNet")
    };
    let mut rt = Runtime::new(
        RuntimeOptions {
            threads: 2,
            ..RuntimeOptions::default()
        },
        loader,
    )
    .unwrap();
    let arch = spec.text_encoders[0].1.clone();
    let text = rt
        .add_model(
            "text_encoder",
            Component::TextEncoder,
            SourceId::MAIN,
            |pb| TextEncoder::new(pb, &arch),
        )
        .unwrap();
    let ctx_dim = ucfg.context_dim;
    let unet = rt
        .add_model("unet", Component::Diffusion, SourceId::MAIN, |pb| {
            UnetModel::new(pb, ucfg)
        })
        .unwrap();
    Tiny {
        rt,
        text,
        unet,
        ctx_dim,
    }
}

impl Tiny {
    fn unet_out(&mut self) -> Vec<f32> {
        let (x, t, c) = (reference("x"), reference("t"), reference("context"));
        let ctx_dim = self.ctx_dim;
        let unet = &self.unet.1;
        self.rt
            .run(self.unet.0, "unet", 8192, |g| {
                let xt = g.ctx.new_tensor(DType::F32, &[16, 16, 4, 1])?;
                let tt = g.ctx.new_tensor(DType::F32, &[1])?;
                let ct = g.ctx.new_tensor(DType::F32, &[ctx_dim, 77, 1])?;
                let output = unet.forward(g, &xt, &tt, &ct, None)?;
                Ok(BuiltGraph {
                    output,
                    inputs: vec![
                        (xt, HostData::F32(x)),
                        (tt, HostData::F32(t)),
                        (ct, HostData::F32(c)),
                    ],
                })
            })
            .unwrap()
            .data
    }

    fn text_out(&mut self) -> Vec<f32> {
        let ids = token_ids();
        let enc = &self.text.1;
        let n = ids.len();
        self.rt
            .run(self.text.0, "text", enc.graph_size(), |g| {
                let input = g.ctx.new_tensor(DType::I32, &[n, 1])?;
                let output = enc.forward(g, &input)?;
                Ok(BuiltGraph {
                    output,
                    inputs: vec![(input, HostData::I32(ids))],
                })
            })
            .unwrap()
            .data
    }

    fn set_lora(&mut self, file: &str) -> Result<(), RuntimeError> {
        self.rt.set_loras(vec![LoraSpec {
            path: fixtures().join("lora").join(file),
            multiplier: MULTIPLIER,
        }])
    }
}

#[test]
fn every_layout_equals_diffusers_fused() {
    let mut m = tiny();
    // Without a LoRA: the base outputs.
    let base_unet = rel_l2(&m.unet_out(), &reference("base.unet"));
    let base_text = rel_l2(&m.text_out(), &reference("base.text"));
    println!("no LoRA: UNet {base_unet:.2e}, text {base_text:.2e}");
    assert!(base_unet < 1e-4 && base_text < 1e-4);
    for layout in ["kohya", "peft", "diffusers_old"] {
        m.set_lora(&format!("lora_{layout}.safetensors")).unwrap();
        let unet = rel_l2(&m.unet_out(), &reference(&format!("{layout}.unet")));
        let text = rel_l2(&m.text_out(), &reference(&format!("{layout}.text")));
        // The LoRA moves the outputs far more than the tolerance.
        let moved = rel_l2(
            &reference(&format!("{layout}.unet")),
            &reference("base.unet"),
        );
        println!("{layout}: UNet rel {unet:.2e}, text rel {text:.2e} (the LoRA moves the UNet by {moved:.2})");
        assert!(moved > 0.1);
        assert!(unet < 1e-3, "{layout}: UNet {unet}");
        assert!(text < 1e-3, "{layout}: text {text}");
    }
    // Removing the LoRAs gives the base outputs back.
    m.rt.set_loras(Vec::new()).unwrap();
    assert!(rel_l2(&m.unet_out(), &reference("base.unet")) < 1e-4);
}

#[test]
fn a_lora_for_a_missing_module_is_an_error_naming_it() {
    let mut m = tiny();
    let e = m.set_lora("missing.safetensors").unwrap_err();
    let text = e.to_string();
    println!("{text}");
    assert!(
        matches!(
            e,
            RuntimeError::Residency(ResidencyError::LoraUnknownWeights { .. })
        ),
        "{text}"
    );
    assert!(text.contains("missing.safetensors"), "{text}");
    // Named as in the file, and only the tensors without a target.
    assert!(
        text.contains("lora_unet_down_blocks_7_attentions_0_proj_in.lora_down.weight"),
        "{text}"
    );
    assert!(text.contains(": 2 tensor(s)"), "{text}");
    // Nothing changed: the base outputs.
    assert!(rel_l2(&m.unet_out(), &reference("base.unet")) < 1e-4);
}

#[test]
fn loha_and_lokr_equal_peft_merged() {
    let mut m = tiny();
    for name in ["loha", "lokr", "lokr_both"] {
        m.set_lora(&format!("{name}.safetensors")).unwrap();
        let want = reference_in("lycoris_reference.safetensors", &format!("{name}.unet"));
        let got = rel_l2(&m.unet_out(), &want);
        let moved = rel_l2(&want, &reference("base.unet"));
        println!("{name}: UNet rel {got:.2e} (the adapter moves the UNet by {moved:.2})");
        assert!(moved > 0.1);
        assert!(got < 1e-3, "{name}: UNet {got}");
    }
    m.rt.set_loras(Vec::new()).unwrap();
    assert!(rel_l2(&m.unet_out(), &reference("base.unet")) < 1e-4);
}

/// A LoHa module without its second factor, and a LoKr whose factors do not make the
/// weight's shape, are errors naming the file's tensor; nothing is applied.
#[test]
fn malformed_lycoris_files_are_errors_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let mut loader = TensorCatalog::new();
    loader
        .add_file(fixtures().join("lora/loha.safetensors"), None)
        .unwrap();
    let stem = "lora_unet_down_blocks_0_attentions_0_proj_in";
    let read = |n: &str| {
        let b = loader.read_converted(n, DType::F32).unwrap();
        let shape: Vec<u64> = loader.get(n).unwrap().shape.clone();
        StTensor::f32(n, &shape, &sd_testutil::f32_from_bytes(&b))
    };
    // LoHa without hada_w2_b.
    let half = dir.path().join("half_loha.safetensors");
    SafetensorsWriter::new()
        .tensors(
            ["hada_w1_a", "hada_w1_b", "hada_w2_a", "alpha"]
                .iter()
                .map(|k| read(&format!("{stem}.{k}"))),
        )
        .write(&half)
        .unwrap();
    // LoKr whose w1 is 3x3 for a 16x16 weight with a 4x4 w2.
    let bad_kron = dir.path().join("bad_lokr.safetensors");
    SafetensorsWriter::new()
        .tensor(StTensor::f32(
            &format!("{stem}.lokr_w1"),
            &[3, 3],
            &[0.5; 9],
        ))
        .tensor(StTensor::f32(
            &format!("{stem}.lokr_w2"),
            &[4, 4, 1, 1],
            &[0.5; 16],
        ))
        .write(&bad_kron)
        .unwrap();
    let mut m = tiny();
    for (path, want) in [
        (
            &half,
            vec![format!("{stem}.hada_w"), "hada_w2_b".to_string()],
        ),
        (
            &bad_kron,
            vec![format!("{stem}.lokr_w"), "12x12".to_string()],
        ),
    ] {
        let e =
            m.rt.set_loras(vec![LoraSpec {
                path: path.clone(),
                multiplier: 1.0,
            }])
            .unwrap_err();
        let text = e.to_string();
        println!("{text}");
        for w in want {
            assert!(text.contains(&w), "{text} lacks {w}");
        }
    }
    assert!(rel_l2(&m.unet_out(), &reference("base.unet")) < 1e-4);
}
