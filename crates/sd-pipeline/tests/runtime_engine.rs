//! The pipeline through the execution engine: txt2img on the built-in model gives the same
//! pixels on the CPU backend (parameters mapped from the file), on a simulated device
//! without a budget (parameters read from disk at each use) and on a simulated device whose
//! `--max-vram` budget is small enough to force the UNet and the VAE into segments; the
//! simulated device's peak stays within the budget. A graph run through the runtime equals
//! [`sd_models::run::run_cpu`] bit for bit, and an impossible budget is a clear error.

use sd_formats::files::TensorCatalog;
use sd_models::clip::ClipTextConfig;
use sd_models::clip::ClipTextModel;
use sd_models::first_stage::FirstStageArch;
use sd_models::run::run_cpu;
use sd_models::text_encoder::TextEncoderArch;
use sd_models::{load_all_to_cpu, GraphCtx, HostData, ParamBuilder};
use sd_pipeline::family::ModelSpec;
use sd_pipeline::generate::{GenerateError, Pipeline, Txt2Img};
use sd_pipeline::runtime::{
    BuiltGraph, ComputeDevice, GraphKey, KeyedGraph, ParamsLocation, Runtime, RuntimeError,
    RuntimeOptions,
};
use sd_pipeline::vae_tiling::VaeTiling;
use sd_residency::capacity::MaxVram;
use sd_residency::{Component, SourceId};
use sd_tensor::{DType, Image};

fn builtin() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors")
}

/// The (only) CLIP text encoder's configuration of `spec`.
fn clip_config(spec: &ModelSpec) -> ClipTextConfig {
    let TextEncoderArch::Clip(c) = spec.text_encoders[0].1.clone() else {
        panic!("the built-in model's text encoder is not a CLIP");
    };
    c
}

fn params() -> Txt2Img {
    Txt2Img {
        prompt: "a green triangle on a black background".into(),
        negative: String::new(),
        width: 64,
        height: 64,
        steps: 3,
        cfg_scale: 5.0,
        seed: 3,
        threads: 2,
        ..Txt2Img::default()
    }
}

fn options(compute: ComputeDevice, max_vram: Option<u64>) -> RuntimeOptions {
    RuntimeOptions {
        compute,
        max_vram: max_vram
            .map(|b| MaxVram::parse(&format!("{}", b as f64 / (1u64 << 30) as f64)).unwrap()),
        threads: 2,
        // The UNet and the VAE decoder exceed a 7 MiB budget with this headroom (at 8 MiB
        // the decoder, its convolutions one product per image, now fits whole; at 6 MiB it
        // is tiled); the text encoder (3.4 MB) does not.
        planning_headroom: Some(2 << 20),
        ..RuntimeOptions::default()
    }
}

fn generate(opts: RuntimeOptions) -> Result<(Image, Pipeline), GenerateError> {
    let mut p = Pipeline::load(builtin(), opts)?;
    let mut images = p.txt2img(&params(), &mut |_, _| {})?;
    Ok((images.remove(0), p))
}

