//! [`Pipeline`]: a model of any [`crate::family`] (one checkpoint, or component files)
//! loaded into a [`Runtime`]: its [`ModelSpec`], text encoders, diffusion network and first
//! stage. Generation lives in [`crate::generate`].
//!
//! Loading opens the files, brings their tensor names to the canonical layout, detects the
//! family and configuration ([`crate::family::detect`]) and adds the networks to the
//! runtime; it only declares and registers parameters (names, shapes and dtypes checked
//! against the files): the residency manager reads the bytes when a graph first needs them.

use std::path::{Path, PathBuf};

use sd_formats::files::TensorCatalog;
use sd_formats::names::{detect_text_encoder, TextEncoderKind};
use sd_models::diffusion::DiffusionNet;
use sd_models::first_stage::FirstStage;
use sd_models::text_encoder::{TextEncoder, TextEncoderArch};
use sd_residency::{Component, SourceId};

use crate::error::GenerateError;
use crate::family::{all_slots, slot_by_name, ModelConfigError, ModelSpec, Slot, SlotKind};
use crate::runtime::{ModelHandle, Runtime, RuntimeError, RuntimeOptions};

/// The files of a model: a full checkpoint (`-m`) and/or component files that replace or
/// supply its parts, each for a [`Slot`] named as the family files name them (`clip_l`,
/// `vae`, `diffusion-model`: the CLI flag without its dashes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelFiles {
    /// A full checkpoint: one file, or a diffusers pipeline folder.
    pub model: Option<PathBuf>,
    /// Component files: `(slot name, path)`, in loading order.
    pub components: Vec<(String, PathBuf)>,
}

impl ModelFiles {
    /// A single checkpoint.
    pub fn single(path: impl Into<PathBuf>) -> Self {
        ModelFiles {
            model: Some(path.into()),
            components: Vec::new(),
        }
    }

    /// Adds a component file for the slot named `slot`.
    pub fn with(mut self, slot: &str, path: impl Into<PathBuf>) -> Self {
        self.components.push((slot.to_string(), path.into()));
        self
    }

    /// The file given for the slot named `slot`.
    pub fn component(&self, slot: &str) -> Option<&Path> {
        self.components
            .iter()
            .rev()
            .find(|(s, _)| s == slot)
            .map(|(_, p)| p.as_path())
    }

    /// The file named in errors that concern the whole model: the checkpoint, else the
    /// diffusion model, else the first component given.
    pub fn primary(&self) -> Option<&Path> {
        self.model
            .as_deref()
            .or_else(|| {
                self.components
                    .iter()
                    .find(|(s, _)| slot_by_name(s).is_some_and(|s| s.kind == SlotKind::Diffusion))
                    .map(|(_, p)| p.as_path())
            })
            .or_else(|| self.components.first().map(|(_, p)| p.as_path()))
    }

    /// The file that supplies `slot`: its component file, else the checkpoint.
    fn file_for(&self, slot: &Slot) -> Option<&Path> {
        self.component(slot.name).or(self.model.as_deref())
    }
}

/// How to load a [`Pipeline`].
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// The runtime (devices, residency, budget, weight type).
    pub runtime: RuntimeOptions,
    /// Use the hidden states of this layer from the end (`--clip-skip`; 1: the last; `None`:
    /// the family's default, 1 for SD1 and 2 for SD2), for every CLIP text encoder.
    pub clip_skip: Option<usize>,
    /// What the diffusion network predicts (`--prediction`; `None`: the model's
    /// configuration). SD2.x 768-v checkpoints need `v`: their weights do not tell.
    pub prediction: Option<crate::sampling::Prediction>,
}

/// A loaded model (see the module documentation).
pub struct Pipeline {
    pub(crate) spec: ModelSpec,
    pub(crate) path: PathBuf,
    pub(crate) runtime: Runtime,
    pub(crate) text: Vec<(ModelHandle, TextEncoder)>,
    pub(crate) diffusion: (ModelHandle, DiffusionNet),
    pub(crate) first_stage: (ModelHandle, FirstStage),
    /// A second model that takes over sampling part-way ([`Pipeline::add_refiner`]).
    pub(crate) refiner: Option<crate::refiner::Refiner>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("path", &self.path)
            .field("family", &self.spec.family.id())
            .field("runtime", &self.runtime)
            .finish()
    }
}

