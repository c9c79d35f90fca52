//! Model family detection from tensor names and shapes.
//!
//! See [`detect_version`] for the evidence used.

use std::fmt;

/// A diffusion model family that sd-rs tells apart by its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum SdVersion {
    /// Stable Diffusion 1.x (CLIP ViT-L text encoder, 768-wide context).
    Sd1,
    /// SD1.x inpainting UNet (9 input channels).
    Sd1Inpaint,
    /// SD1.x InstructPix2Pix UNet (8 input channels).
    Sd1Pix2Pix,
    /// Stable Diffusion 2.x (OpenCLIP ViT-H text encoder, 1024-wide context). The 768-v and
    /// 512-base checkpoints are not distinguishable by their weights.
    Sd2,
    /// SD2.x inpainting UNet (9 input channels).
    Sd2Inpaint,
    /// Stable Diffusion XL base (CLIP-L + OpenCLIP-G, 2048-wide context, `label_emb`).
    Sdxl,
    /// SDXL inpainting UNet (9 input channels).
    SdxlInpaint,
    /// SDXL InstructPix2Pix-style edit UNet (8 input channels).
    SdxlPix2Pix,
    /// SDXL refiner (OpenCLIP-G only, 1280-wide context, `label_emb`).
    SdxlRefiner,
    /// Stable Diffusion 3 / 3.5 (MMDiT).
    Sd3,
    /// Flux.1 dev / schnell.
    Flux,
    /// Flux.1 Fill (image input of 384 channels).
    FluxFill,
    /// Flux.2.
    Flux2,
    /// Qwen-Image.
    QwenImage,
}

impl SdVersion {
    /// A short lower-case name (`sd1`, `sdxl-inpaint`, `qwen-image`, ...).
    pub fn name(self) -> &'static str {
        match self {
            SdVersion::Sd1 => "sd1",
            SdVersion::Sd1Inpaint => "sd1-inpaint",
            SdVersion::Sd1Pix2Pix => "sd1-pix2pix",
            SdVersion::Sd2 => "sd2",
            SdVersion::Sd2Inpaint => "sd2-inpaint",
            SdVersion::Sdxl => "sdxl",
            SdVersion::SdxlInpaint => "sdxl-inpaint",
            SdVersion::SdxlPix2Pix => "sdxl-pix2pix",
            SdVersion::SdxlRefiner => "sdxl-refiner",
            SdVersion::Sd3 => "sd3",
            SdVersion::Flux => "flux",
            SdVersion::FluxFill => "flux-fill",
            SdVersion::Flux2 => "flux2",
            SdVersion::QwenImage => "qwen-image",
        }
    }

    /// SD1.x and its UNet variants.
    pub fn is_sd1(self) -> bool {
        matches!(
            self,
            SdVersion::Sd1 | SdVersion::Sd1Inpaint | SdVersion::Sd1Pix2Pix
        )
    }

    /// SD2.x and its UNet variants.
    pub fn is_sd2(self) -> bool {
        matches!(self, SdVersion::Sd2 | SdVersion::Sd2Inpaint)
    }

    /// SDXL and its UNet variants, the refiner included.
    pub fn is_sdxl(self) -> bool {
        matches!(
            self,
            SdVersion::Sdxl
                | SdVersion::SdxlInpaint
                | SdVersion::SdxlPix2Pix
                | SdVersion::SdxlRefiner
        )
    }

    /// The Flux family.
    pub fn is_flux(self) -> bool {
        matches!(
            self,
            SdVersion::Flux | SdVersion::FluxFill | SdVersion::Flux2
        )
    }

    /// Whether the diffusion model is an LDM UNet (SD1, SD2, SDXL) rather than a DiT.
    pub fn is_unet(self) -> bool {
        self.is_sd1() || self.is_sd2() || self.is_sdxl()
    }

    /// Whether this is an inpainting UNet (9 input channels).
    pub fn is_inpaint(self) -> bool {
        matches!(
            self,
            SdVersion::Sd1Inpaint | SdVersion::Sd2Inpaint | SdVersion::SdxlInpaint
        )
    }

    /// The cross-attention context width of the UNet families, `None` for DiTs.
    pub fn context_dim(self) -> Option<u64> {
        if self.is_sd1() {
            Some(768)
        } else if self.is_sd2() {
            Some(1024)
        } else if self == SdVersion::SdxlRefiner {
            Some(1280)
        } else if self.is_sdxl() {
            Some(2048)
        } else {
            None
        }
    }
}

impl fmt::Display for SdVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Prefixes under which a diffusion model's own names may appear; the empty prefix (bare
/// names, a diffusers `unet/` or `transformer/` file) is tried last.
const DIFFUSION_PREFIXES: [&str; 4] = [
    "model.diffusion_model.",
    "diffusion_model.",
    "unet.",
    "transformer.",
];