#[test]
fn budgeted_segmented_runs_equal_whole_runs() {
    // ggml's ops on the CPU: the simulated device computes the same bits.
    let (cpu, _) = generate(RuntimeOptions {
        mmap: true,
        host_kernels: false,
        ..options(ComputeDevice::Cpu, None)
    })
    .unwrap();
    // The project's CPU kernels (as `sd` runs): the same image to within rounding (20 steps
    // carry the attention's f32 rounding differences: 4 levels at most, 0.15 on average).
    let (host, _) = generate(RuntimeOptions {
        mmap: true,
        ..options(ComputeDevice::Cpu, None)
    })
    .unwrap();
    let diffs: Vec<i32> = cpu
        .pixels()
        .iter()
        .zip(host.pixels())
        .map(|(a, b)| (*a as i32 - *b as i32).abs())
        .collect();
    let max = diffs.iter().max().copied().unwrap_or(0);
    let mean = diffs.iter().sum::<i32>() as f64 / diffs.len() as f64;
    eprintln!("host kernels against ggml's ops: max pixel diff {max}, mean {mean:.4}");
    assert!(max <= 8 && mean < 0.5, "max {max}, mean {mean}");
    let sim = ComputeDevice::Sim {
        bytes: 256 << 20,
        page: 0,
    };
    let (whole, p) = generate(RuntimeOptions {
        params: ParamsLocation::Disk,
        ..options(sim.clone(), None)
    })
    .unwrap();
    let h = p.handles();
    for m in [h.text_encoder, h.unet, h.vae] {
        assert_eq!(
            p.runtime().last_segments(m).len(),
            1,
            "{:?}",
            p.runtime().model_name(m)
        );
    }
    assert_eq!(cpu.pixels(), whole.pixels());

    let budget = 7u64 << 20;
    let (seg, p) = generate(options(sim, Some(budget))).unwrap();
    assert_eq!(p.runtime().budget(), Some(budget));
    let unet = p.runtime().last_segments(h.unet);
    let vae = p.runtime().last_segments(h.vae);
    assert!(unet.len() > 4, "unet ran in {} segment(s)", unet.len());
    assert!(vae.len() > 1, "vae ran in {} segment(s)", vae.len());
    let peak = p.runtime().sim_device().unwrap().peak_bytes();
    assert!(peak <= budget, "peak {peak} > budget {budget}");
    assert_eq!(seg.pixels(), whole.pixels());
}

#[test]
fn an_impossible_budget_is_a_capacity_error() {
    let Err(err) = generate(options(
        ComputeDevice::Sim {
            bytes: 256 << 20,
            page: 0,
        },
        Some(1 << 20),
    )) else {
        panic!("a 1 MiB budget cannot hold the text encoder's token embedding");
    };
    let text = err.to_string();
    assert!(text.contains("SIM0") && text.contains("budget"), "{text}");
}

/// A runtime on a 64 MiB simulated device that always segments, with the CLIP text encoder
/// of `cfg` from `loader` added.
fn segmented_clip_runtime(
    loader: TensorCatalog,
    cfg: &ClipTextConfig,
) -> (Runtime, sd_pipeline::runtime::ModelHandle, ClipTextModel) {
    let mut rt = Runtime::new(
        RuntimeOptions {
            compute: ComputeDevice::Sim {
                bytes: 64 << 20,
                page: 0,
            },
            threads: 2,
            segmentation: sd_exec::SegmentationPolicy::Always,
            ..RuntimeOptions::default()
        },
        loader,
    )
    .unwrap();
    let cfg = cfg.clone();
    let (h, clip) = rt
        .add_model("clip", Component::TextEncoder, SourceId::MAIN, |pb| {
            ClipTextModel::new(pb, cfg)
        })
        .unwrap();
    (rt, h, clip)
}

