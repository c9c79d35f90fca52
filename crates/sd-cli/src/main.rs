//! `sd`: the sd-rs command-line tool.
//!
//! Generates an image from a prompt with an SD1.x / SD2.x checkpoint (`-m MODEL -p PROMPT`,
//! stable-diffusion.cpp's flag names), lists the compute devices ggml sees
//! (`--list-devices`) and runs a tensor self-check on the CPU backend (`--self-check`).
//!
//! Exit codes: 0 success, 1 a model file that is missing or corrupt or a failed run, 2 bad
//! flags or values.

use std::path::PathBuf;
use std::process::ExitCode;

use sd_pipeline::generate::{model_config, txt2img, GenerateError, Txt2Img};
use sd_pipeline::sampling::SampleMethod;
use sd_pipeline::schedule::{AysTable, Scheduler};
use sd_tensor::ggml::{Backend, BufferType, Context, Device, Gallocr, Graph};
use sd_tensor::DType;

const USAGE: &str =
    "usage: sd -m MODEL -p PROMPT [-n NEGATIVE] [-o OUTPUT.png] [-W WIDTH] [-H HEIGHT]
          [--steps N] [--cfg-scale S] [-s SEED] [--sampling-method NAME] [--scheduler NAME]
          [-t THREADS] [-v]
       sd [--list-devices] [--self-check] [-t THREADS] [-v] [--version]";

/// A command-line error: exit code 2.
struct Usage(String);

#[derive(Default)]
struct Args {
    list: bool,
    check: bool,
    verbose: bool,
    version: bool,
    help: bool,
    threads: Option<usize>,
    model: Option<PathBuf>,
    prompt: Option<String>,
    negative: String,
    output: Option<PathBuf>,
    width: Option<usize>,
    height: Option<usize>,
    steps: Option<usize>,
    cfg_scale: Option<f32>,
    seed: Option<u64>,
    sampler: Option<SampleMethod>,
    scheduler: Option<Scheduler>,
}

fn value<'a>(args: &'a [String], i: &mut usize, flag: &str) -> Result<&'a str, Usage> {
    *i += 1;
    args.get(*i)
        .map(String::as_str)
        .ok_or_else(|| Usage(format!("{flag} needs a value")))
}

fn number<T: std::str::FromStr>(text: &str, flag: &str, what: &str) -> Result<T, Usage> {
    text.parse::<T>()
        .map_err(|_| Usage(format!("{flag} needs {what}, got '{text}'")))
}

fn positive(text: &str, flag: &str) -> Result<usize, Usage> {
    match number::<usize>(text, flag, "a positive integer")? {
        0 => Err(Usage(format!(
            "{flag} needs a positive integer, got '{text}'"
        ))),
        n => Ok(n),
    }
}