/// Everything detection learns in one pass over the names.
#[derive(Default, Debug)]
struct Evidence {
    unet: bool,
    label_emb: bool,
    context_dim: Option<u64>,
    unet_in_channels: Option<u64>,
    joint_blocks: bool,
    dit_pos_embed: bool,
    dit_transformer_blocks: bool,
    flux_blocks: bool,
    flux2: bool,
    flux_img_in: Option<u64>,
    hunyuan: bool,
    qwen_image: bool,
    openclip_text: bool,
    second_text_encoder: bool,
    text_hidden: Option<u64>,
}

impl Evidence {
    fn observe(&mut self, name: &str, shape: &[u64]) {
        self.observe_text_encoder(name, shape);
        let rel = DIFFUSION_PREFIXES
            .iter()
            .find_map(|p| name.strip_prefix(p))
            .unwrap_or(name);
        self.observe_diffusion(rel, shape);
    }

    fn observe_text_encoder(&mut self, name: &str, shape: &[u64]) {
        if name.starts_with("cond_stage_model.model.") {
            self.openclip_text = true;
        }
        if name.starts_with("conditioner.embedders.1.")
            || name.starts_with("cond_stage_model.1.")
            || name.starts_with("text_encoder_2.")
        {
            self.second_text_encoder = true;
        }
        let first_encoder_embedding = [
            "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
            "cond_stage_model.transformer.embeddings.token_embedding.weight",
            "cond_stage_model.model.token_embedding.weight",
            "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight",
            "text_encoder.text_model.embeddings.token_embedding.weight",
            "text_encoder.embeddings.token_embedding.weight",
        ];
        if first_encoder_embedding.contains(&name) && shape.len() == 2 {
            self.text_hidden = Some(shape[1]);
        }
    }

    fn observe_diffusion(&mut self, rel: &str, shape: &[u64]) {
        const UNET_HEADS: [&str; 7] = [
            "input_blocks.",
            "middle_block.",
            "output_blocks.",
            "down_blocks.",
            "up_blocks.",
            "mid_block.",
            "time_embedding.",
        ];
        let in_unet_block = UNET_HEADS.iter().any(|h| rel.starts_with(h));
        if in_unet_block {
            self.unet = true;
            if rel.ends_with(".attn2.to_k.weight") && shape.len() == 2 {
                // A Linear weight is [out, in]: the input width is the context width.
                self.context_dim.get_or_insert(shape[1]);
            }
        }
        if rel.starts_with("label_emb.") || rel.starts_with("add_embedding.") {
            self.label_emb = true;
        }
        if (rel == "input_blocks.0.0.weight" || rel == "conv_in.weight") && shape.len() == 4 {
            self.unet_in_channels = Some(shape[1]);
        }
        if rel.starts_with("joint_blocks.") {
            self.joint_blocks = true;
        }
        if rel == "pos_embed.proj.weight" {
            self.dit_pos_embed = true;
        }
        if rel.starts_with("transformer_blocks.") {
            self.dit_transformer_blocks = true;
            if is_qwen_image_modulation(rel) {
                self.qwen_image = true;
            }
        }
        if rel.starts_with("double_blocks.")
            || rel.starts_with("single_blocks.")
            || rel.starts_with("single_transformer_blocks.")
        {
            self.flux_blocks = true;
        }
        if rel.starts_with("double_stream_modulation_img.") {
            self.flux2 = true;
        }
        if (rel == "img_in.weight" || rel == "x_embedder.weight") && shape.len() == 2 {
            self.flux_img_in = Some(shape[1]);
        }
        if rel.starts_with("txt_in.individual_token_refiner.") {
            self.hunyuan = true;
        }
    }

    fn decide(&self) -> Option<SdVersion> {
        if self.qwen_image {
            return Some(SdVersion::QwenImage);
        }
        if self.flux2 {
            return Some(SdVersion::Flux2);
        }
        if self.flux_blocks && !self.hunyuan {
            return Some(if self.flux_img_in == Some(384) {
                SdVersion::FluxFill
            } else {
                SdVersion::Flux
            });
        }
        if self.joint_blocks || (self.dit_pos_embed && self.dit_transformer_blocks) {
            return Some(SdVersion::Sd3);
        }
        if !self.unet {
            return None;
        }
        let channels = self.unet_in_channels.unwrap_or(4);
        let xl = self.label_emb
            || self.context_dim == Some(2048)
            || (self.context_dim.is_none() && self.second_text_encoder);
        if xl {
            if self.context_dim == Some(1280) {
                return (channels == 4).then_some(SdVersion::SdxlRefiner);
            }
            return match channels {
                4 => Some(SdVersion::Sdxl),
                9 => Some(SdVersion::SdxlInpaint),
                8 => Some(SdVersion::SdxlPix2Pix),
                _ => None,
            };
        }
        let context = self.context_dim.or(if self.openclip_text {
            Some(1024)
        } else {
            self.text_hidden
        });
        match (context, channels) {
            (Some(768), 4) => Some(SdVersion::Sd1),
            (Some(768), 9) => Some(SdVersion::Sd1Inpaint),
            (Some(768), 8) => Some(SdVersion::Sd1Pix2Pix),
            (Some(1024), 4) => Some(SdVersion::Sd2),
            (Some(1024), 9) => Some(SdVersion::Sd2Inpaint),
            _ => None,
        }
    }
}

