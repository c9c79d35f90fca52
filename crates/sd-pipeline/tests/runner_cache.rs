//! The runner cache of a transformer's constant inputs (stable-diffusion.cpp's Qwen-Image
//! prefix cache, made general): the tiny Qwen-Image transformer
//! (`scripts/fixtures/make_qwen_image_fixtures.py`) guided over a prompt and a shorter
//! negative prompt on a simulated device, under a tenth of its weights. Its text embeddings
//! and RoPE tables stay on the device between steps and give the bits of a run that uploads
//! them each time, with fewer bytes uploaded; when keeping them fails (storing an entry, or a
//! step that reads them running out of memory) the step runs again from the host with the
//! same bits and the cache stays off.

mod common;

use common::sim::{sim_runtime, values};
use sd_formats::files::TensorCatalog;
use sd_models::diffusion::{DiffusionArch, DiffusionNet};
use sd_models::qwen_image::QwenImageConfig;
use sd_pipeline::family::{Conditioning, TextCond};
use sd_pipeline::guidance::{EmbeddedText, Guided};
use sd_pipeline::runtime::{ModelHandle, Runtime};
use sd_pipeline::sampling::Denoise;
use sd_residency::{Component, SourceId};
use sd_tensor::Tensor;

fn tiny() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-models/tests/fixtures/qwen_image/qwen_image_tiny.safetensors")
}

/// The weight bytes of the tiny transformer.
fn weight_bytes() -> u64 {
    let mut loader = TensorCatalog::new();
    loader.add_file(tiny(), None).unwrap();
    loader.tensors().map(|t| t.size).sum()
}

/// A runtime on a 64 MiB simulated device, a tenth of the weights plus a workspace allowance,
/// with the transformer added and its constants kept or not.
fn rig(keep: bool) -> (Runtime, ModelHandle, DiffusionNet) {
    let mut loader = TensorCatalog::new();
    loader.add_file(tiny(), None).unwrap();
    let budget = weight_bytes() / 10 + (256 << 10);
    let mut rt = sim_runtime(loader, Some(budget)).unwrap();
    let arch = DiffusionArch::QwenImage(QwenImageConfig::default());
    let (h, net) = rt
        .add_model("qwen_image", Component::Diffusion, SourceId::MAIN, |pb| {
            DiffusionNet::new(pb, &arch)
        })
        .unwrap();
    rt.keep_constants(h, keep).unwrap();
    (rt, h, net)
}

/// A prompt of 7 tokens and a negative prompt of 5 (32 wide): two passes a step.
fn conditioning() -> Conditioning {
    let text = |n: usize, seed: u32| TextCond {
        context: Tensor::new(vec![n, 32], values(n * 32, seed)).unwrap(),
        y: None,
    };
    Conditioning {
        cond: text(7, 3),
        uncond: text(5, 4),
    }
}

/// A guided denoiser over the rig.
fn guided<'a>(
    rt: &'a mut Runtime,
    h: ModelHandle,
    net: &'a DiffusionNet,
    cond: &'a Conditioning,
) -> Guided<'a> {
    Guided {
        runtime: rt,
        handle: h,
        net,
        cond,
        cfg_scale: 4.0,
        guidance: None,
        slg: None,
        renorm: Some(2),
        embedded: EmbeddedText::default(),
    }
}

/// 12x8 latents, 16 channels.
fn latents(seed: u32) -> Tensor<f32> {
    Tensor::new(vec![1, 16, 8, 12], values(16 * 8 * 12, seed)).unwrap()
}

const SIGMAS: [f32; 3] = [1.0, 0.7, 0.4];

fn step(g: &mut Guided<'_>, i: usize) -> Vec<f32> {
    g.predict(&latents(i as u32), SIGMAS[i], SIGMAS[i])
        .unwrap()
        .data()
        .to_vec()
}

/// The steps with every input uploaded at each run.
fn uploaded() -> Vec<Vec<f32>> {
    let cond = conditioning();
    let (mut rt, h, net) = rig(false);
    let mut g = guided(&mut rt, h, &net, &cond);
    (0..SIGMAS.len()).map(|i| step(&mut g, i)).collect()
}

