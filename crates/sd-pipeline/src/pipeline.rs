//! [`Pipeline`]: an SD1.x / SD2.x model (one checkpoint, or component files) loaded into a
//! [`Runtime`]: configuration, text encoder, UNet and VAE. Generation lives in
//! [`crate::generate`].
//!
//! Loading opens the files, brings their tensor names to the canonical layout, detects the
//! configuration ([`ModelConfig::detect`]) and adds the three models to the runtime; it only
//! declares and registers parameters (names, shapes and dtypes checked against the files):
//! the residency manager reads the bytes when a graph first needs them.

use std::path::{Path, PathBuf};

use sd_models::clip::ClipTextModel;
use sd_models::unet::UnetModel;
use sd_models::vae::AutoencoderKl;
use sd_residency::files::ModelLoader;
use sd_residency::names::{CLIP_PREFIX, UNET_PREFIX, VAE_PREFIX};
use sd_residency::{Component, SourceId};

use crate::generate::GenerateError;
use crate::model_config::ModelConfig;
use crate::runtime::{ModelHandle, Runtime, RuntimeError, RuntimeOptions};

/// The files of a model: a full checkpoint (`-m`) and/or component files that replace or
/// supply its parts (stable-diffusion.cpp's `--diffusion-model`, `--vae`, `--clip_l`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelFiles {
    /// A full checkpoint.
    pub model: Option<PathBuf>,
    /// The diffusion model (UNet) alone.
    pub diffusion_model: Option<PathBuf>,
    /// The autoencoder alone.
    pub vae: Option<PathBuf>,
    /// The CLIP-L text encoder alone.
    pub clip_l: Option<PathBuf>,
}

impl ModelFiles {
    /// A single checkpoint.
    pub fn single(path: impl Into<PathBuf>) -> Self {
        ModelFiles {
            model: Some(path.into()),
            ..ModelFiles::default()
        }
    }

    /// The file named in errors that concern the whole model: the checkpoint, else the
    /// diffusion model, else the first component given.
    pub fn primary(&self) -> Option<&Path> {
        [&self.model, &self.diffusion_model, &self.clip_l, &self.vae]
            .into_iter()
            .find_map(|p| p.as_deref())
    }

    /// The component files with their flag and canonical prefix, in loading order.
    fn components(&self) -> Vec<(&'static str, &'static str, &Path)> {
        let mut v = Vec::new();
        for (flag, prefix, p) in [
            ("--diffusion-model", UNET_PREFIX, &self.diffusion_model),
            ("--clip_l", CLIP_PREFIX, &self.clip_l),
            ("--vae", VAE_PREFIX, &self.vae),
        ] {
            if let Some(p) = p {
                v.push((flag, prefix, p.as_path()));
            }
        }
        v
    }

    /// The file that supplies the component under `prefix`.
    fn file_for(&self, prefix: &str) -> Option<&Path> {
        self.components()
            .into_iter()
            .find(|(_, p, _)| *p == prefix)
            .map(|(_, _, f)| f)
            .or(self.model.as_deref())
    }
}

/// How to load a [`Pipeline`].
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// The runtime (devices, residency, budget, weight type).
    pub runtime: RuntimeOptions,
    /// Use the hidden states of this layer from the end (`--clip-skip`; 1: the last; `None`:
    /// the model's default, 1 for SD1 and 2 for SD2).
    pub clip_skip: Option<usize>,
    /// What the UNet predicts (`--prediction`; `None`: the model's configuration, eps
    /// unless the file's sd-rs metadata says otherwise). SD2.x 768-v checkpoints need `v`:
    /// their weights do not tell.
    pub prediction: Option<crate::sampling::Prediction>,
}

/// A loaded model (see the module documentation).
pub struct Pipeline {
    pub(crate) config: ModelConfig,
    pub(crate) path: PathBuf,
    pub(crate) runtime: Runtime,
    pub(crate) clip: (ModelHandle, ClipTextModel),
    pub(crate) unet: (ModelHandle, UnetModel),
    pub(crate) vae: (ModelHandle, AutoencoderKl),
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

/// The runtime handles of a [`Pipeline`]'s models.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineModels {
    /// The text encoder.
    pub text_encoder: ModelHandle,
    /// The UNet.
    pub unet: ModelHandle,
    /// The VAE (encoder, when the files have one, and decoder).
    pub vae: ModelHandle,
}

/// Maps a runtime error of loading or running to the file-naming variants.
pub(crate) fn runtime_err(path: &Path, e: RuntimeError) -> GenerateError {
    match e {
        RuntimeError::Model(source) => GenerateError::Weights {
            path: path.to_path_buf(),
            source: Box::new(source),
        },
        other => GenerateError::Runtime(Box::new(other)),
    }
}