#[test]
fn a_runtime_graph_equals_run_cpu() {
    let mut loader = TensorCatalog::new();
    loader.add_file(builtin(), None).unwrap();
    let spec = ModelSpec::detect(&loader).unwrap();
    sd_models::weights::canonicalize(&mut loader, None).unwrap();
    let clip_cfg = clip_config(&spec);
    let ids: Vec<i32> = (0..77)
        .map(|i| if i == 0 { 49406 } else { 49407 - (i % 3) })
        .collect();

    // Reference: the whole graph on the CPU backend with weights loaded by hand.
    let pb = ParamBuilder::new(Some(&loader), 4096).unwrap();
    let clip = ClipTextModel::new(&pb, clip_cfg.clone()).unwrap();
    let params = pb.finish();
    let _buf = load_all_to_cpu(&params, &loader).unwrap();
    let mut g = GraphCtx::new(4096, 4096, Default::default()).unwrap();
    let input = g.ctx.new_tensor(DType::I32, &[77, 1]).unwrap();
    let out = clip.forward(&mut g, &input).unwrap();
    let want = run_cpu(
        &g,
        &[&out],
        &[(&input, HostData::I32(ids.clone()))],
        4096,
        2,
    )
    .unwrap()
    .remove(0);

    // The same graph through a runtime on the simulated device, always segmented.
    let (mut rt, h, clip) = segmented_clip_runtime(loader, &clip_cfg);
    let got = rt
        .run(h, "clip", 4096, |g| {
            let input = g.ctx.new_tensor(DType::I32, &[77, 1])?;
            let output = clip.forward(g, &input)?;
            Ok(BuiltGraph {
                output,
                inputs: vec![(input, HostData::I32(ids.clone()))],
            })
        })
        .unwrap();
    assert!(got.segmented && got.segments.len() > 1);
    assert_eq!(got.ne, [clip_cfg.hidden_size, 77, 1, 1]);
    assert_eq!(got.data, want);

    // A handle from elsewhere and a source the runtime lacks are errors, not panics.
    let r = rt.add_model("x", Component::Other, SourceId(7), |_| Ok(()));
    assert!(matches!(r, Err(RuntimeError::Unknown(_))));
}

/// A graph kept by `Runtime::run_keyed` is built once and fed new inputs at each run: every
/// run equals `Runtime::run` of a graph built afresh with the same inputs, bit for bit
/// (segmented on a budgeted simulated device), the engine keeps its plan from the second run
/// on, a wrong number of inputs is an error, and after `Runtime::release` it is built again.
#[test]
fn a_keyed_graph_is_built_once_and_fed_new_inputs() {
    let mut loader = TensorCatalog::new();
    loader.add_file(builtin(), None).unwrap();
    let spec = ModelSpec::detect(&loader).unwrap();
    sd_models::weights::canonicalize(&mut loader, None).unwrap();
    let clip_cfg = clip_config(&spec);
    let (mut rt, h, clip) = segmented_clip_runtime(loader, &clip_cfg);
    let prompt = |k: i32| -> Vec<i32> {
        (0..77)
            .map(|i| if i == 0 { 49406 } else { 49407 - ((i + k) % 5) })
            .collect()
    };
    let key = GraphKey::of(&("clip", 77));
    let builds = std::cell::Cell::new(0);
    let keyed = |rt: &mut Runtime, ids: Vec<i32>| {
        rt.run_keyed(h, "clip", 4096, key, vec![HostData::I32(ids)], |g| {
            builds.set(builds.get() + 1);
            let input = g.ctx.new_tensor(DType::I32, &[77, 1])?;
            let output = clip.forward(g, &input)?;
            Ok(KeyedGraph {
                output,
                inputs: vec![input],
            })
        })
    };
    let mut outputs = Vec::new();
    for k in 0..3 {
        let got = keyed(&mut rt, prompt(k)).unwrap();
        assert!(got.segmented && got.segments.len() > 1);
        assert_eq!(got.plan_kept, k > 0, "run {k}");
        outputs.push(got.data);
    }
    assert_eq!(builds.get(), 1, "built once");
    assert_ne!(outputs[0], outputs[1], "the inputs reach the kept graph");
    for (k, want) in outputs.iter().enumerate() {
        let ids = prompt(k as i32);
        let fresh = rt
            .run(h, "clip", 4096, |g| {
                let input = g.ctx.new_tensor(DType::I32, &[77, 1])?;
                let output = clip.forward(g, &input)?;
                Ok(BuiltGraph {
                    output,
                    inputs: vec![(input, HostData::I32(ids))],
                })
            })
            .unwrap();
        assert!(!fresh.plan_kept);
        assert_eq!(&fresh.data, want, "run {k} differs from a fresh build");
    }
    // The kept graph outlives other runs of the model, and so does its plan.
    let later = keyed(&mut rt, prompt(1)).unwrap();
    assert_eq!(later.data, outputs[1]);
    assert!(later.plan_kept);
    assert_eq!(builds.get(), 1);
    let wrong = rt.run_keyed(h, "clip", 4096, key, vec![], |_| unreachable!());
    assert!(
        matches!(&wrong, Err(RuntimeError::Output { detail, .. }) if detail.contains("fed 0 inputs")),
        "{wrong:?}"
    );
    // The failed run dropped the kept graph; so does a release.
    assert_eq!(keyed(&mut rt, prompt(2)).unwrap().data, outputs[2]);
    assert_eq!(builds.get(), 2);
    rt.release(h).unwrap();
    let again = keyed(&mut rt, prompt(0)).unwrap();
    assert_eq!(again.data, outputs[0]);
    assert!(!again.plan_kept);
    assert_eq!(builds.get(), 3);
}

