//! Command-line parsing (stable-diffusion.cpp's flag names where it has them).

use std::path::PathBuf;

use sd_pipeline::family;
use sd_pipeline::rng::RngKind;
use sd_pipeline::runtime::{ComputeDevice, ParamsLocation};
use sd_pipeline::sampling::{Prediction, SampleMethod};
use sd_pipeline::schedule::{AysTable, Scheduler};
use sd_residency::capacity::MaxVram;
use sd_tensor::DType;

pub const USAGE: &str = "\
usage: sd -m MODEL -p PROMPT [options]          text to image
       sd -m MODEL -p PROMPT -i INIT.png [--strength S] [options]   image to image
       sd [--list-devices] [--self-check] [-t THREADS] [-v] [--version] [-h]

model files:
  -m, --model PATH            full checkpoint (safetensors, GGUF, .ckpt)
  --diffusion-model PATH      UNet alone (replaces the checkpoint's)
  --vae PATH                  autoencoder alone (replaces the checkpoint's)
  --clip_l PATH               CLIP-L text encoder alone (replaces the checkpoint's)
  --clip_h PATH               OpenCLIP-H text encoder alone (SD2.x)
  --clip_g PATH               OpenCLIP-bigG text encoder alone (SDXL, the SDXL refiner)
  --type TYPE                 convert weights when loading: f32, f16, bf16, q8_0, q5_0,
                              q5_1, q4_0, q4_1, q2_K..q6_K (quantized types apply to linear
                              weights; default: the files' types)
generation:
  -p, --prompt TEXT           prompt ((word:1.2) attention syntax)
  -n, --negative-prompt TEXT  negative prompt
  -o, --output PATH           output PNG (default output.png; a batch writes PATH, then
                              NAME_2.png, NAME_3.png, ...)
  -W, --width N / -H, --height N   size in pixels (default: the model's, or the init image's)
  --steps N                   sampling steps (default 20)
  --cfg-scale S               guidance scale (default: the model's, else 7)
  -s, --seed N                seed (default 42; image i of a batch uses N+i)
  -b, --batch-count N         number of images (default 1)
  --sampling-method NAME      euler, euler_a, heun, dpm2, dpm++2s_a, dpm++2m, dpm++2mv2,
                              ipndm, ipndm_v, lcm, ddim_trailing, tcd (default euler)
  --scheduler NAME            discrete, karras, exponential, ays, sgm_uniform, simple, lcm
  --rng cpu|cuda              noise generator: torch CPU or CUDA Philox (default cpu)
  --clip-skip N               use the text encoder layer N from the end (default: the model's)
  --prediction eps|v          what the UNet predicts (default: the model's; SD2.x 768-v
                              checkpoints need v)
  -i, --init-img PATH         init image (PNG) for img2img
  --strength S                img2img noise strength in [0, 1] (default 0.75)
  --vae-tiling                VAE-decode (and encode, for img2img) in overlapping tiles
devices and memory:
  --backend NAME              compute device: cpu (default), a ggml device name from
                              --list-devices (CUDA0, Vulkan0, ...), or sim:SIZE, a simulated
                              GPU of SIZE (MiB, or with unit K/M/G) whose arithmetic runs on
                              the CPU, with exact memory accounting (tests, budget studies);
                              A&B (or diffusion=A&B) layer-splits the UNet across A and
                              B within each one's --max-vram (sim:64&sim:64 -> SIM0, SIM1)
  --params-backend WHERE      where weights live between uses: cpu/ram (loaded once) or disk
                              (read from the files at each use)
  --max-vram SIZE             compute device budget for weights + workspace: GiB (4, 3.5),
                              or with a unit (512M, 6G); 0 = none; negative = free memory
                              minus that much; per device: cuda0=6,cuda1=8; on CUDA,
                              320M of it is left to the CUDA runtime (cuBLAS, kernels)
  --mmap                      map weights from the files instead of copying them
  -t, --threads N             CPU threads (default: all cores)
  -v, --verbose               log every step
  --list-devices              list the ggml compute devices
  --self-check                run a small matmul on the CPU backend

exit codes: 0 success, 1 a missing/corrupt model or image file or a failed run, 2 bad flags
or values.";

/// A command-line error: exit code 2.
#[derive(Debug)]
pub struct Usage(pub String);

/// The parsed command line.
#[derive(Default)]
pub struct Args {
    pub list: bool,
    pub check: bool,
    pub verbose: bool,
    pub version: bool,
    pub help: bool,
    pub threads: Option<usize>,
    pub model: Option<PathBuf>,
    /// Component files: `(slot name, path)`; the flags are the model families' slots
    /// (`--diffusion-model`, `--vae`, `--clip_l`, ...).
    pub components: Vec<(&'static str, PathBuf)>,
    pub weight_type: Option<DType>,
    pub prompt: Option<String>,
    pub negative: String,
    pub output: Option<PathBuf>,
    pub width: Option<usize>,
    pub height: Option<usize>,
    pub steps: Option<usize>,
    pub cfg_scale: Option<f32>,
    pub seed: Option<u64>,
    pub batch: Option<usize>,
    pub sampler: Option<SampleMethod>,
    pub scheduler: Option<Scheduler>,
    pub rng: Option<RngKind>,
    pub clip_skip: Option<usize>,
    pub prediction: Option<Prediction>,
    pub init: Option<PathBuf>,
    pub strength: Option<f32>,
    pub vae_tiling: bool,
    pub backend: Option<ComputeDevice>,
    pub split: Vec<ComputeDevice>,
    pub params_backend: Option<ParamsLocation>,
    pub max_vram: Option<MaxVram>,
    pub mmap: bool,
}

impl Args {
    /// Whether any model file is given (generation is asked for).
    pub fn generating(&self) -> bool {
        self.model.is_some()
            || self.components.iter().any(|(name, _)| {
                family::slot_by_name(name).is_some_and(|s| s.kind == family::SlotKind::Diffusion)
            })
    }
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

/// `--max-vram` ([`MaxVram::parse`]: GiB numbers or sizes with units).
pub fn parse_max_vram(text: &str) -> Result<MaxVram, Usage> {
    MaxVram::parse(text).map_err(|e| Usage(e.to_string()))
}

/// Parses the arguments (without the program name).
pub fn parse(args: &[String]) -> Result<Args, Usage> {
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
            "--mmap" => a.mmap = true,
            "--vae-tiling" => a.vae_tiling = true,
            "-t" | "--threads" => {
                let v = value(args, &mut i, "-t/--threads")?;
                a.threads = Some(positive(v, "-t/--threads")?);
            }
            "-m" | "--model" => a.model = Some(value(args, &mut i, "-m/--model")?.into()),
            "--type" => {
                let v = value(args, &mut i, flag)?;
                let t = DType::parse(v)
                    .filter(|d| (d.is_float() && *d != DType::F64) || d.is_quantized());
                a.weight_type = Some(t.ok_or_else(|| {
                    Usage(format!(
                        "--type: unknown weight type '{v}' (known: f32, f16, bf16, q8_0, \
                         q5_0, q5_1, q4_0, q4_1, q2_K, q3_K, q4_K, q5_K, q6_K)"
                    ))
                })?);
            }
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
            "-b" | "--batch-count" => {
                a.batch = Some(positive(
                    value(args, &mut i, "-b/--batch-count")?,
                    "-b/--batch-count",
                )?)
            }
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
            "--strength" => {
                let v = value(args, &mut i, flag)?;
                let s: f32 = number(v, flag, "a number between 0 and 1")?;
                if !(0.0..=1.0).contains(&s) {
                    return Err(Usage(format!(
                        "--strength needs a number between 0 and 1, got '{v}'"
                    )));
                }
                a.strength = Some(s);
            }
            "-i" | "--init-img" => a.init = Some(value(args, &mut i, "-i/--init-img")?.into()),
            "--prediction" => {
                a.prediction = Some(match value(args, &mut i, flag)? {
                    "eps" => Prediction::Eps,
                    "v" => Prediction::V,
                    other => {
                        return Err(Usage(format!("--prediction needs eps or v, got '{other}'")))
                    }
                });
            }
            "--clip-skip" => {
                let v = value(args, &mut i, flag)?;
                let n: i64 = number(v, flag, "an integer")?;
                // stable-diffusion.cpp: -1 (or 0) means the model's default.
                a.clip_skip = (n > 0).then_some(n as usize);
            }
            "-s" | "--seed" => {
                let v = value(args, &mut i, "-s/--seed")?;
                a.seed = Some(number(v, "-s/--seed", "a non-negative integer")?);
            }
            "--rng" => {
                let v = value(args, &mut i, flag)?;
                a.rng =
                    Some(v.parse().map_err(|_| {
                        Usage(format!("--rng: unknown rng '{v}' (known: cpu, cuda)"))
                    })?);
            }
            "--backend" => {
                let v = value(args, &mut i, flag)?;
                // `a&b&...` (optionally `diffusion=a&b`): the diffusion model is layer-split
                // across the devices, in order; everything else runs on the first.
                let v = v.strip_prefix("diffusion=").unwrap_or(v);
                let mut devices = Vec::new();
                for part in v.split('&') {
                    let d: ComputeDevice =
                        part.parse().map_err(|e| Usage(format!("--backend: {e}")))?;
                    devices.push(d);
                }
                a.backend = Some(devices.remove(0));
                a.split = devices;
            }
            "--params-backend" => {
                let v = value(args, &mut i, flag)?;
                a.params_backend = Some(
                    v.parse()
                        .map_err(|e| Usage(format!("--params-backend: {e}")))?,
                );
            }
            "--max-vram" => {
                let v = value(args, &mut i, flag)?;
                a.max_vram = Some(parse_max_vram(v)?);
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
                // `ays` takes the model's table once the model is known (main.rs).
                a.scheduler = Some(Scheduler::from_name(v, AysTable::Sd15).map_err(|_| {
                    Usage(format!(
                        "--scheduler: unknown scheduler '{v}' (known: discrete, karras, \
                         exponential, ays, sgm_uniform, simple, lcm)"
                    ))
                })?);
            }
            other => match family::slot_by_flag(other) {
                Some(slot) => {
                    let path = value(args, &mut i, slot.flag)?.into();
                    a.components.push((slot.name, path));
                }
                None => return Err(Usage(format!("unknown argument '{other}'"))),
            },
        }
        i += 1;
    }
    if !a.generating() {
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
            (a.init.is_some(), "-i/--init-img"),
        ]
        .into_iter()
        .chain(a.components.iter().map(|(name, _)| {
            (
                true,
                family::slot_by_name(name).map_or("a component flag", |s| s.flag),
            )
        })) {
            if set {
                return Err(Usage(format!(
                    "{flag} needs -m/--model (or --diffusion-model)"
                )));
            }
        }
    }
    if a.strength.is_some() && a.init.is_none() {
        return Err(Usage("--strength needs -i/--init-img".into()));
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sd_residency::capacity::BudgetSpec;

    #[test]
    fn backend_with_ampersands_is_a_layer_split() {
        let a = parse(&["--backend".into(), "diffusion=sim:64&sim:32".into()]).unwrap();
        assert_eq!(a.backend, Some(ComputeDevice::Sim { bytes: 64 << 20 }));
        assert_eq!(a.split, vec![ComputeDevice::Sim { bytes: 32 << 20 }]);
        let a = parse(&["--backend".into(), "sim:64".into()]).unwrap();
        assert!(a.split.is_empty());
        assert!(parse(&["--backend".into(), "sim:64&".into()]).is_err());
    }

    #[test]
    fn prediction_takes_eps_or_v() {
        let p = |v: &str| parse(&["--prediction".to_string(), v.to_string()]);
        assert_eq!(p("v").unwrap().prediction, Some(Prediction::V));
        assert_eq!(p("eps").unwrap().prediction, Some(Prediction::Eps));
        let Err(Usage(e)) = p("x0") else {
            panic!("--prediction x0 accepted");
        };
        assert!(e.contains("--prediction") && e.contains("'x0'"), "{e}");
    }

    #[test]
    fn max_vram_takes_gib_and_units() {
        let gib = 1u64 << 30;
        let m = parse_max_vram("4").unwrap();
        assert_eq!(m.default, Some(BudgetSpec::Bytes(4 * gib)));
        let m = parse_max_vram("512M").unwrap();
        assert_eq!(m.default, Some(BudgetSpec::Bytes(512 << 20)));
        let m = parse_max_vram("cuda0=1.5G,sim0=-256M").unwrap();
        assert_eq!(m.for_device("CUDA0"), Some(BudgetSpec::Bytes(3 * gib / 2)));
        assert_eq!(m.for_device("SIM0"), Some(BudgetSpec::FreeMinus(256 << 20)));
        assert_eq!(
            parse_max_vram("0").unwrap().default,
            Some(BudgetSpec::Disabled)
        );
        for bad in ["", "x", "4Q", "nan", "1,2"] {
            assert!(parse_max_vram(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn backend_values() {
        let p = |v: &str| parse(&["--backend".into(), v.into()]).map(|a| a.backend);
        assert_eq!(p("cpu").ok().flatten(), Some(ComputeDevice::Cpu));
        assert_eq!(
            p("sim:64").ok().flatten(),
            Some(ComputeDevice::Sim { bytes: 64 << 20 })
        );
        assert_eq!(
            p("sim:1G").ok().flatten(),
            Some(ComputeDevice::Sim { bytes: 1 << 30 })
        );
        assert!(p("sim:0").is_err());
        assert!(p("sim:lots").is_err());
        assert_eq!(
            p("CUDA0").ok().flatten(),
            Some(ComputeDevice::Named("CUDA0".into()))
        );
    }
}
