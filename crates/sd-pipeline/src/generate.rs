//! Text-to-image generation with an SD1.x / SD2.x checkpoint.
//!
//! This first version executes every model on the CPU through
//! [`sd_models::run::run_cpu`] (the whole graph at once, weights loaded to host memory once);
//! the `sd-exec` engine (device placement, residency, graph cuts) replaces it later.
//!
//! Steps: open the file and detect its configs ([`ModelConfig::detect`]), canonicalize the
//! tensor names, declare CLIP, UNet and the VAE decoder on one [`ParamBuilder`] and load them
//! to the CPU, encode prompt and negative prompt ([`encode_cfg`]), draw the initial noise with
//! [`CpuRng`] and scale it to the first sigma, sample with classifier-free guidance (the UNet
//! runs on the batch `[uncond, cond]`), and decode `latents / scaling_factor` with the VAE.

use std::path::{Path, PathBuf};

use sd_models::clip::ClipTextModel;
use sd_models::run::run_cpu;
use sd_models::unet::UnetModel;
use sd_models::vae::AutoencoderKl;
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, HostData, ModelError, ParamBuilder};
use sd_residency::files::{FileError, ModelLoader};
use sd_tensor::host::{ImageError, PixelRange};
use sd_tensor::{DType, Image, Tensor};
use thiserror::Error;

use crate::conditioning::{encode_cfg, CfgConditioning, ConditioningError};
use crate::model_config::{ModelConfig, ModelConfigError};
use crate::rng::{CpuRng, Rng};
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
}

impl From<ModelError> for GenerateError {
    fn from(e: ModelError) -> Self {
        GenerateError::Model(Box::new(e))
    }
}

/// The loaded models of one checkpoint, ready to run on the CPU.
struct Loaded {
    config: ModelConfig,
    clip: ClipTextModel,
    unet: UnetModel,
    vae: AutoencoderKl,
    // Keeps the parameter tensors' host memory alive.
    _params: sd_models::Params,
    _buffer: sd_tensor::ggml::Buffer,
}