/// The runtime handles of a [`Pipeline`]'s models.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineModels {
    /// The first text encoder (the diffusion network's handle for a family without one).
    pub text_encoder: ModelHandle,
    /// Every text encoder, in the spec's order.
    pub text_encoders: Vec<ModelHandle>,
    /// The diffusion network (a UNet for SD1/SD2).
    pub unet: ModelHandle,
    /// The first stage (encoder, when the files have one, and decoder).
    pub vae: ModelHandle,
}

impl PipelineModels {
    /// Every handle: text encoders, diffusion network, first stage.
    pub fn all(&self) -> Vec<ModelHandle> {
        let mut v = self.text_encoders.clone();
        v.push(self.unet);
        v.push(self.vae);
        v
    }
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

fn unsupported(path: &Path, message: String) -> GenerateError {
    GenerateError::Config {
        path: path.to_path_buf(),
        source: ModelConfigError::Unsupported(message),
    }
}

/// Opens `files` into one catalog with canonical names: the checkpoint first, then each
/// component file, which replaces the checkpoint's tensors of its slot.
pub(crate) fn open_catalog(files: &ModelFiles) -> Result<TensorCatalog, GenerateError> {
    files.primary().ok_or(GenerateError::InvalidSetting {
        flag: "model",
        message: "no model file given (-m, or --diffusion-model with the other components)".into(),
    })?;
    let weights = |path: &Path| {
        let path = path.to_path_buf();
        move |source| GenerateError::Weights {
            path,
            source: Box::new(source),
        }
    };
    let mut loader = TensorCatalog::new();
    if let Some(m) = &files.model {
        if m.is_dir() {
            loader.add_diffusers_folder(m)?;
        } else {
            loader.add_file(m, None)?;
        }
        sd_models::weights::canonicalize(&mut loader, None).map_err(weights(m))?;
    }
    for (name, path) in &files.components {
        let slot = slot_by_name(name).ok_or_else(|| GenerateError::InvalidSetting {
            flag: "model",
            message: format!("no model family has a component slot named {name:?}"),
        })?;
        loader.remove_with_prefix(slot.prefix);
        let id = loader.add_file(path, None)?;
        check_text_encoder_kind(&slot, path, loader.names_in_file(id))?;
        sd_models::weights::canonicalize(&mut loader, None).map_err(weights(path))?;
        if prefix_bare_file(&mut loader, id, &slot)? {
            sd_models::weights::canonicalize(&mut loader, None).map_err(weights(path))?;
        }
        if loader.names_with_prefix(slot.prefix).next().is_none() {
            return Err(unsupported(
                path,
                format!(
                    "no tensors of the {} given with {} (`{}*` after name conversion)",
                    slot.what, slot.flag, slot.prefix
                ),
            ));
        }
    }
    Ok(loader)
}

/// Gives the slot's prefix to the tensors of file `id` when its names are bare: no name
/// under any component prefix, even after name conversion (Black Forest Labs'
/// `flux1-dev.safetensors`, Stability's and city96's transformer files, ComfyUI's
/// `qwen_image_bf16.safetensors`, an LLM text encoder with Hugging Face or llama.cpp names).
/// Returns whether it renamed anything.
fn prefix_bare_file(
    loader: &mut TensorCatalog,
    id: sd_formats::FileId,
    slot: &Slot,
) -> Result<bool, sd_formats::files::FileError> {
    let slots = all_slots();
    let bare = loader
        .names_in_file(id)
        .all(|n| !slots.iter().any(|s| n.starts_with(s.prefix)));
    if bare {
        let prefix = slot.prefix;
        loader.rename(|t| {
            let mut t = t.clone();
            if t.file == id {
                t.name.insert_str(0, prefix);
            }
            vec![t]
        })?;
    }
    Ok(bare)
}

/// The slot name of the T5 encoder (`--t5xxl`) of the DiT families.
const T5_SLOT_NAME: &str = "t5xxl";

/// Refuses a T5 encoder file given for a CLIP or LLM slot and a CLIP file given for the T5 or
/// LLM slot,
/// telling them apart by their marker tensors ([`detect_text_encoder`]); files of neither
/// kind are left to the later checks.
fn check_text_encoder_kind<'a>(
    slot: &Slot,
    path: &Path,
    names: impl IntoIterator<Item = &'a str>,
) -> Result<(), GenerateError> {
    if slot.kind != SlotKind::TextEncoder {
        return Ok(());
    }
    let is_t5_slot = slot.name == T5_SLOT_NAME;
    let is_llm_slot = slot.name == crate::family::qwen_image::LLM_SLOT.name;
    match detect_text_encoder(names) {
        Some(TextEncoderKind::T5) if !is_t5_slot => Err(unsupported(
            path,
            format!(
                "this is a T5 text encoder (encoder.block.*), given with {} for the {}; \
                 T5 encoders go with --{T5_SLOT_NAME}",
                slot.flag, slot.what
            ),
        )),
        Some(TextEncoderKind::Clip) if is_t5_slot || is_llm_slot => Err(unsupported(
            path,
            format!(
                "this is a CLIP text encoder (embeddings.token_embedding), given with {} for \
                 the {}; give it with --clip_l or --clip_g",
                slot.flag, slot.what
            ),
        )),
        _ => Ok(()),
    }
}