/// A model from a second model source (how an upscaler file joins a pipeline's runtime)
/// computes like the same model from the main source, on a budgeted simulated device.
#[test]
fn a_second_model_source_runs_in_the_same_runtime() {
    let open = |path: &std::path::Path| {
        let mut loader = TensorCatalog::new();
        loader.add_file(path, None).unwrap();
        sd_models::weights::canonicalize(&mut loader, None).unwrap();
        loader
    };
    let main = open(&builtin());
    let spec = ModelSpec::detect(&main).unwrap();
    let copy = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("second-source.safetensors");
    std::fs::copy(builtin(), &copy).unwrap();
    let mut rt = Runtime::new(
        RuntimeOptions {
            compute: ComputeDevice::Sim {
                bytes: 64 << 20,
                page: 0,
            },
            max_vram: Some(MaxVram::parse("0.01").unwrap()),
            threads: 2,
            planning_headroom: Some(0),
            ..RuntimeOptions::default()
        },
        main,
    )
    .unwrap();
    // The same file twice is refused; a copy is a new source.
    assert!(rt.add_source(open(&builtin())).is_err());
    let second = rt.add_source(open(&copy)).unwrap();
    let FirstStageArch::AutoencoderKl(mut vae_cfg) = spec.first_stage.1.clone() else {
        panic!("the builtin model has an AutoencoderKL");
    };
    vae_cfg.with_encoder = false;
    let (a, vae_a) = rt
        .add_model("vae", Component::Vae, SourceId::MAIN, |pb| {
            sd_models::vae::AutoencoderKl::new(pb, vae_cfg.clone())
        })
        .unwrap();
    let (b, vae_b) = rt
        .add_model("vae-2", Component::Upscaler, second, |pb| {
            sd_models::vae::AutoencoderKl::new(pb, vae_cfg.clone())
        })
        .unwrap();
    let z: Vec<f32> = (0..4 * 8 * 8)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 5.0)
        .collect();
    let mut decode = |h, vae: &sd_models::vae::AutoencoderKl| {
        rt.run(h, "decode", 8192, |g| {
            let t = g.ctx.new_tensor(DType::F32, &[8, 8, 4, 1])?;
            let output = vae.decode(g, &t)?;
            Ok(BuiltGraph {
                output,
                inputs: vec![(t, HostData::F32(z.clone()))],
            })
        })
        .unwrap()
    };
    let out_a = decode(a, &vae_a);
    let out_b = decode(b, &vae_b);
    assert_eq!(out_a.ne, [32, 32, 3, 1]);
    assert_eq!(out_a.data, out_b.data);
    let budget = rt.budget().unwrap();
    let peak = rt.sim_device().unwrap().peak_bytes();
    assert!(peak <= budget, "peak {peak} > budget {budget}");
}

