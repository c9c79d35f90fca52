//! Text-to-image generation with an SD1.x / SD2.x checkpoint.
//!
//! Every model runs through the memory-budgeted execution engine of a [`Runtime`]
//! (see [`crate::runtime`]): a [`Pipeline`] holds the runtime and the checkpoint's models.
//!
//! Steps: open the file and detect its configs ([`ModelConfig::detect`]), canonicalize the
//! tensor names, add CLIP, UNet and the VAE to the runtime (their weights are read when first
//! needed), encode prompt and negative prompt ([`encode_cfg`]), draw the initial noise with
//! [`CpuRng`] and scale it to the first sigma, sample with classifier-free guidance (the UNet
//! runs on the batch `[uncond, cond]`), and decode `latents / scaling_factor` with the VAE.

use std::path::{Path, PathBuf};

use sd_models::unet::UnetModel;
use sd_models::{HostData, ModelError};
use sd_residency::files::{FileError, ModelLoader};
use sd_tensor::host::{ImageError, PixelRange};
use sd_tensor::{DType, Image, Tensor};
use thiserror::Error;

use crate::conditioning::{encode_cfg, CfgConditioning, ConditioningError};
use crate::model_config::{ModelConfig, ModelConfigError};
use crate::pipeline::runtime_err;
pub use crate::pipeline::{LoadOptions, ModelFiles, Pipeline, PipelineModels};
use crate::rng::RngKind;
use crate::runtime::{BuiltGraph, ModelHandle, Runtime, RuntimeError, RuntimeOptions};
use crate::sampling::{sample, Denoise, KDenoiser, SampleMethod, SamplingError};
use crate::schedule::{NoiseSchedule, Scheduler};
use crate::tokenizer::{ClipTokenizer, CHUNK_LEN};
use crate::vae_tiling::{decode_tiled, encode_tiled, VaeTiling};

/// Descriptor and node capacity of one UNet graph.
const UNET_GRAPH: usize = 16384;
/// Descriptor and node capacity of one CLIP graph.
const CLIP_GRAPH: usize = 4096;
/// Descriptor and node capacity of one VAE decoder graph.
const VAE_GRAPH: usize = 8192;

/// The settings of a txt2img run (stable-diffusion.cpp's flags of the same names).
#[derive(Clone, Debug, PartialEq)]
pub struct Txt2Img {
    /// The prompt (attention syntax `(word:1.2)` allowed).
    pub prompt: String,
    /// The negative prompt (empty: the unconditional embedding).
    pub negative: String,
    /// Image width in pixels.
    pub width: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Sampling steps.
    pub steps: usize,
    /// Classifier-free guidance scale (1: no guidance, the UNet runs on the prompt only).
    pub cfg_scale: f32,
    /// Seed of the first image; image `i` of a batch uses `seed + i`.
    pub seed: u64,
    /// The sampler.
    pub sampler: SampleMethod,
    /// The sigma scheduler.
    pub scheduler: Scheduler,
    /// CPU threads.
    pub threads: usize,
    /// Number of images.
    pub batch: usize,
    /// The noise generator (`--rng`; stable-diffusion.cpp defaults to `cuda`, sd-rs to `cpu`,
    /// torch's CPU generator).
    pub rng: RngKind,
    /// Decode the latents in tiles (`--vae-tiling`; `None`: whole).
    pub vae_tiling: Option<VaeTiling>,
}

impl Default for Txt2Img {
    fn default() -> Self {
        Txt2Img {
            prompt: String::new(),
            negative: String::new(),
            width: 512,
            height: 512,
            steps: 20,
            cfg_scale: 7.0,
            seed: 42,
            sampler: SampleMethod::Euler,
            scheduler: Scheduler::Discrete,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            batch: 1,
            rng: RngKind::Cpu,
            vae_tiling: None,
        }
    }
}