fn load(path: &Path) -> Result<Loaded, GenerateError> {
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
    let pb = ParamBuilder::new(Some(&loader), 4096).map_err(weights)?;
    let clip = ClipTextModel::new(&pb, config.clip.clone()).map_err(weights)?;
    let unet = UnetModel::new(&pb, config.unet.clone()).map_err(weights)?;
    let mut vae_config = config.vae.clone();
    vae_config.with_encoder = false;
    let vae = AutoencoderKl::new(&pb, vae_config).map_err(weights)?;
    let params = pb.finish();
    let buffer = load_all_to_cpu(&params, &loader).map_err(weights)?;
    Ok(Loaded {
        config,
        clip,
        unet,
        vae,
        _params: params,
        _buffer: buffer,
    })
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

/// Generates `params.batch` images from `params.prompt` with the checkpoint at `model_path`.
///
/// `progress(step, total)` is called before each model evaluation with the 1-based sampling
/// step (`total` = `params.steps`; per image of a batch). Runs on the CPU (see the module
/// documentation).
pub fn txt2img(
    model_path: impl AsRef<Path>,
    params: &Txt2Img,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Image>, GenerateError> {
    let path = model_path.as_ref();
    let m = load(path)?;
    check_settings(&m.config, params)?;
    let threads = params.threads.max(1);
    let opts = ComputeOptions::default();

    // Text conditioning.
    let tokenizer = ClipTokenizer::sd1();
    let clip = &m.clip;
    let encoder = |ids: &[i32]| -> Result<Tensor<f32>, ModelError> {
        let mut g = GraphCtx::new(CLIP_GRAPH, CLIP_GRAPH, opts)?;
        let input = g.ctx.new_tensor(DType::I32, &[ids.len(), 1])?;
        let out = clip.forward(&mut g, &input)?;
        let hidden = out.ne()[0];
        let data = run_cpu(
            &g,
            &[&out],
            &[(&input, HostData::I32(ids.to_vec()))],
            CLIP_GRAPH,
            threads,
        )?;
        let data = data.into_iter().next().unwrap_or_default();
        Tensor::new([CHUNK_LEN, hidden], data).map_err(|e| ModelError::Config(e.to_string()))
    };
    let cond = encode_cfg(&tokenizer, &params.prompt, &params.negative, encoder)?;

    let schedule = NoiseSchedule::scaled_linear();
    let sigmas = params.scheduler.sigmas(params.steps, &schedule)?;
    let f = m.config.vae.downsample_factor();
    let (lw, lh) = (params.width / f, params.height / f);
    let channels = m.config.unet.in_channels;

    let mut images = Vec::with_capacity(params.batch);
    for i in 0..params.batch {
        let mut rng = CpuRng::new(params.seed.wrapping_add(i as u64));
        let noise = rng.randn_tensor(&[1, channels, lh, lw])?;
        let x = noise.scale(sigmas[0]);
        let model = CfgUnet {
            unet: &m.unet,
            cond: &cond,
            cfg_scale: params.cfg_scale,
            threads,
            opts,
            sigmas: &sigmas,
            progress: &mut *progress,
        };
        let mut denoiser = KDenoiser::new(model, m.config.prediction, &schedule);
        let latents = sample(
            params.sampler,
            &mut denoiser,
            x,
            &sigmas,
            &mut rng,
            None,
            &schedule,
        )?;
        images.push(decode(&m, &latents, threads, opts)?);
    }
    Ok(images)
}

/// VAE-decodes latents `[1, C, h, w]` (divided by the scaling factor first) to an image.
fn decode(
    m: &Loaded,
    latents: &Tensor<f32>,
    threads: usize,
    opts: ComputeOptions,
) -> Result<Image, GenerateError> {
    let shape = latents.shape().to_vec();
    let z_host = latents.scale(1.0 / m.config.scaling_factor);
    let mut g = GraphCtx::new(VAE_GRAPH, VAE_GRAPH, opts)?;
    let ne: Vec<usize> = shape.iter().rev().copied().collect();
    let z = g
        .ctx
        .new_tensor(DType::F32, &ne)
        .map_err(ModelError::from)?;
    let out = m.vae.decode(&mut g, &z)?;
    let one = out.ne();
    let (w, h, c) = (one[0], one[1], one[2]);
    let data = run_cpu(
        &g,
        &[&out],
        &[(&z, HostData::F32(z_host.into_data()))],
        VAE_GRAPH,
        threads,
    )?;
    let data = data.into_iter().next().unwrap_or_default();
    let t = Tensor::new([1, c, h, w], data).map_err(|e| ModelError::Config(e.to_string()))?;
    Ok(Image::from_tensor(&t, PixelRange::MinusOneToOne)?)
}

/// The UNet with classifier-free guidance: runs on `[uncond, cond]` and returns
/// `uncond + cfg_scale * (cond - uncond)` (the prompt only when `cfg_scale` is 1).
struct CfgUnet<'a, 'p> {
    unet: &'a UnetModel,
    cond: &'a CfgConditioning,
    cfg_scale: f32,
    threads: usize,
    opts: ComputeOptions,
    sigmas: &'a [f32],
    progress: &'a mut (dyn FnMut(usize, usize) + 'p),
}

impl CfgUnet<'_, '_> {
    fn run(&self, x_in: &Tensor<f32>, timestep: f32) -> Result<Vec<f32>, ModelError> {
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
        let mut g = GraphCtx::new(UNET_GRAPH, UNET_GRAPH, self.opts)?;
        let x = g.ctx.new_tensor(DType::F32, &[w, h, c, batch])?;
        let t = g.ctx.new_tensor(DType::F32, &[batch])?;
        let ctx = g.ctx.new_tensor(DType::F32, &[hidden, tokens, batch])?;
        let out = self.unet.forward(&mut g, &x, &t, &ctx)?;
        let mut xs = x_in.data().to_vec();
        if guided {
            xs.extend_from_slice(x_in.data());
        }
        let inputs = [
            (&x, HostData::F32(xs)),
            (&t, HostData::F32(vec![timestep; batch])),
            (&ctx, HostData::F32(context.into_data())),
        ];
        let out = run_cpu(&g, &[&out], &inputs, UNET_GRAPH, self.threads)?;
        Ok(out.into_iter().next().unwrap_or_default())
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