/// `--backend "sim:A&sim:B"`: the UNet is layer-split across two simulated devices (the
/// first's budget too small for it), the other models stay on the first; the image equals
/// the whole run's, each device's own peak stays within its budget, and activations (skips
/// included) cross between the devices.
#[test]
fn layer_split_across_two_simulated_devices_equals_the_whole_run() {
    let sim = ComputeDevice::Sim {
        bytes: 256 << 20,
        page: 0,
    };
    // Tiled VAE decoding keeps the decoder within the first device's small budget.
    let tiled = Txt2Img {
        vae_tiling: Some(VaeTiling {
            tile: 8,
            overlap: 4,
        }),
        ..params()
    };
    let run = |opts: RuntimeOptions| -> (Image, Pipeline) {
        let mut p = Pipeline::load(builtin(), opts).unwrap();
        let img = p.txt2img(&tiled, &mut |_, _| {}).unwrap().remove(0);
        (img, p)
    };
    let (whole, _) = run(options(sim.clone(), None));
    let gib = (1u64 << 30) as f64;
    let (b0, b1) = (5u64 << 20, 64u64 << 20);
    let opts = RuntimeOptions {
        split: vec![sim.clone()],
        max_vram: Some(
            MaxVram::parse(&format!(
                "sim0={},sim1={}",
                b0 as f64 / gib,
                b1 as f64 / gib
            ))
            .unwrap(),
        ),
        ..options(sim, None)
    };
    let (split, p) = run(opts);
    let rt = p.runtime();
    let unet = rt.last_segments(p.handles().unet);
    let devices: Vec<usize> = unet.iter().map(|s| s.device).collect();
    assert!(
        devices.contains(&0) && devices.contains(&1),
        "unet segments on devices {devices:?}"
    );
    assert!(
        devices.windows(2).all(|w| w[0] <= w[1]),
        "not contiguous: {devices:?}"
    );
    assert!(
        unet.iter().any(|s| s.copied_bytes > 0),
        "no activation crossed"
    );
    let p0 = rt.sim_device().unwrap().peak_bytes();
    let p1 = rt.split_sim_devices()[0].peak_bytes();
    assert!(p0 <= b0, "SIM0 peak {p0} > {b0}");
    assert!(p1 <= b1, "SIM1 peak {p1} > {b1}");
    assert!(p1 > 0, "SIM1 unused");
    println!(
        "unet segments per device {devices:?}; peaks SIM0 {p0} of {b0}, SIM1 {p1} of {b1}; \
         copied {} B",
        unet.iter().map(|s| s.copied_bytes).sum::<u64>()
    );
    assert_eq!(split.pixels(), whole.pixels());
}