/// An error of [`txt2img`].
#[derive(Debug, Error)]
pub enum GenerateError {
    /// The model file cannot be opened or parsed (the message names it).
    #[error(transparent)]
    File(#[from] FileError),
    /// The model file's configuration is invalid or unsupported.
    #[error("{}: {source}", path.display())]
    Config {
        /// The model file.
        path: PathBuf,
        /// The problem.
        #[source]
        source: ModelConfigError,
    },
    /// The model file's tensors do not fit the detected configuration.
    #[error("{}: {source}", path.display())]
    Weights {
        /// The model file.
        path: PathBuf,
        /// The problem.
        #[source]
        source: Box<ModelError>,
    },
    /// A setting is out of range; `flag` names it.
    #[error("{flag}: {message}")]
    InvalidSetting {
        /// The setting (`width`, `height`, `steps`, ...).
        flag: &'static str,
        /// What is wrong.
        message: String,
    },
    /// Running a model failed.
    #[error("model evaluation failed: {0}")]
    Model(#[source] Box<ModelError>),
    /// Text conditioning failed.
    #[error(transparent)]
    Conditioning(#[from] ConditioningError),
    /// Sampling failed.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The decoded image is invalid.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The runtime failed (backend, residency, execution).
    #[error(transparent)]
    Runtime(Box<RuntimeError>),
    /// A host tensor had an unexpected shape.
    #[error(transparent)]
    Shape(#[from] sd_tensor::host::ShapeError),
    /// The VAE decoder returned NaN or infinite values (no image is made of them).
    #[error("the VAE decoder returned {count} NaN or infinite values (corrupt VAE weights?)")]
    NonFiniteDecode {
        /// How many values are not finite.
        count: usize,
    },
}

/// How many values of `data` are NaN or infinite.
fn non_finite(data: &[f32]) -> usize {
    data.iter().filter(|v| !v.is_finite()).count()
}

impl From<ModelError> for GenerateError {
    fn from(e: ModelError) -> Self {
        GenerateError::Model(Box::new(e))
    }
}

fn check_settings(cfg: &ModelConfig, p: &Txt2Img) -> Result<(), GenerateError> {
    let multiple = cfg.size_multiple();
    for (flag, v) in [("width", p.width), ("height", p.height)] {
        if v == 0 || v % multiple != 0 {
            return Err(GenerateError::InvalidSetting {
                flag,
                message: format!(
                    "{v} is not a positive multiple of {multiple} (the VAE factor {} x 2^{} UNet downsamplings)",
                    cfg.vae.downsample_factor(),
                    cfg.unet.channel_mult.len().saturating_sub(1)
                ),
            });
        }
    }
    if p.steps == 0 {
        return Err(GenerateError::InvalidSetting {
            flag: "steps",
            message: "must be at least 1".into(),
        });
    }
    if !p.cfg_scale.is_finite() {
        return Err(GenerateError::InvalidSetting {
            flag: "cfg-scale",
            message: format!("{} is not a finite number", p.cfg_scale),
        });
    }
    if p.batch == 0 {
        return Err(GenerateError::InvalidSetting {
            flag: "batch-count",
            message: "must be at least 1".into(),
        });
    }
    Ok(())
}

/// Reads the detected configuration of a model file without loading its weights.
pub fn model_config(path: impl AsRef<Path>) -> Result<ModelConfig, GenerateError> {
    let path = path.as_ref();
    let mut loader = ModelLoader::new();
    loader.add_file(path, None)?;
    ModelConfig::detect(&loader).map_err(|source| GenerateError::Config {
        path: path.to_path_buf(),
        source,
    })
}

/// Generates `params.batch` images from `params.prompt` with the checkpoint at `model_path`,
/// computing on the CPU with `params.threads` threads (see [`Pipeline`] for other devices
/// and budgets).
///
/// `progress(step, total)` is called before each model evaluation with the 1-based sampling
/// step (`total` = `params.steps`; per image of a batch).
pub fn txt2img(
    model_path: impl AsRef<Path>,
    params: &Txt2Img,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Image>, GenerateError> {
    let options = RuntimeOptions {
        threads: params.threads.max(1),
        ..RuntimeOptions::default()
    };
    Pipeline::load(model_path, options)?.txt2img(params, progress)
}

/// The sigmas an img2img run samples: the last `floor(steps * strength)` steps of the
/// schedule (stable-diffusion.cpp's `t_enc`), that is the final `t_enc + 1` sigmas.
pub fn img2img_sigmas(sigmas: &[f32], strength: f32) -> &[f32] {
    let steps = sigmas.len().saturating_sub(1);
    let t_enc = ((steps as f32 * strength.clamp(0.0, 1.0)) as usize).min(steps);
    &sigmas[steps - t_enc..]
}

impl Pipeline {
    fn model_err(&self, e: RuntimeError) -> GenerateError {
        runtime_err(&self.path, e)
    }

    /// Encodes prompt and negative prompt with the text encoder.
    fn condition(&mut self, params: &Txt2Img) -> Result<CfgConditioning, GenerateError> {
        let tokenizer = ClipTokenizer::sd1();
        let (h, clip) = (self.clip.0, &self.clip.1);
        let runtime = &mut self.runtime;
        let encoder = |ids: &[i32]| -> Result<Tensor<f32>, ModelError> {
            let out = runtime
                .run(h, "text encoder", CLIP_GRAPH, |g| {
                    let input = g.ctx.new_tensor(DType::I32, &[ids.len(), 1])?;
                    let output = clip.forward(g, &input)?;
                    Ok(BuiltGraph {
                        output,
                        inputs: vec![(input, HostData::I32(ids.to_vec()))],
                    })
                })
                .map_err(runtime_to_model)?;
            let hidden = out.ne[0];
            Tensor::new([CHUNK_LEN, hidden], out.data)
                .map_err(|e| ModelError::Config(e.to_string()))
        };
        let cond = encode_cfg(&tokenizer, &params.prompt, &params.negative, encoder)?;
        self.runtime
            .release(self.clip.0)
            .map_err(|e| self.model_err(e))?;
        Ok(cond)
    }

    /// Generates `params.batch` images from `params.prompt` (see [`txt2img`]).
    pub fn txt2img(
        &mut self,
        params: &Txt2Img,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<Image>, GenerateError> {
        self.generate(params, None, progress)
    }

    /// Generates `params.batch` images from `init` and `params.prompt`: the init image is
    /// VAE-encoded (the latent distribution's mean), noised to the sigma where the last
    /// `floor(steps * strength)` steps start ([`img2img_sigmas`]) and denoised over those
    /// steps. Strength 0 returns the init image through a VAE round trip; 1 ignores it but
    /// for the noise level. `init` must be `params.width` x `params.height`.
    pub fn img2img(
        &mut self,
        params: &Txt2Img,
        init: &Image,
        strength: f32,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<Image>, GenerateError> {
        if !(0.0..=1.0).contains(&strength) {
            return Err(GenerateError::InvalidSetting {
                flag: "strength",
                message: format!("{strength} is not between 0 and 1"),
            });
        }
        if (init.width(), init.height()) != (params.width, params.height) {
            return Err(GenerateError::InvalidSetting {
                flag: "init-img",
                message: format!(
                    "the init image is {}x{} but the output is {}x{}",
                    init.width(),
                    init.height(),
                    params.width,
                    params.height
                ),
            });
        }
        self.generate(params, Some((init, strength)), progress)
    }

    fn generate(
        &mut self,
        params: &Txt2Img,
        init: Option<(&Image, f32)>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<Image>, GenerateError> {
        let _span = tracing::info_span!("generate", steps = params.steps, img2img = init.is_some())
            .entered();
        check_settings(&self.config, params)?;
        let init_latents = match init {
            Some((image, _)) => Some(self.encode(image, params.vae_tiling)?),
            None => None,
        };
        let cond = self.condition(params)?;

        let schedule = NoiseSchedule::scaled_linear();
        let all_sigmas = params.scheduler.sigmas(params.steps, &schedule)?;
        let sigmas = match init {
            Some((_, strength)) => img2img_sigmas(&all_sigmas, strength).to_vec(),
            None => all_sigmas,
        };
        let f = self.config.vae.downsample_factor();
        let (lw, lh) = (params.width / f, params.height / f);
        let channels = self.config.unet.in_channels;

        let mut images = Vec::with_capacity(params.batch);
        for i in 0..params.batch {
            let mut rng = params.rng.create(params.seed.wrapping_add(i as u64));
            let noise = rng.randn_tensor(&[1, channels, lh, lw])?;
            let mut x = noise.scale(sigmas[0]);
            if let Some(init) = &init_latents {
                for (v, z) in x.data_mut().iter_mut().zip(init.data()) {
                    *v += z;
                }
            }
            let latents = if sigmas.len() < 2 {
                x
            } else {
                let model = CfgUnet {
                    runtime: &mut self.runtime,
                    handle: self.unet.0,
                    unet: &self.unet.1,
                    cond: &cond,
                    cfg_scale: params.cfg_scale,
                    sigmas: &sigmas,
                    progress: &mut *progress,
                };
                let mut denoiser = KDenoiser::new(model, self.config.prediction, &schedule);
                sample(
                    params.sampler,
                    &mut denoiser,
                    x,
                    &sigmas,
                    rng.as_mut(),
                    None,
                    &schedule,
                )?
            };
            images.push(self.decode(&latents, params.vae_tiling)?);
        }
        self.runtime
            .release(self.unet.0)
            .and_then(|_| self.runtime.release(self.vae.0))
            .map_err(|e| self.model_err(e))?;
        Ok(images)
    }

    /// VAE-encodes an image to latents `[1, C, h, w]`: the mean of the latent distribution
    /// times the scaling factor; whole or in tiles.
    pub fn encode(
        &mut self,
        image: &Image,
        tiling: Option<VaeTiling>,
    ) -> Result<Tensor<f32>, GenerateError> {
        if self.vae.1.encoder.is_none() {
            return Err(GenerateError::Config {
                path: self.path.clone(),
                source: crate::model_config::ModelConfigError::Unsupported(
                    "the autoencoder has no encoder (img2img needs one; give a full VAE with --vae)"
                        .into(),
                ),
            });
        }
        let x = image.to_rgb().to_tensor(PixelRange::MinusOneToOne);
        let f = self.config.vae.downsample_factor();
        let moments = match tiling {
            Some(tiling) => encode_tiled(&x, tiling, f, |tile| self.encode_raw(tile))?,
            None => self.encode_raw(&x)?,
        };
        let z = moments.shape()[1] / 2;
        Ok(moments.slice(1, 0, z)?.scale(self.config.scaling_factor))
    }

    /// Runs the VAE encoder on `x` `[1, 3, H, W]` in [-1, 1]; returns the moments.
    fn encode_raw(&mut self, x: &Tensor<f32>) -> Result<Tensor<f32>, GenerateError> {
        let ne: Vec<usize> = x.shape().iter().rev().copied().collect();
        let data = x.data().to_vec();
        let (h, vae) = (self.vae.0, &self.vae.1);
        let out = self
            .runtime
            .run(h, "vae encode", VAE_GRAPH, |g| {
                let t = g.ctx.new_tensor(DType::F32, &ne)?;
                let output = vae.encode(g, &t)?;
                Ok(BuiltGraph {
                    output,
                    inputs: vec![(t, HostData::F32(data))],
                })
            })
            .map_err(|e| runtime_err(&self.path, e))?;
        let [_, c2, lh, lw] = out.shape();
        Ok(Tensor::new([1, c2, lh, lw], out.data)?)
    }

    /// VAE-decodes latents `[1, C, h, w]` (divided by the scaling factor first) to an image,
    /// whole or in tiles.
    pub fn decode(
        &mut self,
        latents: &Tensor<f32>,
        tiling: Option<VaeTiling>,
    ) -> Result<Image, GenerateError> {
        let z = latents.scale(1.0 / self.config.scaling_factor);
        let t = match tiling {
            Some(tiling) => decode_tiled(&z, tiling, |tile| self.decode_raw(tile))?,
            None => self.decode_raw(&z)?,
        };
        Ok(Image::from_tensor(&t, PixelRange::MinusOneToOne)?)
    }

    /// Runs the VAE decoder on `z` `[1, C, h, w]`; returns `[1, c, H, W]` in about [-1, 1].
    fn decode_raw(&mut self, z: &Tensor<f32>) -> Result<Tensor<f32>, GenerateError> {
        let ne: Vec<usize> = z.shape().iter().rev().copied().collect();
        let data = z.data().to_vec();
        let (h, vae) = (self.vae.0, &self.vae.1);
        let out = self
            .runtime
            .run(h, "vae decode", VAE_GRAPH, |g| {
                let z = g.ctx.new_tensor(DType::F32, &ne)?;
                let output = vae.decode(g, &z)?;
                Ok(BuiltGraph {
                    output,
                    inputs: vec![(z, HostData::F32(data))],
                })
            })
            .map_err(|e| runtime_err(&self.path, e))?;
        let count = non_finite(&out.data);
        if count > 0 {
            return Err(GenerateError::NonFiniteDecode { count });
        }
        let [_, c, h, w] = out.shape();
        Ok(Tensor::new([1, c, h, w], out.data)?)
    }
}

/// A runtime error inside a model callback (conditioning, sampling) as a [`ModelError`].
fn runtime_to_model(e: RuntimeError) -> ModelError {
    match e {
        RuntimeError::Model(m) => m,
        other => ModelError::Config(other.to_string()),
    }
}

/// The UNet with classifier-free guidance: runs on `[uncond, cond]` and returns
/// `uncond + cfg_scale * (cond - uncond)` (the prompt only when `cfg_scale` is 1).
struct CfgUnet<'a, 'p> {
    runtime: &'a mut Runtime,
    handle: ModelHandle,
    unet: &'a UnetModel,
    cond: &'a CfgConditioning,
    cfg_scale: f32,
    sigmas: &'a [f32],
    progress: &'a mut (dyn FnMut(usize, usize) + 'p),
}

impl CfgUnet<'_, '_> {
    fn run(&mut self, x_in: &Tensor<f32>, timestep: f32) -> Result<Vec<f32>, RuntimeError> {
        let guided = self.cfg_scale != 1.0;
        let batch = if guided { 2 } else { 1 };
        let shape = x_in.shape();
        let (c, h, w) = (shape[1], shape[2], shape[3]);
        let context = if guided {
            self.cond
                .stacked()
                .map_err(|e| ModelError::Config(e.to_string()))?
        } else {
            self.cond.cond.clone()
        };
        let (tokens, hidden) = {
            let s = context.shape();
            (s[s.len() - 2], s[s.len() - 1])
        };
        let mut xs = x_in.data().to_vec();
        if guided {
            xs.extend_from_slice(x_in.data());
        }
        let unet = self.unet;
        let out = self.runtime.run(self.handle, "unet", UNET_GRAPH, |g| {
            let x = g.ctx.new_tensor(DType::F32, &[w, h, c, batch])?;
            let t = g.ctx.new_tensor(DType::F32, &[batch])?;
            let ctx = g.ctx.new_tensor(DType::F32, &[hidden, tokens, batch])?;
            let output = unet.forward(g, &x, &t, &ctx)?;
            Ok(BuiltGraph {
                output,
                inputs: vec![
                    (x, HostData::F32(xs)),
                    (t, HostData::F32(vec![timestep; batch])),
                    (ctx, HostData::F32(context.into_data())),
                ],
            })
        })?;
        Ok(out.data)
    }
}
impl Denoise for CfgUnet<'_, '_> {
    fn predict(
        &mut self,
        x_in: &Tensor<f32>,
        sigma: f32,
        timestep: f32,
    ) -> Result<Tensor<f32>, SamplingError> {
        let total = self.sigmas.len().saturating_sub(1);
        let step = self
            .sigmas
            .iter()
            .take(total)
            .position(|&s| s <= sigma * (1.0 + 1e-6))
            .map_or(total, |i| i + 1);
        (self.progress)(step, total);
        let out = self
            .run(x_in, timestep)
            .map_err(|e| SamplingError::Model(Box::new(e)))?;
        let n = x_in.data().len();
        let data = if self.cfg_scale != 1.0 {
            if out.len() != 2 * n {
                return Err(SamplingError::ModelShape {
                    expected: x_in.shape().to_vec(),
                    got: vec![out.len()],
                });
            }
            let (uncond, cond) = out.split_at(n);
            uncond
                .iter()
                .zip(cond)
                .map(|(&u, &c)| u + self.cfg_scale * (c - u))
                .collect()
        } else {
            out
        };
        let count = non_finite(&data);
        if count > 0 {
            return Err(SamplingError::NonFinite {
                model: "UNet",
                step,
                total,
                count,
            });
        }
        Ok(Tensor::new(x_in.shape().to_vec(), data)?)
    }
}