/// Checks that every slot of `spec` has tensors and that every component file is for one.
fn check_slots(
    files: &ModelFiles,
    spec: &ModelSpec,
    loader: &TensorCatalog,
    primary: &Path,
) -> Result<(), GenerateError> {
    let slots = spec.slots();
    for (name, path) in &files.components {
        if !slots.iter().any(|s| s.name == name) {
            let flags: Vec<&str> = slots.iter().map(|s| s.flag).collect();
            return Err(unsupported(
                path,
                format!(
                    "{} is not a component of {} models (their components: {})",
                    slot_by_name(name).map_or(name.as_str(), |s| s.flag),
                    spec.family.name(),
                    flags.join(", ")
                ),
            ));
        }
    }
    for slot in slots {
        if loader.names_with_prefix(slot.prefix).next().is_none() {
            return Err(unsupported(
                primary,
                format!(
                    "the model files have no {} (`{}*`); give one with {}",
                    slot.what, slot.prefix, slot.flag
                ),
            ));
        }
    }
    Ok(())
}

/// An error naming the flags to use when the files have no component of some kind at all
/// (no text encoder, diffusion network or first stage under any family's prefix).
fn missing_kind(loader: &TensorCatalog, primary: &Path) -> Result<(), GenerateError> {
    let slots = all_slots();
    for kind in [
        SlotKind::Diffusion,
        SlotKind::TextEncoder,
        SlotKind::FirstStage,
    ] {
        let of_kind: Vec<&Slot> = slots.iter().filter(|s| s.kind == kind).collect();
        if of_kind
            .iter()
            .all(|s| loader.names_with_prefix(s.prefix).next().is_none())
        {
            let flags: Vec<&str> = of_kind.iter().map(|s| s.flag).collect();
            let what = match kind {
                SlotKind::Diffusion => "diffusion model",
                SlotKind::TextEncoder => "text encoder",
                SlotKind::FirstStage => "autoencoder",
            };
            return Err(unsupported(
                primary,
                format!(
                    "the model files have no {what}; give one with {}",
                    flags.join(" or ")
                ),
            ));
        }
    }
    Ok(())
}