fn parse(args: &[String]) -> Result<Args, Usage> {
    let mut a = Args::default();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        match flag {
            "--list-devices" => a.list = true,
            "--self-check" => a.check = true,
            "-v" | "--verbose" => a.verbose = true,
            "--version" => a.version = true,
            "-h" | "--help" => a.help = true,
            "-t" | "--threads" => {
                let v = value(args, &mut i, "-t/--threads")?;
                a.threads = Some(positive(v, "-t/--threads")?);
            }
            "-m" | "--model" => a.model = Some(value(args, &mut i, "-m/--model")?.into()),
            "-p" | "--prompt" => a.prompt = Some(value(args, &mut i, "-p/--prompt")?.into()),
            "-n" | "--negative-prompt" => {
                a.negative = value(args, &mut i, "-n/--negative-prompt")?.into()
            }
            "-o" | "--output" => a.output = Some(value(args, &mut i, "-o/--output")?.into()),
            "-W" | "--width" => {
                a.width = Some(positive(value(args, &mut i, "-W/--width")?, "-W/--width")?)
            }
            "-H" | "--height" => {
                a.height = Some(positive(
                    value(args, &mut i, "-H/--height")?,
                    "-H/--height",
                )?)
            }
            "--steps" => a.steps = Some(positive(value(args, &mut i, "--steps")?, "--steps")?),
            "--cfg-scale" => {
                let v = value(args, &mut i, "--cfg-scale")?;
                let s: f32 = number(v, "--cfg-scale", "a number")?;
                if !s.is_finite() || s < 0.0 {
                    return Err(Usage(format!(
                        "--cfg-scale needs a finite number >= 0, got '{v}'"
                    )));
                }
                a.cfg_scale = Some(s);
            }
            "-s" | "--seed" => {
                let v = value(args, &mut i, "-s/--seed")?;
                a.seed = Some(number(v, "-s/--seed", "a non-negative integer")?);
            }
            "--sampling-method" => {
                let v = value(args, &mut i, "--sampling-method")?;
                a.sampler = Some(v.parse().map_err(|_| {
                    let names: Vec<&str> = SampleMethod::ALL.iter().map(|m| m.name()).collect();
                    Usage(format!(
                        "--sampling-method: unknown method '{v}' (known: {})",
                        names.join(", ")
                    ))
                })?);
            }
            "--scheduler" => {
                let v = value(args, &mut i, "--scheduler")?;
                a.scheduler = Some(Scheduler::from_name(v, AysTable::Sd15).map_err(|_| {
                    Usage(format!(
                        "--scheduler: unknown scheduler '{v}' (known: discrete, karras, \
                         exponential, ays, sgm_uniform, simple, lcm)"
                    ))
                })?);
            }
            other => return Err(Usage(format!("unknown argument '{other}'"))),
        }
        i += 1;
    }
    if a.model.is_none() {
        for (set, flag) in [
            (a.prompt.is_some(), "-p/--prompt"),
            (a.output.is_some(), "-o/--output"),
            (a.width.is_some(), "-W/--width"),
            (a.height.is_some(), "-H/--height"),
            (a.steps.is_some(), "--steps"),
            (a.cfg_scale.is_some(), "--cfg-scale"),
            (a.seed.is_some(), "-s/--seed"),
            (a.sampler.is_some(), "--sampling-method"),
            (a.scheduler.is_some(), "--scheduler"),
        ] {
            if set {
                return Err(Usage(format!("{flag} needs -m/--model")));
            }
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let generating = a.model.is_some();
    if a.list || (!a.check && !generating) {
        list_devices();
    }
    if a.check {
        if let Err(e) = self_check(threads) {
            eprintln!("error: self-check failed: {e}");
            return ExitCode::FAILURE;
        }
    }
    if generating {
        return generate(&a, threads);
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
        other => other,
    }
}

fn generate(a: &Args, threads: usize) -> ExitCode {
    let model = a.model.clone().unwrap_or_default();
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
        eprintln!("error: -m/--model needs -p/--prompt\n{USAGE}");
        return ExitCode::from(2);
    };
    let config = match model_config(&model) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let (native_w, native_h) = config.native_size.unwrap_or((512, 512));
    let params = Txt2Img {
        prompt,
        negative: a.negative.clone(),
        width: a.width.unwrap_or(native_w),
        height: a.height.unwrap_or(native_h),
        steps: a.steps.unwrap_or(20),
        cfg_scale: a.cfg_scale.or(config.cfg_scale).unwrap_or(7.0),
        seed: a.seed.unwrap_or(42),
        sampler: a.sampler.unwrap_or(SampleMethod::Euler),
        scheduler: a
            .scheduler
            .unwrap_or_else(|| a.sampler.unwrap_or(SampleMethod::Euler).default_scheduler()),
        threads,
        batch: 1,
    };
    let output = a.output.clone().unwrap_or_else(|| "output.png".into());
    let verbose = a.verbose;
    let start = std::time::Instant::now();
    let mut progress = |step: usize, total: usize| {
        if verbose {
            eprintln!(
                "step {step}/{total} ({:.1} s)",
                start.elapsed().as_secs_f64()
            );
        }
    };
    let images = match txt2img(&model, &params, &mut progress) {
        Ok(images) => images,
        Err(e) => return fail(e),
    };
    let name = if config.name.is_empty() {
        model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    } else {
        config.name.clone()
    };
    let text = vec![("parameters".to_string(), parameters_text(&params, &name))];
    let Some(image) = images.first() else {
        eprintln!("error: no image was generated");
        return ExitCode::FAILURE;
    };
    if let Err(e) = image.save_png(&output, &text) {
        eprintln!("error: cannot write {}: {e}", output.display());
        return ExitCode::FAILURE;
    }
    println!(
        "saved {} ({}x{}, {} steps, {:.1} s)",
        output.display(),
        params.width,
        params.height,
        params.steps,
        start.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
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

fn list_devices() {
    println!(
        "ggml {}: {} device(s)",
        sd_tensor::ggml::version(),
        Device::all().len()
    );
    for d in Device::all() {
        let m = d.memory();
        println!(
            "  {:<8} {:?}  {}  free {} MiB / total {} MiB",
            d.name(),
            d.kind(),
            d.description(),
            m.free >> 20,
            m.total >> 20
        );
    }
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