/// `transformer_blocks.<N>.img_mod.1.weight`, Qwen-Image's per-block image modulation.
fn is_qwen_image_modulation(rel: &str) -> bool {
    rel.strip_prefix("transformer_blocks.")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(idx, rest)| {
            !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) && rest == "img_mod.1.weight"
        })
}

/// Detects the model family from tensor names and shapes (outermost dimension first).
///
/// Detection looks at a handful of characteristic tensors and works on the original
/// single-file names and on the diffusers names alike, with or without the component
/// prefixes (`model.diffusion_model.`, `unet.`, `transformer.`, or none):
///
/// | family | evidence |
/// |---|---|
/// | Qwen-Image | `transformer_blocks.N.img_mod.1.weight` |
/// | Flux.2 | `double_stream_modulation_img.*` |
/// | Flux.1 | `double_blocks.*` / `single_blocks.*` (original), `single_transformer_blocks.*` (diffusers); Fill when the image input takes 384 channels |
/// | SD3 / SD3.5 | `joint_blocks.*` (original), `pos_embed.proj.weight` with `transformer_blocks.*` (diffusers) |
/// | SDXL | `label_emb.*` / `add_embedding.*`, or a 2048-wide cross-attention context, or a second text encoder |
/// | SDXL refiner | `label_emb.*` with a 1280-wide cross-attention context |
/// | SD2.x | 1024-wide cross-attention context (`attn2.to_k.weight` is `[inner, 1024]`), else an OpenCLIP / 1024-wide text encoder |
/// | SD1.x | 768-wide cross-attention context, else a 768-wide text encoder |
///
/// The UNet variants come from the input channels of `input_blocks.0.0.weight` /
/// `conv_in.weight`: 4 is the base model, 9 inpainting, 8 InstructPix2Pix.
///
/// What the weights cannot tell: the prediction type. SD2.x 768-v (v-prediction) and SD2.x
/// 512-base (epsilon) have identical tensors, as do v-prediction fine-tunes of SD1.x/SDXL;
/// the caller must get it from metadata, a config file or the user.
///
/// Returns `None` when the tensors hold no diffusion model of a known family (a VAE or a
/// text encoder alone, an upscaler, a LoRA, HunyuanVideo) or the evidence is contradictory,
/// e.g. a UNet with an unusual number of input channels (SD2 depth-to-image's 5).
pub fn detect_version<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [u64])>,
) -> Option<SdVersion> {
    let mut evidence = Evidence::default();
    for (name, shape) in tensors {
        evidence.observe(name, shape);
    }
    evidence.decide()
}

/// [`detect_version`] over a storage list.
pub fn detect_version_of(storages: &[crate::TensorStorage]) -> Option<SdVersion> {
    detect_version(
        storages
            .iter()
            .map(|s| (s.name.as_str(), s.shape.as_slice())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detect(entries: &[(&str, &[u64])]) -> Option<SdVersion> {
        detect_version(entries.iter().map(|(n, s)| (*n, *s)))
    }

    #[test]
    fn qwen_image_modulation_name() {
        assert!(is_qwen_image_modulation(
            "transformer_blocks.12.img_mod.1.weight"
        ));
        assert!(!is_qwen_image_modulation(
            "transformer_blocks..img_mod.1.weight"
        ));
        assert!(!is_qwen_image_modulation(
            "transformer_blocks.1.img_mod.1.bias"
        ));
    }

    #[test]
    fn nothing_known_is_none() {
        assert_eq!(detect(&[]), None);
        assert_eq!(
            detect(&[("first_stage_model.decoder.conv_in.weight", &[512, 4, 3, 3])]),
            None
        );
    }

    #[test]
    fn unusual_channel_count_is_none() {
        let t: &[(&str, &[u64])] = &[
            (
                "model.diffusion_model.input_blocks.0.0.weight",
                &[320, 5, 3, 3],
            ),
            (
                "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
                &[320, 1024],
            ),
        ];
        assert_eq!(detect(t), None);
    }

    #[test]
    fn context_from_text_encoder_when_no_attention() {
        let t: &[(&str, &[u64])] = &[
            (
                "model.diffusion_model.input_blocks.0.0.weight",
                &[320, 4, 3, 3],
            ),
            (
                "cond_stage_model.model.token_embedding.weight",
                &[49408, 1024],
            ),
        ];
        assert_eq!(detect(t), Some(SdVersion::Sd2));
    }

    #[test]
    fn names_round_trip() {
        assert_eq!(SdVersion::SdxlInpaint.to_string(), "sdxl-inpaint");
        assert_eq!(SdVersion::Sd2.context_dim(), Some(1024));
        assert!(SdVersion::FluxFill.is_flux() && !SdVersion::FluxFill.is_unet());
    }
}