#[test]
fn constants_stay_on_the_device_with_the_same_bits_and_fewer_uploads() {
    let want = uploaded();
    let cond = conditioning();
    let (mut rt, h, net) = rig(true);
    let mut g = guided(&mut rt, h, &net, &cond);
    assert_eq!(step(&mut g, 0), want[0]);
    assert_eq!(g.embedded.len(), 2, "one embedding per prompt");
    let (entries, disabled) = g.runtime.constants_state(h).unwrap();
    // Per prompt: its embedding and the RoPE positions of its token count; one table of
    // frequency factors (same name, shape and bytes) serves both.
    assert_eq!(entries, 5, "entries held");
    assert_eq!(disabled, None);

    // A later step with the constants held uploads less than the same step without them.
    let sim = g.runtime.sim_device().unwrap().clone();
    let before = sim.stats().host_to_device_bytes;
    assert_eq!(step(&mut g, 1), want[1]);
    let kept = sim.stats().host_to_device_bytes - before;
    let cond2 = conditioning();
    let (mut rt2, h2, net2) = rig(false);
    let mut g2 = guided(&mut rt2, h2, &net2, &cond2);
    step(&mut g2, 0);
    let sim2 = g2.runtime.sim_device().unwrap().clone();
    let before = sim2.stats().host_to_device_bytes;
    step(&mut g2, 1);
    let all = sim2.stats().host_to_device_bytes - before;
    // Embeddings (7 + 5 tokens x 64, f32) and RoPE positions (31 + 29 tokens x 4, i32).
    let constant_bytes = ((7 + 5) * 64 + 4 * (31 + 29)) * 4;
    assert!(
        kept + constant_bytes as u64 <= all,
        "kept constants: {kept} B uploaded; uploading them: {all} B"
    );
    assert_eq!(step(&mut g, 2), want[2]);

    // Ending the phase releases them.
    g.runtime.release(h).unwrap();
    assert_eq!(g.runtime.constants_state(h).unwrap().0, 0);
}

/// Storing an entry fails (the device refuses the allocation): the step uploads its
/// constants instead, gives the same bits, and the runtime stops keeping them.
#[test]
fn a_failed_store_uploads_instead_and_gives_the_same_bits() {
    let want = uploaded();
    let cond = conditioning();
    let (mut rt, h, net) = rig(true);
    let mut g = guided(&mut rt, h, &net, &cond);
    assert_eq!(step(&mut g, 0), want[0]);
    // A new phase: the entries go, the embeddings are still known; the next allocation is
    // the first entry's.
    g.runtime.release(h).unwrap();
    let sim = g.runtime.sim_device().unwrap().clone();
    let failed = sim.stats().failed_allocations;
    sim.fail_next_allocations(1);
    assert_eq!(step(&mut g, 1), want[1]);
    assert_eq!(sim.stats().failed_allocations, failed + 1);
    let (entries, disabled) = g.runtime.constants_state(h).unwrap();
    assert_eq!(entries, 0);
    let disabled = disabled.expect("keeping constants is off");
    assert!(disabled.contains("storing"), "{disabled}");
    assert_eq!(step(&mut g, 2), want[2]);
    assert_eq!(g.runtime.constants_state(h).unwrap().0, 0, "stays off");
}

/// A step that reads the held constants runs out of memory (its first two allocations fail:
/// the engine goes on without a staging pool after the first, and the second, a weight block,
/// fails the run): the entries are released and the step runs again from the host with the
/// same bits.
#[test]
fn a_step_out_of_memory_releases_the_cache_and_runs_again() {
    const N: u64 = 2;
    let want = uploaded();
    let cond = conditioning();
    let (mut rt, h, net) = rig(true);
    let mut g = guided(&mut rt, h, &net, &cond);
    assert_eq!(step(&mut g, 0), want[0]);
    assert_eq!(g.runtime.constants_state(h).unwrap().0, 5);
    let sim = g.runtime.sim_device().unwrap().clone();
    let failed = sim.stats().failed_allocations;
    sim.fail_next_allocations(N);
    assert_eq!(step(&mut g, 1), want[1]);
    assert_eq!(sim.stats().failed_allocations, failed + N);
    let (entries, disabled) = g.runtime.constants_state(h).unwrap();
    assert_eq!(entries, 0);
    let disabled = disabled.expect("keeping constants is off");
    assert!(disabled.contains("ran out of memory"), "{disabled}");
    assert_eq!(step(&mut g, 2), want[2]);
}
