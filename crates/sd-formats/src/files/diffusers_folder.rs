//! Diffusers pipeline folders (`save_pretrained` output, a Hugging Face snapshot): a folder
//! with a `model_index.json` and one sub-folder per component (`unet/`, `transformer/`,
//! `vae/`, `text_encoder/`, `text_encoder_2/`, `text_encoder_3/`), each holding its weights
//! as `diffusion_pytorch_model.safetensors` (models) or `model.safetensors` (transformers
//! text encoders), an `.fp16.` variant, a sharded `*.safetensors.index.json`, or a `.bin`.
//!
//! Each component's tensors are read under the folder's name as prefix (`unet.`,
//! `text_encoder_2.`): the name tables (`crate::names`) take diffusers names with exactly
//! those prefixes, which settles which text encoder is which. Tokenizer and scheduler
//! folders hold no weights and are not read.

use std::path::{Path, PathBuf};

use super::error::{Ctx, FileError};

/// The component folders read, with the name prefix of their tensors.
pub const COMPONENTS: [(&str, &str); 6] = [
    ("unet", "unet."),
    ("transformer", "transformer."),
    ("vae", "vae."),
    ("text_encoder", "text_encoder."),
    ("text_encoder_2", "text_encoder_2."),
    ("text_encoder_3", "text_encoder_3."),
];

/// Weight file names looked for in a component folder, in order of preference.
pub const WEIGHT_FILES: [&str; 10] = [
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
    "diffusion_pytorch_model.fp16.safetensors",
    "model.fp16.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
    "model.safetensors.index.json",
    "diffusion_pytorch_model.fp16.safetensors.index.json",
    "model.fp16.safetensors.index.json",
    "diffusion_pytorch_model.bin",
    "pytorch_model.bin",
];

/// One component of a diffusers folder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FolderComponent {
    /// The sub-folder name (`unet`, `text_encoder_2`, ...).
    pub folder: &'static str,
    /// The prefix its tensor names get (`unet.`).
    pub prefix: &'static str,
    /// Its weight file (or shard index).
    pub path: PathBuf,
}

/// Whether `dir` looks like a diffusers pipeline folder: a directory with a
/// `model_index.json` or at least one component sub-folder.
pub fn is_diffusers_folder(dir: &Path) -> bool {
    dir.is_dir()
        && (dir.join("model_index.json").is_file()
            || COMPONENTS.iter().any(|(f, _)| dir.join(f).is_dir()))
}

/// The components of the diffusers folder `dir` that are present, each with its weight
/// file. A component folder without any of [`WEIGHT_FILES`] is an error naming it; a folder
/// with no component at all is an error too.
pub fn components(dir: &Path) -> Result<Vec<FolderComponent>, FileError> {
    let ctx = Ctx::new(dir);
    if !dir.is_dir() {
        return Err(ctx.unsupported("not a directory"));
    }
    let mut out = Vec::new();
    for (folder, prefix) in COMPONENTS {
        let sub = dir.join(folder);
        if !sub.is_dir() {
            continue;
        }
        let path = WEIGHT_FILES
            .iter()
            .map(|name| sub.join(name))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                Ctx::new(&sub).unsupported(format!(
                    "the diffusers component folder `{folder}/` has no weights (looked for {})",
                    WEIGHT_FILES.join(", ")
                ))
            })?;
        out.push(FolderComponent {
            folder,
            prefix,
            path,
        });
    }
    if out.is_empty() {
        return Err(ctx.unsupported(format!(
            "a directory that is not a diffusers pipeline folder (none of the component \
             folders {})",
            COMPONENTS
                .iter()
                .map(|(f, _)| format!("{f}/"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sd-rs-dfolder-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn finds_each_component_file_by_preference() {
        let d = tmp("pref");
        std::fs::write(d.join("model_index.json"), "{}").unwrap();
        for (f, file) in [
            ("unet", "diffusion_pytorch_model.fp16.safetensors"),
            ("text_encoder", "model.safetensors"),
            ("tokenizer", "vocab.json"),
        ] {
            std::fs::create_dir_all(d.join(f)).unwrap();
            std::fs::write(d.join(f).join(file), b"x").unwrap();
        }
        // Both the plain and the fp16 file: the plain one wins.
        std::fs::write(d.join("unet/diffusion_pytorch_model.safetensors"), b"x").unwrap();
        assert!(is_diffusers_folder(&d));
        let c = components(&d).unwrap();
        let got: Vec<(&str, &str, String)> = c
            .iter()
            .map(|c| {
                (
                    c.folder,
                    c.prefix,
                    c.path.file_name().unwrap().to_string_lossy().into_owned(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "unet",
                    "unet.",
                    "diffusion_pytorch_model.safetensors".into()
                ),
                ("text_encoder", "text_encoder.", "model.safetensors".into()),
            ]
        );
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_component_without_weights_and_an_empty_folder_are_errors() {
        let d = tmp("empty");
        let e = components(&d).unwrap_err().to_string();
        assert!(e.contains("not a diffusers pipeline folder"), "{e}");
        std::fs::create_dir_all(d.join("vae")).unwrap();
        let e = components(&d).unwrap_err().to_string();
        assert!(e.contains("vae/") && e.contains("no weights"), "{e}");
        std::fs::remove_dir_all(&d).ok();
    }
}