/// Without a budget, a (simulated) GPU's models keep their weights in its memory, read from
/// the file straight there: no copy in RAM, nothing uploaded for a second image. With the
/// weights in RAM (`--offload-to-cpu`) they are staged from there (again for each image,
/// for the models released between images). The pixels are the same. Models that do not fit
/// the device's free memory keep their weights in RAM.
#[test]
fn weights_load_straight_into_a_device_without_a_budget() {
    let sim = ComputeDevice::Sim {
        bytes: 256 << 20,
        page: 0,
    };
    let cpu = sd_tensor::ggml::Device::cpu().unwrap();
    let mut firsts = Vec::new();
    for loc in [ParamsLocation::Auto, ParamsLocation::Ram] {
        let mut p = Pipeline::load(
            builtin(),
            RuntimeOptions {
                params: loc,
                ..options(sim.clone(), None)
            },
        )
        .unwrap();
        let first = p.txt2img(&params(), &mut |_, _| {}).unwrap().remove(0);
        let h = p.handles();
        let on_device = loc == ParamsLocation::Auto;
        for m in [h.text_encoder, h.unet, h.vae] {
            assert_eq!(p.runtime().weights_on_device(m), Some(on_device), "{loc:?}");
        }
        let host = p.runtime().engine().manager().resident_bytes(&cpu);
        if on_device {
            assert_eq!(host, 0, "weights in RAM with {loc:?}");
        } else {
            assert!(host > 1 << 20, "{host} B of weights in RAM with {loc:?}");
        }
        let h2d = |p: &Pipeline| {
            p.runtime()
                .sim_device()
                .unwrap()
                .stats()
                .host_to_device_bytes
        };
        let before = h2d(&p);
        let second = p.txt2img(&params(), &mut |_, _| {}).unwrap().remove(0);
        let moved = h2d(&p) - before;
        // (From RAM, the models released between images are staged again: 8.9 MB here.)
        if on_device {
            assert!(
                moved < 1 << 20,
                "{loc:?}: the second image uploaded {moved} B"
            );
        }
        assert_eq!(first.pixels(), second.pixels(), "{loc:?}");
        firsts.push(first);
    }
    assert_eq!(firsts[0].pixels(), firsts[1].pixels());
    // A device that cannot hold every model (about 10 MB of weights, 3/4 of 8 MiB free): the
    // models that do not fit keep their weights in RAM and stream from there.
    let p = Pipeline::load(
        builtin(),
        options(
            ComputeDevice::Sim {
                bytes: 8 << 20,
                page: 0,
            },
            None,
        ),
    )
    .unwrap();
    let h = p.handles();
    let placed: Vec<bool> = [h.text_encoder, h.unet, h.vae]
        .into_iter()
        .map(|m| p.runtime().weights_on_device(m).unwrap())
        .collect();
    assert!(
        placed.iter().any(|o| *o) && !placed.iter().all(|o| *o),
        "{placed:?}"
    );
}

/// Under a budget the weights stream to the device from copies in RAM: `preload` reads
/// every model's RAM copies before the first step (none is on the device yet), the run
/// then reads nothing more into RAM, and the image is the one of a run that loads them at
/// first use.
#[test]
fn preload_reads_the_ram_copies_of_a_budgeted_run_before_sampling() {
    let sim = ComputeDevice::Sim {
        bytes: 256 << 20,
        page: 0,
    };
    let cpu = sd_tensor::ggml::Device::cpu().unwrap();
    let budget = 7u64 << 20;
    let (lazy, _) = generate(options(sim.clone(), Some(budget))).unwrap();
    let mut p = Pipeline::load(builtin(), options(sim, Some(budget))).unwrap();
    let h = p.handles();
    let models = [h.text_encoder, h.unet, h.vae];
    let weights: u64 = models
        .iter()
        .flat_map(|m| p.runtime().params(*m).unwrap().tensors.iter())
        .map(|(_, t)| t.nbytes() as u64)
        .sum();
    let host = |p: &Pipeline| p.runtime().engine().manager().resident_bytes(&cpu);
    assert_eq!(host(&p), 0, "weights in RAM before the preload");
    let mut calls = Vec::new();
    p.preload(&mut |d, t| calls.push((d, t))).unwrap();
    let total: usize = models
        .iter()
        .map(|m| p.runtime().param_ids(*m).unwrap().len())
        .sum();
    assert_eq!(calls.last(), Some(&(total, total)), "progress {calls:?}");
    let loaded = host(&p);
    assert!(
        loaded >= weights,
        "{loaded} B in RAM after the preload, {weights} B of weights"
    );
    for m in models {
        assert_eq!(p.runtime().weights_on_device(m), Some(false));
        for id in p.runtime().param_ids(m).unwrap() {
            let info = p.runtime().engine().manager().param_info(*id).unwrap();
            assert!(info.loaded, "{} not loaded", info.name);
        }
    }
    let image = p.txt2img(&params(), &mut |_, _| {}).unwrap().remove(0);
    assert_eq!(host(&p), loaded, "the run read more weights into RAM");
    let peak = p.runtime().sim_device().unwrap().peak_bytes();
    assert!(peak <= budget, "peak {peak} > budget {budget}");
    assert_eq!(image.pixels(), lazy.pixels());
}
