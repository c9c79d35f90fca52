//! `sd`: the sd-rs command-line tool.
//!
//! Generates an image from a prompt with an SD1.x / SD2.x checkpoint (`-m MODEL -p PROMPT`,
//! stable-diffusion.cpp's flag names), lists the compute devices ggml sees
//! (`--list-devices`) and runs a tensor self-check on the CPU backend (`--self-check`).
//!
//! Exit codes: 0 success, 1 a model file that is missing or corrupt or a failed run, 2 bad
//! flags or values.

mod args;
mod devices;
mod progress;
mod upscale;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use args::{parse, Args, Usage, USAGE};
use progress::Progress;
use sd_pipeline::generate::{Callbacks, GenerateError, LoadOptions, ModelFiles, Pipeline, Txt2Img};
use sd_pipeline::rng::RngKind;
use sd_pipeline::runtime::{ComputeDevice, RuntimeOptions};
use sd_pipeline::schedule::Scheduler;
use sd_pipeline::vae_tiling::VaeTiling;
use sd_tensor::ggml::{Backend, BufferType, Context, Gallocr, Graph};
use sd_tensor::{DType, Image};

fn main() -> ExitCode {
    devices::load_modules();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (args, up) = match upscale::take_flags(&args) {
        Ok(x) => x,
        Err(msg) => {
            eprintln!("error: {msg}\n{USAGE}{}", upscale::USAGE);
            return ExitCode::from(2);
        }
    };
    if up.mode {
        return upscale::run(&up);
    }
    let a = match parse(&args) {
        Ok(a) => a,
        Err(Usage(msg)) => {
            eprintln!("error: {msg}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if a.version {
        println!(
            "sd {} (ggml {})",
            env!("CARGO_PKG_VERSION"),
            sd_tensor::ggml::version()
        );
        return ExitCode::SUCCESS;
    }
    if a.help {
        println!("{USAGE}{}", upscale::USAGE);
        return ExitCode::SUCCESS;
    }
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let generating = a.generating();
    if a.list || (!a.check && !generating) {
        devices::list();
    }
    if a.check {
        if let Err(e) = self_check(threads) {
            eprintln!("error: self-check failed: {e}");
            return ExitCode::FAILURE;
        }
    }
    if generating {
        return generate(&a, threads, &up);
    }
    if up.model.is_some() {
        eprintln!("error: --upscale-model needs -m/--model and -p/--prompt, or upscale mode");
        return ExitCode::from(2);
    }
    ExitCode::SUCCESS
}

/// The command-line flag of a [`GenerateError::InvalidSetting`].
fn flag_name(setting: &str) -> &str {
    match setting {
        "width" => "-W/--width",
        "height" => "-H/--height",
        "steps" => "--steps",
        "cfg-scale" => "--cfg-scale",
        "batch-count" => "-b/--batch-count",
        "strength" => "--strength",
        "init-img" => "-i/--init-img",
        "clip-skip" => "--clip-skip",
        "model" => "-m/--model",
        other => other,
    }
}

/// The path of image `i` of a batch: `OUTPUT` for the first, then `STEM_2.EXT`, ...
fn output_path(output: &Path, i: usize) -> PathBuf {
    if i == 0 {
        return output.to_path_buf();
    }
    let stem = output
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = output
        .extension()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_else(|| "png".into());
    output.with_file_name(format!("{stem}_{}.{ext}", i + 1))
}

/// Checks that the output's directory exists before any work.
fn check_output(output: &Path) -> Result<(), String> {
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if output.is_dir() {
        return Err(format!("-o/--output: {} is a directory", output.display()));
    }
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() && m.permissions().readonly() => Err(format!(
            "-o/--output: cannot write {}: the directory {} is read-only",
            output.display(),
            dir.display()
        )),
        Ok(m) if m.is_dir() => Ok(()),
        _ => Err(format!(
            "-o/--output: cannot write {}: the directory {} does not exist",
            output.display(),
            dir.display()
        )),
    }
}

fn generate(a: &Args, threads: usize, up: &upscale::UpscaleArgs) -> ExitCode {
    let fail = |e: GenerateError| {
        if let GenerateError::InvalidSetting { flag, message } = &e {
            eprintln!("error: {}: {message}", flag_name(flag));
            ExitCode::from(2)
        } else {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    };
    let Some(prompt) = a.prompt.clone() else {
        eprintln!("error: a model needs -p/--prompt\n{USAGE}");
        return ExitCode::from(2);
    };
    let output = a.output.clone().unwrap_or_else(|| "output.png".into());
    if let Err(msg) = check_output(&output) {
        eprintln!("error: {msg}");
        return ExitCode::from(2);
    }
    let init = match &a.init {
        Some(path) => match Image::load_png(path) {
            Ok(img) => Some(img.to_rgb()),
            Err(e) => {
                eprintln!("error: -i/--init-img: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    let files = ModelFiles {
        model: a.model.clone(),
        components: a
            .components
            .iter()
            .map(|(slot, path)| (slot.to_string(), path.clone()))
            .collect(),
    };
    let runtime = RuntimeOptions {
        compute: a.backend.clone().unwrap_or(ComputeDevice::Cpu),
        split: a.split.clone(),
        params: a.params_backend.unwrap_or_default(),
        mmap: a.mmap,
        max_vram: a.max_vram.clone(),
        threads,
        weight_type: a.weight_type,
        ..RuntimeOptions::default()
    };
    if a.max_vram.is_some() && matches!(runtime.compute, ComputeDevice::Cpu) {
        eprintln!("warning: --max-vram budgets a GPU (--backend); the CPU backend ignores it");
    }
    let mut progress = Progress::new(a.verbose);
    progress.phase("loading");
    let mut pipeline = match Pipeline::open(
        &files,
        LoadOptions {
            runtime,
            clip_skip: a.clip_skip,
            prediction: a.prediction,
        },
    ) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    if let Err(e) = pipeline.preload(&mut |d, t| progress.update(d, t, "tensors")) {
        return fail(e);
    }
    let spec = pipeline.spec().clone();
    let defaults = spec.defaults;
    let (native_w, native_h) = init
        .as_ref()
        .map(|i| (i.width(), i.height()))
        .unwrap_or((defaults.width, defaults.height));
    let sampler = a.sampler.unwrap_or(defaults.sampler);
    // The scheduler's name was checked when parsing; `ays` takes the family's table.
    let scheduler = match a.scheduler {
        Some(s) => Scheduler::from_name(s.name(), defaults.ays).unwrap_or(s),
        None => defaults
            .scheduler
            .unwrap_or_else(|| sampler.default_scheduler()),
    };
    let params = Txt2Img {
        prompt,
        negative: a.negative.clone(),
        width: a.width.unwrap_or(native_w),
        height: a.height.unwrap_or(native_h),
        steps: a.steps.unwrap_or(defaults.steps),
        cfg_scale: a.cfg_scale.unwrap_or(defaults.cfg_scale),
        seed: a.seed.unwrap_or(42),
        sampler,
        scheduler,
        threads,
        batch: a.batch.unwrap_or(1),
        rng: a.rng.unwrap_or(RngKind::Cpu),
        vae_tiling: a.vae_tiling.then(VaeTiling::default),
    };
    // One call for the whole batch (the prompt is encoded once); each decoded image starts
    // the next one's progress line.
    let batch = params.batch;
    let label = |i: usize| {
        if batch > 1 {
            format!("image {}/{batch}", i + 1)
        } else {
            "sampling".to_string()
        }
    };
    progress.phase(label(0));
    let progress = std::cell::RefCell::new(progress);
    let total = std::cell::Cell::new(0usize);
    let mut on_step = |s: usize, t: usize| {
        total.set(t);
        progress.borrow_mut().update(s - 1, t, "steps");
    };
    let mut on_image = |i: usize, _: &Image| {
        let mut p = progress.borrow_mut();
        p.update(total.get(), total.get(), "steps");
        if i + 1 < batch {
            p.phase(label(i + 1));
        }
    };
    let callbacks = Callbacks {
        on_step: &mut on_step,
        on_image: &mut on_image,
    };
    let init_strength = init.as_ref().map(|img| (img, a.strength.unwrap_or(0.75)));
    let result = pipeline.generate(&params, init_strength, callbacks);
    let mut progress = progress.into_inner();
    let images = match result {
        Ok(v) => v,
        Err(e) => {
            progress.finish_line();
            return fail(e);
        }
    };
    progress.finish_line();
    let images = match upscale::after_generation(up, &mut pipeline, images, a.verbose) {
        Ok(v) => v,
        Err(code) => return code,
    };
    if a.verbose {
        report_memory(&pipeline);
    }
    let name = if spec.name.is_empty() {
        files
            .primary()
            .and_then(|m| m.file_stem())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    } else {
        spec.name.clone()
    };
    if images.is_empty() {
        eprintln!("error: no image was generated");
        return ExitCode::FAILURE;
    }
    for (i, image) in images.iter().enumerate() {
        let one = Txt2Img {
            seed: params.seed.wrapping_add(i as u64),
            ..params.clone()
        };
        let path = output_path(&output, i);
        let mut text = parameters_text(&one, &name);
        if let (Some(_), s) = (&init, a.strength) {
            text.push_str(&format!(", Denoising strength: {}", s.unwrap_or(0.75)));
        }
        text.push_str(&upscale::parameters_note(up));
        if let Err(e) = image.save_png(&path, &[("parameters".to_string(), text)]) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!(
            "saved {} ({}x{}, {} steps, seed {}, {:.1} s)",
            path.display(),
            image.width(),
            image.height(),
            params.steps,
            one.seed,
            progress.elapsed()
        );
    }
    ExitCode::SUCCESS
}

/// Prints (with `-v`) how each model ran last and the simulated device's peak.
fn report_memory(p: &Pipeline) {
    let rt = p.runtime();
    let h = p.handles();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    if let Some(b) = rt.budget() {
        eprintln!(
            "budget on {}: {:.1} MiB",
            rt.compute_backend().name(),
            mib(b)
        );
    }
    for m in h.all() {
        let r = rt.last_segments(m);
        let peak = r.iter().map(|s| s.footprint()).max().unwrap_or(0);
        let devices = r.iter().map(|s| s.device).max().unwrap_or(0) + 1;
        let split = if devices > 1 {
            let per: Vec<String> = (0..devices)
                .map(|d| r.iter().filter(|s| s.device == d).count().to_string())
                .collect();
            let copied: u64 = r.iter().map(|s| s.copied_bytes).sum();
            format!(
                ", layer split {} per device, {:.2} MiB copied between devices",
                per.join("+"),
                mib(copied)
            )
        } else {
            String::new()
        };
        eprintln!(
            "{}: {} segment(s) in its last run, largest footprint {:.1} MiB{split}",
            rt.model_name(m).unwrap_or("?"),
            r.len(),
            mib(peak)
        );
    }
    if let Some(sim) = rt.sim_device() {
        eprintln!("simulated device peak: {:.2} MiB", mib(sim.peak_bytes()));
    }
    for (i, sim) in rt.split_sim_devices().iter().enumerate() {
        eprintln!(
            "simulated split device SIM{} peak: {:.2} MiB",
            i + 1,
            mib(sim.peak_bytes())
        );
    }
}

/// The A1111-style `parameters` text of a PNG.
fn parameters_text(p: &Txt2Img, model: &str) -> String {
    let mut s = p.prompt.clone();
    if !p.negative.is_empty() {
        s.push_str(&format!("\nNegative prompt: {}", p.negative));
    }
    s.push_str(&format!(
        "\nSteps: {}, Sampler: {}, CFG scale: {}, Seed: {}, Size: {}x{}, Model: {model}",
        p.steps,
        p.sampler.name(),
        p.cfg_scale,
        p.seed,
        p.width,
        p.height
    ));
    if p.scheduler != p.sampler.default_scheduler() {
        s.push_str(&format!(", Schedule type: {}", p.scheduler.name()));
    }
    s
}

/// Multiplies two small matrices on the CPU backend and checks the result.
fn self_check(threads: usize) -> Result<(), sd_tensor::GgmlError> {
    let ctx = Context::new_descriptors(8, 8, 1)?;
    let a = ctx.new_tensor(DType::F32, &[16, 8])?;
    let b = ctx.new_tensor(DType::F32, &[16, 4])?;
    let _buf = BufferType::cpu().alloc_context_tensors(&ctx)?;
    let av: Vec<f32> = (0..128).map(|i| (i % 7) as f32).collect();
    let bv: Vec<f32> = (0..64).map(|i| (i % 5) as f32).collect();
    a.write_f32(&av)?;
    b.write_f32(&bv)?;
    let c = ctx.mul_mat(&a, &b)?;
    c.set_output();
    let mut g = Graph::new(&ctx, 8)?;
    g.build_forward_expand(&c)?;
    let backend = Backend::cpu(threads)?;
    let mut galloc = Gallocr::new(backend.buffer_type())?;
    galloc.alloc_graph(&g)?;
    backend.compute(&g)?;
    let got = c.read_f32()?;
    for j in 0..4 {
        for i in 0..8 {
            let want: f32 = (0..16).map(|k| av[i * 16 + k] * bv[j * 16 + k]).sum();
            if (got[j * 8 + i] - want).abs() > 1e-4 {
                return Err(sd_tensor::GgmlError::Mismatch(format!(
                    "c[{j},{i}] = {} != {want}",
                    got[j * 8 + i]
                )));
            }
        }
    }
    println!(
        "self-check: 8x16 @ 16x4 matmul on {} ({} threads) ok",
        backend.name(),
        threads
    );
    Ok(())
}