/// Opens `files` into one catalog with canonical names: the checkpoint first, then each
/// component file, which replaces the checkpoint's tensors of that component.
pub(crate) fn open_catalog(files: &ModelFiles) -> Result<ModelLoader, GenerateError> {
    let primary = files.primary().ok_or(GenerateError::InvalidSetting {
        flag: "model",
        message: "no model file given (-m, or --diffusion-model with --vae and --clip_l)".into(),
    })?;
    let weights = |path: &Path| {
        let path = path.to_path_buf();
        move |source| GenerateError::Weights {
            path,
            source: Box::new(source),
        }
    };
    let mut loader = ModelLoader::new();
    if let Some(m) = &files.model {
        loader.add_file(m, None)?;
        sd_models::weights::canonicalize(&mut loader, None).map_err(weights(m))?;
    }
    for (_, prefix, path) in files.components() {
        loader.remove_with_prefix(prefix);
        loader.add_file(path, None)?;
        sd_models::weights::canonicalize(&mut loader, None).map_err(weights(path))?;
        if loader.names_with_prefix(prefix).next().is_none() {
            return Err(GenerateError::Config {
                path: path.to_path_buf(),
                source: crate::model_config::ModelConfigError::Unsupported(format!(
                    "no tensors of this component (`{prefix}*` after name conversion)"
                )),
            });
        }
    }
    for (prefix, what, flag) in [
        (UNET_PREFIX, "diffusion model", "--diffusion-model"),
        (CLIP_PREFIX, "text encoder", "--clip_l"),
        (VAE_PREFIX, "autoencoder", "--vae"),
    ] {
        if loader.names_with_prefix(prefix).next().is_none() {
            return Err(GenerateError::Config {
                path: primary.to_path_buf(),
                source: crate::model_config::ModelConfigError::Unsupported(format!(
                    "the model files have no {what} (`{prefix}*`); give one with {flag}"
                )),
            });
        }
    }
    Ok(loader)
}

impl Pipeline {
    /// Loads the checkpoint at `path` into a runtime built with `options`.
    pub fn load(
        path: impl AsRef<Path>,
        options: RuntimeOptions,
    ) -> Result<Pipeline, GenerateError> {
        Self::open(
            &ModelFiles::single(path.as_ref()),
            LoadOptions {
                runtime: options,
                ..LoadOptions::default()
            },
        )
    }

    /// Loads `files` (see [`ModelFiles`]) with `options`: detects the configuration and
    /// adds the text encoder, the UNet and the VAE (its encoder too when the files have one)
    /// to a new runtime.
    pub fn open(files: &ModelFiles, options: LoadOptions) -> Result<Pipeline, GenerateError> {
        let loader = open_catalog(files)?;
        let primary = files.primary().unwrap_or(Path::new("")).to_path_buf();
        let _span = tracing::info_span!("load_pipeline", path = %primary.display()).entered();
        let mut config = ModelConfig::detect(&loader).map_err(|source| GenerateError::Config {
            path: primary.clone(),
            source,
        })?;
        if let Some(skip) = options.clip_skip {
            if skip == 0 || skip > config.clip.num_hidden_layers {
                return Err(GenerateError::InvalidSetting {
                    flag: "clip-skip",
                    message: format!(
                        "{skip} is not between 1 and the text encoder's {} layers",
                        config.clip.num_hidden_layers
                    ),
                });
            }
            config.clip.clip_skip = skip;
        }
        if let Some(p) = options.prediction {
            config.prediction = p;
        }
        let mut runtime =
            Runtime::new(options.runtime, loader).map_err(|e| runtime_err(&primary, e))?;
        let main = SourceId::MAIN;
        let file_of = |prefix: &str| files.file_for(prefix).unwrap_or(&primary).to_path_buf();
        let clip_cfg = config.clip.clone();
        let clip = runtime
            .add_model("text_encoder", Component::TextEncoder, main, |pb| {
                ClipTextModel::new(pb, clip_cfg)
            })
            .map_err(|e| runtime_err(&file_of(CLIP_PREFIX), e))?;
        let unet_cfg = config.unet.clone();
        let unet = runtime
            .add_model("unet", Component::Diffusion, main, |pb| {
                UnetModel::new(pb, unet_cfg)
            })
            .map_err(|e| runtime_err(&file_of(UNET_PREFIX), e))?;
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
            .map_err(|e| runtime_err(&file_of(VAE_PREFIX), e))?;
        Ok(Pipeline {
            config,
            path: primary,
            runtime,
            clip,
            unet,
            vae,
        })
    }

    /// Loads the weights of every model now where they would stay in RAM anyway (see
    /// [`Runtime::preload`]); `progress(done, total)` counts parameters over all models.
    pub fn preload(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<(), GenerateError> {
        let models = [self.clip.0, self.unet.0, self.vae.0];
        let total: usize = models
            .iter()
            .map(|h| self.runtime.param_ids(*h).map_or(0, <[_]>::len))
            .sum();
        let mut base = 0;
        for h in models {
            let n = self.runtime.param_ids(h).map_or(0, <[_]>::len);
            self.runtime
                .preload(h, &mut |d, _| progress(base + d, total))
                .map_err(|e| runtime_err(&self.path, e))?;
            base += n;
        }
        Ok(())
    }

    /// The detected configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Whether the VAE encoder was loaded (img2img needs it).
    pub fn has_vae_encoder(&self) -> bool {
        self.vae.1.encoder.is_some()
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