pub(crate) fn component_of(kind: SlotKind) -> Component {
    match kind {
        SlotKind::Diffusion => Component::Diffusion,
        SlotKind::TextEncoder => Component::TextEncoder,
        SlotKind::FirstStage => Component::Vae,
    }
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

    /// Loads `files` (see [`ModelFiles`]) with `options`: detects the family and adds its
    /// text encoders, diffusion network and first stage (its encoder too when the files
    /// have one) to a new runtime.
    pub fn open(files: &ModelFiles, options: LoadOptions) -> Result<Pipeline, GenerateError> {
        let loader = open_catalog(files)?;
        let primary = files.primary().unwrap_or(Path::new("")).to_path_buf();
        let _span = tracing::info_span!("load_pipeline", path = %primary.display()).entered();
        let mut spec = match ModelSpec::detect(&loader) {
            Ok(spec) => spec,
            Err(source) => {
                // A component no family could do without is the likelier cause.
                missing_kind(&loader, &primary)?;
                return Err(GenerateError::Config {
                    path: primary,
                    source,
                });
            }
        };
        check_slots(files, &spec, &loader, &primary)?;
        if let Some(skip) = options.clip_skip {
            for (_, arch) in &mut spec.text_encoders {
                // Clip skip is a CLIP setting; other encoders ignore it.
                let TextEncoderArch::Clip(c) = arch else {
                    continue;
                };
                if skip == 0 || skip > c.num_hidden_layers {
                    return Err(GenerateError::InvalidSetting {
                        flag: "clip-skip",
                        message: format!(
                            "{skip} is not between 1 and the text encoder's {} layers",
                            c.num_hidden_layers
                        ),
                    });
                }
                c.clip_skip = skip;
            }
        }
        if let Some(p) = options.prediction {
            spec.prediction = p;
        }
        let mut runtime =
            Runtime::new(options.runtime, loader).map_err(|e| runtime_err(&primary, e))?;
        let main = SourceId::MAIN;
        let file_of = |slot: &Slot| files.file_for(slot).unwrap_or(&primary).to_path_buf();
        let slot_file = |kind: SlotKind, i: usize| {
            let slot = match kind {
                SlotKind::TextEncoder => spec.text_encoders[i].0,
                SlotKind::Diffusion => spec.diffusion.0,
                SlotKind::FirstStage => spec.first_stage.0,
            };
            file_of(&slot)
        };
        let (text, diffusion) =
            crate::refiner::add_networks(&mut runtime, &spec, main, "", &slot_file)?;
        // A transformer reads its sizes from the tensors: the spec describes the loaded one.
        match &diffusion.1 {
            DiffusionNet::Flux(m) => {
                spec.diffusion.1 = sd_models::diffusion::DiffusionArch::Flux(m.config.clone())
            }
            DiffusionNet::Mmdit(m) => {
                spec.diffusion.1 = sd_models::diffusion::DiffusionArch::Mmdit(m.config.clone())
            }
            DiffusionNet::QwenImage(m) => {
                spec.diffusion.1 = sd_models::diffusion::DiffusionArch::QwenImage(m.config.clone())
            }
            DiffusionNet::Unet(_) => {}
        }
        if diffusion.1.has_text_embedding() {
            // A transformer's text embedding and RoPE tables are the same at every step of
            // a run: keep them on the device between steps (within the budget; given up
            // for good when they do not fit).
            runtime
                .keep_constants(diffusion.0, true)
                .map_err(|e| runtime_err(&primary, e))?;
        }
        let (fslot, mut farch) = spec.first_stage.clone();
        let has_encoder = runtime
            .catalog(main)
            .is_some_and(|c| c.get(&farch.encoder_probe()).is_some());
        farch.set_with_encoder(has_encoder);
        let first_stage = runtime
            .add_model("vae", component_of(fslot.kind), main, |pb| {
                FirstStage::new(pb, &farch)
            })
            .map_err(|e| runtime_err(&file_of(&fslot), e))?;
        Ok(Pipeline {
            spec,
            path: primary,
            runtime,
            text,
            diffusion,
            first_stage,
            refiner: None,
        })
    }

    /// Loads the weights of every model now where they would stay in RAM anyway (see
    /// [`Runtime::preload`]); `progress(done, total)` counts parameters over all models.
    pub fn preload(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<(), GenerateError> {
        let models = self.handles().all();
        let total: usize = models
            .iter()
            .map(|h| self.runtime.param_ids(*h).map_or(0, <[_]>::len))
            .sum();
        let mut base = 0;
        let t = std::time::Instant::now();
        let mut loaded = 0;
        for h in models {
            let n = self.runtime.param_ids(h).map_or(0, <[_]>::len);
            if self
                .runtime
                .preload(h, &mut |d, _| progress(base + d, total))
                .map_err(|e| runtime_err(&self.path, e))?
            {
                loaded += 1;
            }
            base += n;
        }
        tracing::info!(
            models = loaded,
            seconds = t.elapsed().as_secs_f64(),
            "preload completed"
        );
        Ok(())
    }

    /// The detected family and configuration.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Whether the first stage's encoder was loaded (img2img needs it).
    pub fn has_vae_encoder(&self) -> bool {
        self.first_stage.1.has_encoder()
    }

    /// The runtime handles of the text encoders, the diffusion network and the first stage.
    pub fn handles(&self) -> PipelineModels {
        let text_encoders: Vec<ModelHandle> = self.text.iter().map(|(h, _)| *h).collect();
        PipelineModels {
            text_encoder: text_encoders.first().copied().unwrap_or(self.diffusion.0),
            text_encoders,
            unet: self.diffusion.0,
            vae: self.first_stage.0,
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
