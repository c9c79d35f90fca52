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

use sd_models::clip::ClipTextModel;
use sd_models::unet::UnetModel;
use sd_models::vae::AutoencoderKl;
use sd_models::{HostData, ModelError};
use sd_residency::files::{FileError, ModelLoader};
use sd_residency::{Component, SourceId};
use sd_tensor::host::{ImageError, PixelRange};
use sd_tensor::{DType, Image, Tensor};
use thiserror::Error;

use crate::conditioning::{encode_cfg, CfgConditioning, ConditioningError};
use crate::model_config::{ModelConfig, ModelConfigError};
use crate::rng::{CpuRng, Rng};
use crate::runtime::{BuiltGraph, ModelHandle, Runtime, RuntimeError, RuntimeOptions};
use crate::sampling::{sample, Denoise, KDenoiser, SampleMethod, SamplingError};
use crate::schedule::{NoiseSchedule, Scheduler};
use crate::tokenizer::{ClipTokenizer, CHUNK_LEN};

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
}

impl From<ModelError> for GenerateError {
    fn from(e: ModelError) -> Self {
        GenerateError::Model(Box::new(e))
    }
}

/// A loaded checkpoint: its configuration and its models, added to a [`Runtime`].
///
/// Loading only declares and registers the parameters; the residency manager reads them
/// from the files when a graph first needs them.
pub struct Pipeline {
    config: ModelConfig,
    path: PathBuf,
    runtime: Runtime,
    clip: (ModelHandle, ClipTextModel),
    unet: (ModelHandle, UnetModel),
    vae: (ModelHandle, AutoencoderKl),
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("path", &self.path)
            .field("version", &self.config.version)
            .field("runtime", &self.runtime)
            .finish()
    }
}

impl Pipeline {
    /// Opens the checkpoint at `path`, detects its configuration, canonicalizes its tensor
    /// names and adds its text encoder, UNet and VAE (the encoder too when the file has
    /// one) to a runtime built with `options`.
    pub fn load(
        path: impl AsRef<Path>,
        options: RuntimeOptions,
    ) -> Result<Pipeline, GenerateError> {
        let path = path.as_ref();
        let _span = tracing::info_span!("load_pipeline", path = %path.display()).entered();
        let mut loader = ModelLoader::new();
        loader.add_file(path, None)?;
        let config = ModelConfig::detect(&loader).map_err(|source| GenerateError::Config {
            path: path.to_path_buf(),
            source,
        })?;
        let weights = |source| GenerateError::Weights {
            path: path.to_path_buf(),
            source: Box::new(source),
        };
        sd_models::weights::canonicalize(&mut loader, Some(config.version)).map_err(weights)?;
        let mut runtime = Runtime::new(options, loader).map_err(|e| runtime_err(path, e))?;
        let main = SourceId::MAIN;
        let clip_cfg = config.clip.clone();
        let clip = runtime
            .add_model("text_encoder", Component::TextEncoder, main, |pb| {
                ClipTextModel::new(pb, clip_cfg)
            })
            .map_err(|e| runtime_err(path, e))?;
        let unet_cfg = config.unet.clone();
        let unet = runtime
            .add_model("unet", Component::Diffusion, main, |pb| {
                UnetModel::new(pb, unet_cfg)
            })
            .map_err(|e| runtime_err(path, e))?;
        let mut vae_cfg = config.vae.clone();
        vae_cfg.with_encoder = {
            let encoder = format!("{}.encoder.conv_in.weight", vae_cfg.prefix);
            runtime
                .catalog(main)
                .is_some_and(|c| c.get(&encoder).is_some())
        };
        let vae = runtime
            .add_model("vae", Component::Vae, main, |pb| {
                AutoencoderKl::new(pb, vae_cfg)
            })
            .map_err(|e| runtime_err(path, e))?;
        Ok(Pipeline {
            config,
            path: path.to_path_buf(),
            runtime,
            clip,
            unet,
            vae,
        })
    }

    /// The detected configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The runtime handles of the text encoder, the UNet and the VAE.
    pub fn handles(&self) -> PipelineModels {
        PipelineModels {
            text_encoder: self.clip.0,
            unet: self.unet.0,
            vae: self.vae.0,
        }
    }

    /// The runtime the models run in.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// The runtime, mutably.
    pub fn runtime_mut(&mut self) -> &mut Runtime {
        &mut self.runtime
    }
}

/// The runtime handles of a [`Pipeline`]'s models.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineModels {
    /// The text encoder.
    pub text_encoder: ModelHandle,
    /// The UNet.
    pub unet: ModelHandle,
    /// The VAE (encoder, when the file has one, and decoder).
    pub vae: ModelHandle,
}

/// Maps a runtime error of loading to the file-naming variants.
fn runtime_err(path: &Path, e: RuntimeError) -> GenerateError {
    match e {
        RuntimeError::Model(source) => GenerateError::Weights {
            path: path.to_path_buf(),
            source: Box::new(source),
        },
        other => GenerateError::Runtime(Box::new(other)),
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
        let _span = tracing::info_span!("txt2img", steps = params.steps).entered();
        check_settings(&self.config, params)?;
        let cond = self.condition(params)?;

        let schedule = NoiseSchedule::scaled_linear();
        let sigmas = params.scheduler.sigmas(params.steps, &schedule)?;
        let f = self.config.vae.downsample_factor();
        let (lw, lh) = (params.width / f, params.height / f);
        let channels = self.config.unet.in_channels;

        let mut images = Vec::with_capacity(params.batch);
        for i in 0..params.batch {
            let mut rng = CpuRng::new(params.seed.wrapping_add(i as u64));
            let noise = rng.randn_tensor(&[1, channels, lh, lw])?;
            let x = noise.scale(sigmas[0]);
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
            let latents = sample(
                params.sampler,
                &mut denoiser,
                x,
                &sigmas,
                &mut rng,
                None,
                &schedule,
            )?;
            images.push(self.decode(&latents)?);
        }
        self.runtime
            .release(self.unet.0)
            .and_then(|_| self.runtime.release(self.vae.0))
            .map_err(|e| self.model_err(e))?;
        Ok(images)
    }

    /// VAE-decodes latents `[1, C, h, w]` (divided by the scaling factor first) to an image.
    pub fn decode(&mut self, latents: &Tensor<f32>) -> Result<Image, GenerateError> {
        let shape = latents.shape().to_vec();
        let z_host = latents.scale(1.0 / self.config.scaling_factor);
        let ne: Vec<usize> = shape.iter().rev().copied().collect();
        let (h, vae) = (self.vae.0, &self.vae.1);
        let out = self
            .runtime
            .run(h, "vae decode", VAE_GRAPH, |g| {
                let z = g.ctx.new_tensor(DType::F32, &ne)?;
                let output = vae.decode(g, &z)?;
                Ok(BuiltGraph {
                    output,
                    inputs: vec![(z, HostData::F32(z_host.into_data()))],
                })
            })
            .map_err(|e| runtime_err(&self.path, e))?;
        let [_, c, h, w] = out.shape();
        let t =
            Tensor::new([1, c, h, w], out.data).map_err(|e| ModelError::Config(e.to_string()))?;
        Ok(Image::from_tensor(&t, PixelRange::MinusOneToOne)?)
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
        Ok(Tensor::new(x_in.shape().to_vec(), data)?)
    }
}
